"""ckptlab against PyTorch's own memory estimator (torch.distributed._tools: MemTracker and the SAC
ILP's baseline peak) on the model and step of test_sac_ilp.py::test_sac_ilp_case1, which asserts
its estimate to ±5% of PYTORCH_PEAK_BYTES. docs/measurements.md, "PyTorch's own estimator",
explains each term."""

import pytest

import ckptlab
from tests.reference_models import BATCH, PYTORCH_PEAK_BYTES, SEQ, pytorch_estimate, sac_ilp_transformer

TOLERANCE = 0.05  # test_sac_ilp.py's own: assertAlmostEqual(peak_mem / 2583888896, 1, delta=0.05)


@pytest.fixture(scope="module")
def reference():
    return pytorch_estimate()


def test_pytorch_estimator_on_ckptlab_cuda_step_gives_its_published_peak(reference):
    # ckptlab's CUDA semantics (memory-efficient attention's saved output and logsumexp, bool
    # dropout masks) are what PyTorch's estimator saw on fake CUDA tensors.
    assert reference.module == "Transformer"
    assert reference.peak_bytes == pytest.approx(PYTORCH_PEAK_BYTES, rel=TOLERANCE)


def test_ckptlab_peak_differs_from_the_reference_by_what_each_counts(reference):
    pred = ckptlab.predict(sac_ilp_transformer(), BATCH, SEQ, "none", dtype="fp32", loop="adamw-foreach",
                           device="cuda")
    assert (pred.attention_backend, pred.peak_phase) == ("efficient", "forward")
    cat = pred.peak_by_category
    # The reference counts the previous iteration's logits (test_sac_ilp keeps `output` alive
    # into the next forward) and adds the root's backward activation gradients to all forward
    # activations; ckptlab's step frees its output and peaks at the end of the forward, holding
    # the optimizer state (which the reference leaves out), the cuBLAS workspaces and the
    # allocator's rounding.
    previous_logits_bytes = BATCH * SEQ * 8192 * 4
    assert previous_logits_bytes == cat["temporaries"]  # this step's own logits, alive at its peak
    explained = (PYTORCH_PEAK_BYTES - previous_logits_bytes - reference.act_grad_bytes
                 + cat["optimizer_state"] + cat["workspaces"] + cat["rounding"])
    assert pred.peak_bytes == pytest.approx(explained, rel=1e-4)
    # Without that accounting ckptlab's allocated peak is outside PyTorch's ±5%: they measure
    # different things.
    assert abs(pred.peak_bytes / PYTORCH_PEAK_BYTES - 1) > TOLERANCE


def test_ckptlab_peak_of_the_reference_loop_is_within_its_tolerance(reference):
    # The loop of test_sac_ilp (`output = model(inp)` at loop scope) keeps the previous output
    # into the next forward: predicted as that loop runs, ckptlab's peak is within PyTorch's ±5%.
    pred = ckptlab.predict(sac_ilp_transformer(), BATCH, SEQ, "none", dtype="fp32",
                           loop="adamw-foreach,holds-output", device="cuda")
    assert pred.peak_bytes == pytest.approx(PYTORCH_PEAK_BYTES, rel=TOLERANCE)
    assert pred.peak_phase == "forward"
    cat = pred.peak_by_category
    # Term by term, to the byte, against the estimator run on this very step: it adds the root's
    # backward activation gradients and leaves out the optimizer state, the cuBLAS workspaces,
    # the allocator's rounding counted apart, and the batch (made before its tracking starts).
    batch_bytes = BATCH * SEQ * 8
    assert pred.peak_bytes == (reference.peak_bytes - reference.act_grad_bytes + cat["optimizer_state"]
                               + cat["workspaces"] + cat["rounding"] + batch_bytes)
