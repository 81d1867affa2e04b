import collections
import contextlib
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ckptlab import apply_checkpointing, get_workload, measure, predict, track_memory
from ckptlab.core.units import format_bytes, format_count, parse_bytes
from ckptlab.estimate.cuda_device import BlasUse
from ckptlab.probe import memory
from ckptlab.probe.memory import _native_log_dropped, fake_device, profiler_peak_bytes
from ckptlab.probe.step import make_optimizer, training_step
from ckptlab.workloads.models import mlp_chain_activation_bytes

MLP = dict(n_layer=8, n_embd=32)


@pytest.mark.parametrize("density, n_checkpointed", [(0, 0), (0.5, 4), (1, 8)])
def test_mlp_chain_activation_bytes_equal_hand_count(density, n_checkpointed):
    workload = get_workload("mlp-chain", **MLP)
    record = measure(workload, 4, 8, f"density={density}", steps=1, warmup=0, max_seconds=0.1, loop="none")
    expected = mlp_chain_activation_bytes(workload.config, 4, 8, n_checkpointed)
    assert record["saved_activation_bytes"] == expected


def test_mlp_chain_parameter_and_optimizer_bytes_equal_hand_count():
    workload = get_workload("mlp-chain", **MLP)
    record = measure(workload, 4, 8, "none", steps=1, warmup=0, max_seconds=0.1, loop="adamw")
    h, n = MLP["n_embd"], MLP["n_layer"]
    n_params = n * (h * 4 * h + 4 * h + 4 * h * h + h)
    assert record["peak_parameters_bytes"] == 4 * n_params
    # AdamW keeps exp_avg and exp_avg_sq (fp32, one each per parameter element) and a 0-d fp32
    # step counter per parameter tensor (4 tensors a block).
    assert record["peak_optimizer_state_bytes"] == 2 * 4 * n_params + 4 * (4 * n)


def test_peak_falls_monotonically_with_density_on_gpt():
    workload = get_workload("gpt-tiny")
    peaks = [measure(workload, 4, 64, f"density={d}", steps=1, warmup=0, max_seconds=0.1)["peak_bytes"]
             for d in (0, 0.25, 0.5, 0.75, 1)]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks


def test_full_removes_at_least_60_percent_of_activation_memory_on_gpt_tiny():
    workload = get_workload("gpt-tiny")
    none = measure(workload, 4, 64, "none", steps=1, warmup=0, max_seconds=0.1)
    full = measure(workload, 4, 64, "full", steps=1, warmup=0, max_seconds=0.1)
    assert full["saved_activation_bytes"] <= 0.4 * none["saved_activation_bytes"]
    assert full["peak_activations_bytes"] <= 0.4 * none["peak_activations_bytes"]


@pytest.mark.parametrize("name, policy", [("gpt-tiny", "none"), ("gpt-tiny", "full"),
                                          ("gpt-tiny", "segments=2"), ("mlp-chain", "density=0.5")])
def test_tracker_agrees_with_the_profilers_allocator_count(name, policy):
    workload = get_workload(name, n_layer=4)
    model = workload.build()
    apply_checkpointing(model, policy)
    batch = workload.batch(4, 32)
    optimizer = make_optimizer("adamw", model)
    step = training_step(model, workload, batch, optimizer)
    step()  # optimizer state exists before both counts
    with track_memory(model, optimizer, inputs=batch) as tracker:
        step(tracker)
    report = tracker.report()
    allocator_peak = profiler_peak_bytes(step)
    assert (report.peak_bytes - report.start_bytes) == pytest.approx(allocator_peak, rel=0.01)


def test_categories_add_up_and_phases_are_recorded():
    record = measure("gpt-tiny", 2, 32, "density=0.5", steps=1, warmup=0, max_seconds=0.1)
    parts = sum(record[f"peak_{c}_bytes"] for c in
                ("parameters", "gradients", "optimizer_state", "activations", "temporaries"))
    assert parts == record["peak_bytes"]
    assert record["peak_phase"] in ("forward", "backward", "optimizer")


def test_timeline_rises_in_forward_and_falls_in_backward():
    workload = get_workload("gpt-tiny", n_layer=2)
    model = workload.build()
    batch = workload.batch(2, 32)
    step = training_step(model, workload, batch, None)
    with track_memory(model, inputs=batch) as tracker:
        step(tracker)
    timeline = tracker.report().timeline
    forward = [b for p, b in timeline if p == "forward"]
    backward = [b for p, b in timeline if p == "backward"]
    assert max(forward) > forward[0] and backward[-1] < max(backward)


