import gc
import os

import pytest
import torch

from ckptlab.estimate.fake_step import clear_prepared

os.environ.setdefault("MPLBACKEND", "agg")
# Every prediction is made, none taken from the predictions a user's runs kept on disk
# (`estimate.answers`); the notebooks' kernels and papermill's inherit it. The cache's own tests
# point it at a folder of their own.
os.environ["CKPTLAB_CACHE"] = "off"
# Two pytest workers share two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def _objects_so_far_frozen():
    """ckptlab calls gc.collect() after every measurement, and torch, transformers and the test
    modules leave some 400k long-lived objects in a test process: each full collection walked them
    all, about half a second on a busy core. Collected here, then frozen, a collection walks only
    what the module's own tests made. The assertions are unchanged: objects a test makes are never
    frozen while it runs (only an object alive now that turns into cyclic garbage later is kept,
    until the worker exits)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _no_prepared_steps_across_tests():
    """Each test predicts from models it prepares itself (a prepared step is reused within a test:
    `estimate.fake_step.prepared_step`), so that what one test patches never reaches another's."""
    yield
    clear_prepared()
