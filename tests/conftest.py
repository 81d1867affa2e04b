import os

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "agg")
# Two pytest workers share two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