def test_live_bytes_and_timeline_are_read_while_tracking():
    with track_memory(device="cpu") as tracker:
        a = torch.empty(1000)
        live = tracker.live_bytes()
        steps = len(tracker.timeline)
        del a
        assert len(tracker.live_bytes()) == len(live) - 1 and len(tracker.timeline) == steps + 1
    assert sorted(live.values()) == [4000] and tracker.timeline[-1][1] == 0


def test_views_are_counted_once():
    with track_memory(device="cpu") as tracker:
        x = torch.empty(1000, dtype=torch.float32)
        views = [x[:10], x.view(10, 100), x.t() if x.dim() == 2 else x.unsqueeze(0)]
    report = tracker.report()
    assert report.peak_bytes == 4000 and len(views) == 3


def test_freed_tensors_leave_the_count():
    with track_memory(device="cpu") as tracker:
        a = torch.ones(1000)
        del a
        b = torch.ones(500)
    report = tracker.report()
    assert report.peak_bytes == 4000 and report.timeline[-1][1] == 2000 and b.numel() == 500


@pytest.mark.parametrize("text, expected", [("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9),
                                            ("1.5e3", 1500), (1024, 1024), ("100 kib", 102400)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["abc", "-1GiB", "0", "12 parsecs", "GiB"])
def test_parse_bytes_rejects_with_a_clear_error(text):
    with pytest.raises(ValueError, match=r"memory_limit=.* is invalid: allowed is a positive size such as 24GiB"):
        parse_bytes(text)


def test_format_count_is_exact_below_a_million():
    assert [format_count(n) for n in (0, 512, 45_344, 999_999)] == ["0", "512", "45,344", "999,999"]
    assert [format_count(n) for n in (10**6, 124_439_808, 6_738_415_616)] == ["1.0M", "124.4M", "6.7B"]


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


def test_detect_backward_finds_the_phase_switch_without_a_call():
    """The same step with explicit phase calls and with detect_backward: the same peak and the
    same timeline, in the same phases. The bytes held for backward differ by exactly the gradient seed
    (a ones tensor like the loss) that `backward()` makes before autograd's engine starts."""
    workload = get_workload("gpt-tiny", n_layer=2)
    model = workload.build()
    batch = workload.batch(2, 32)
    reports = []
    for detect in (False, True):
        with track_memory(model, inputs=batch, detect_backward=detect) as tracker:
            loss = workload.loss(model, batch)
            if not detect:
                tracker.phase("backward")
            loss.backward()
        model.zero_grad(set_to_none=True)
        reports.append(tracker.report())
    manual, detected = reports
    assert detected.peak_bytes == manual.peak_bytes
    assert manual.saved_activation_bytes > 0
    assert detected.saved_activation_bytes - manual.saved_activation_bytes == loss.element_size() * loss.numel()
    manual_phases, detected_phases = ([p for p, _ in r.timeline] for r in reports)
    assert [b for _, b in detected.timeline] == [b for _, b in manual.timeline]
    assert manual_phases.count("backward") - detected_phases.count("backward") == 1  # the seed
    assert detected_phases.index("backward") == manual_phases.index("backward") + 1


def test_optimizer_state_made_inside_the_region_is_optimizer_state_at_the_peak():
    """AdamW's first step creates its state inside the tracked step (no warm-up step): the state
    is alive at the optimizer-phase peak and counted as optimizer state there, not as temporaries."""
    workload = get_workload("mlp-chain", **MLP)
    model = workload.build()
    optimizer = make_optimizer("adamw", model)
    batch = workload.batch(4, 8)
    with track_memory(model, optimizer, inputs=batch) as tracker:
        training_step(model, workload, batch, optimizer)(tracker)
    report = tracker.report()
    state_bytes = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values())
    assert report.peak_phase == "optimizer"
    assert report.peak_by_category["optimizer_state"] == state_bytes
    assert sum(report.peak_by_category.values()) == report.peak_bytes


def test_the_profilers_own_log_lines_do_not_reach_the_terminal(capfd):
    # Kineto writes "USDT: ... profiler_start" / "profiler_stop" to file descriptor 2 on every run
    assert profiler_peak_bytes(lambda: torch.ones(1000) * 2) >= 4000
    out, err = capfd.readouterr()
    assert "USDT" not in out + err and "profiler_start" not in err


def test_what_else_native_code_writes_to_stderr_is_passed_on(capfd):
    with _native_log_dropped():
        os.write(2, b"USDT:2026-12-01 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"an error a library printed\n")
    _, err = capfd.readouterr()
    assert err == "an error a library printed\n"


def test_tensors_a_checkpoint_holds_are_activations_at_a_forward_peak():
    # A cache that holds tensors under its own saved-tensor hooks, as selective checkpointing's
    # does: the tracker's hook never sees them, yet they are held for backward.
    x = torch.randn(64, 64, requires_grad=True)
    cache = []
    with track_memory(inputs=[x]) as tracker:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            for _ in range(3):
                cache.append(x * 2)
        transient = x * 3          # freed before forward ends: a temporary at the peak
        peak_now = x * 4
        del transient, peak_now
        tracker.phase("backward")
    report = tracker.report()
    held = 3 * 64 * 64 * 4
    assert report.peak_phase == "forward"
    assert report.peak_by_category["activations"] == held + x.untyped_storage().nbytes()
    assert report.peak_by_category["temporaries"] == 2 * 64 * 64 * 4


def test_selective_cache_counts_as_activations_in_blocks_at_a_forward_peak():
    # Llama-like proportions under bf16 autocast: selective checkpointing's peak falls in forward,
    # where its cache holds the matmul outputs of every block (predicted: the same tracker).
    workload = get_workload("llama7b-shape", n_layer=4, n_embd=256, n_head=4, vocab_size=512, block_size=1024)
    p = predict(workload, 4, 1024, "selective", dtype="bf16")
    assert p.peak_phase == "forward"
    assert p.peak_by_category["activations"] >= 0.9 * p.saved_activation_bytes
    assert p.peak_in_blocks_by_category["activations"] >= 0.5 * p.peak_by_category["activations"]
    assert sum(p.peak_by_category.values()) == p.peak_bytes


def test_the_block_whose_backward_holds_the_peak_is_reported():
    workload = get_workload("gpt-tiny", n_layer=4)
    record, report = measure(workload, 4, 64, "full", steps=1, warmup=0, max_seconds=0.1, loop="none", with_report=True)
    # Gradients accumulate as backward runs, so the first block's backward (the last to run) holds most.
    assert (report.peak_phase, report.peak_block) == ("backward", 0)
    assert report.block_calls_in_backward == 0   # ckptlab recomputes through the block's own forward


class _Dispatched(TorchDispatchMode):
    """Counts the ops that reach it."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _fake_backward(*modes_above) -> tuple[collections.Counter, list]:
    """A fake step's forward and backward, with `modes_above` over a counting mode: (the ops that
    reached the counting mode, the modes as entered)."""
    with FakeTensorMode():
        weight, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
        with _Dispatched() as below, contextlib.ExitStack() as stack:
            entered = [stack.enter_context(mode) for mode in modes_above]
            (x @ weight).relu().sum().backward()
    return below.ops, entered


def test_the_tracker_and_blas_use_answer_a_fake_tensors_device_without_passing_it_down(monkeypatch):
    """Autograd's engine asks the device of the tensors each backward node takes and gives (most
    of a fake backward's dispatches); the modes above the fake mode answer it, every other op
    reaches the modes below, and the step is tracked as when the question is passed down."""
    device_of = torch.ops.prim.device.default
    plain, _ = _fake_backward()
    assert plain[device_of] > 0
    reached, (tracker,) = _fake_backward(track_memory(detect_backward=True))
    assert set(reached) == set(plain) - {device_of}
    with_blas, _ = _fake_backward(BlasUse())
    assert set(with_blas) == set(plain) - {device_of}
    monkeypatch.setattr(memory, "fake_device", lambda func, args: None)
    passed_down, (untouched,) = _fake_backward(track_memory(detect_backward=True))
    assert passed_down[device_of] == plain[device_of]
    assert untouched.events == tracker.events and tracker.report().peak_bytes > 0
    with FakeTensorMode():
        t = torch.empty(2)
    assert fake_device(device_of, (t,)) == torch.device("cpu")
    assert fake_device(torch.ops.aten.add.Tensor, (t, t)) is None
    assert fake_device(device_of, (torch.empty(2),)) is None   # a real tensor's device is not a fake one
