import pytest
import torch

from ckptlab import get_workload, measure
from ckptlab.core.records import CATEGORIES

from .conftest import requires_cuda


def test_record_has_every_input_and_output():
    record = measure("gpt-tiny", 2, 32, "density=0.5", steps=2, warmup=1)
    assert record["status"] == "ok", record["message"]
    expected = {"model", "n_blocks", "batch_size", "seq_len", "tokens", "policy", "effective_density",
                "checkpointed_blocks", "device", "device_name", "dtype", "optimizer", "steps", "warmup",
                "memory_limit_bytes", "peak_bytes", "peak_phase", "saved_activation_bytes",
                "cuda_max_allocated_bytes", "cuda_max_reserved_bytes", "cuda_alloc_retries", "cuda_ooms",
                "recompute_count", "loss", "step_ms", "step_ms_min", "step_ms_max", "tokens_per_s", "fits",
                "status", "message"} | {f"peak_{c}_bytes" for c in CATEGORIES}
    assert expected <= set(record)
    assert record["effective_density"] == 0.5 and record["checkpointed_blocks"] == "1,3"
    assert record["recompute_count"] == 2 and record["n_blocks"] == 4
    assert record["step_ms_min"] <= record["step_ms"] <= record["step_ms_max"]
    assert record["tokens_per_s"] == pytest.approx(64 / (record["step_ms"] / 1e3))
    assert record["fits"] is None and record["memory_limit_bytes"] is None


def test_every_policy_trains_the_same_loss():
    losses = {p: measure("gpt-tiny", 2, 32, p, steps=1, warmup=0, max_seconds=0.1)["loss"]
              for p in ("none", "full", "every=2", "segments=2")}
    assert len(set(losses.values())) == 1, losses


def test_bf16_autocast_runs_and_is_recorded():
    record = measure("gpt-tiny", 2, 32, "full", dtype="bf16", steps=1, warmup=0, max_seconds=0.1)
    assert record["status"] == "ok" and record["dtype"] == "bf16"


class _Overflowing(torch.nn.Module):
    """Its fp16 activations overflow: every gradient is inf or NaN."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * 1e4
        return x.float().mean()


def test_a_step_whose_grad_scaler_skips_the_optimizer_says_so():
    import ckptlab

    overflowing = ckptlab.Workload.custom("overflowing", build_model=_Overflowing, loss=lambda m, b: m(b[0]),
                                          make_batch=lambda b, s, g: (torch.randn(b, s, 8, generator=g),))
    scaled = measure(overflowing, 2, 4, "none", dtype="fp16", loop="adamw,scaler", steps=1, warmup=0, max_seconds=0.1)
    assert scaled["status"] == "ok" and scaled["note"] == (
        "the grad scaler skipped the optimizer step of the warm-up and of the step measured (inf or NaN gradients): "
        "not the healthy step a prediction is of, the step measured starts without optimizer state")
    healthy = measure(get_workload("gpt-tiny", n_layer=2), 2, 16, "none", dtype="fp16", loop="adamw,scaler", steps=1,
                      warmup=0, max_seconds=0.1)
    assert healthy["status"] == "ok" and "scaler" not in healthy["note"]


def test_emulated_memory_limit():
    fits = measure("gpt-tiny", 2, 32, "none", steps=1, warmup=0, max_seconds=0.1, memory_limit="1GiB")
    assert fits["fits"] is True and fits["status"] == "ok" and fits["memory_limit_bytes"] == 2**30
    over = measure("gpt-tiny", 2, 32, "none", steps=1, warmup=0, max_seconds=0.1, memory_limit="1MiB")
    assert over["fits"] is False and over["status"] == "oom"
    assert "exceeds the emulated memory limit" in over["message"] and over["step_ms"] is None


def test_a_failure_during_work_becomes_an_error_record():
    workload = get_workload("gpt-tiny")

    def broken_loss(model, batch):
        raise RuntimeError("boom")

    workload.loss_fn = broken_loss
    record = measure(workload, 2, 32, "full", steps=1, warmup=0, max_seconds=0.1)
    assert record["status"] == "error" and record["message"] == "RuntimeError: boom"
    assert record["policy"] == "full" and record["batch_size"] == 2


def test_a_measurement_collects_the_cycles_it_made_and_leaves_the_collector_as_found():
    import gc
    import weakref

    from ckptlab import Workload, compare

    from .custom_model import Net, classification_loss

    built = []

    def cyclic_net():   # a model in a reference cycle: freed only by a collection
        net = Net(16, 2)
        net.__dict__["cycle"] = [net]
        built.append(weakref.ref(net))
        return net

    workload = Workload.custom("cyclic-net", cyclic_net, lambda b, s, gen: (torch.randn(b, s, 8, generator=gen),
                                                                           torch.randint(0, 3, (b,), generator=gen)),
                               classification_loss)
    gc.unfreeze()   # the test process's freeze (conftest): here the collector starts with nothing frozen
    try:
        assert measure(workload, 2, 4, "full", steps=1, warmup=0, max_seconds=0.1)["status"] == "ok"
        compare(workload, 2, 4, ["none", "full"], max_seconds=0.1)
        assert built and all(ref() is None for ref in built)
        assert gc.get_freeze_count() == 0 and gc.isenabled()
        # a caller's freeze stays whole: what it froze is never collected, garbage or not
        old = Net(4, 1)
        old.__dict__["cycle"] = [old]
        old_ref = weakref.ref(old)
        gc.freeze()
        del old
        measure(workload, 2, 4, "full", steps=1, warmup=0, max_seconds=0.1)
        gc.collect()
        assert old_ref() is not None and gc.get_freeze_count() > 0
    finally:
        gc.collect()
        gc.freeze()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(batch_size=0), "batch_size=0 is invalid: allowed is an integer >= 1"),
        (dict(seq_len=-1), "seq_len=-1 is invalid: allowed is an integer >= 1"),
        (dict(seq_len=1000), "seq_len=1000 is invalid for model='gpt-tiny': allowed is 1..256"),
        (dict(policy="density=2"), "density=2 is invalid: allowed is a number in [0, 1]"),
        (dict(device="tpu"), "device='tpu' is invalid: allowed are cpu, cuda, cuda:N"),
        (dict(dtype="fp8"), "dtype='fp8' is invalid: allowed are fp32, bf16"),
        (dict(steps=0), "steps=0 is invalid: allowed is an integer >= 1"),
        (dict(memory_limit="lots"), "memory_limit='lots' is invalid"),
        (dict(loop="lion"), "optimizer='lion' is invalid: allowed are adamw, adamw-foreach, adamw-fused, adamw-forloop, sgd, none"),
        (dict(workload="gpt-huge"), "model='gpt-huge' is invalid: allowed presets are gpt-tiny"),
        (dict(workload="gpt2-smal"), "model='gpt2-smal' is invalid (did you mean gpt2-small?): allowed presets"),
        (dict(workload="my_model.py"), "model='my_model.py' is invalid (a model file is named with its factory: "
                                       "my_model.py:factory): allowed presets"),
    ],
)
def test_bad_input_is_a_clear_error_before_any_work(kwargs, fragment):
    args = dict(workload="gpt-tiny", batch_size=2, seq_len=32, policy="full") | kwargs
    with pytest.raises(ValueError) as err:
        measure(**args)
    assert fragment in str(err.value)


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="device='cuda' is invalid here: no CUDA device is available"):
        measure("gpt-tiny", 2, 32, device="cuda")


def test_unknown_override_is_a_clear_error():
    with pytest.raises(ValueError, match="override n_layers=3 is invalid for model='gpt-tiny': allowed overrides are"):
        get_workload("gpt-tiny", n_layers=3)


def test_workloads_are_seeded():
    a, b = get_workload("gpt-tiny").build(), get_workload("gpt-tiny").build()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(get_workload("gpt-tiny").batch(2, 8)[0], get_workload("gpt-tiny").batch(2, 8)[0])


def test_gpt2_small_has_the_124m_shape():
    assert get_workload("gpt2-small").n_params == pytest.approx(124.4e6, rel=0.01)


@requires_cuda
def test_cuda_record_has_allocator_stats():
    record = measure("gpt-tiny", 2, 64, "full", device="cuda", steps=2, warmup=1)
    assert record["status"] == "ok", record["message"]
    assert record["cuda_max_allocated_bytes"] >= record["peak_bytes"] * 0.9
    assert record["cuda_max_reserved_bytes"] >= record["cuda_max_allocated_bytes"]
    assert record["peak_bytes"] * 0.9 <= record["cuda_max_requested_bytes"] <= record["cuda_max_allocated_bytes"]
    assert record["cuda_ooms"] == 0 and record["fits"] is True


@requires_cuda
def test_cuda_real_oom_is_recorded_and_memory_released():
    record = measure("gpt-tiny", 64, 256, "none", device="cuda", steps=1, warmup=0, memory_limit="64MiB")
    assert record["status"] == "oom" and record["fits"] is False
    assert measure("gpt-tiny", 2, 64, "none", device="cuda", steps=1, warmup=0)["status"] == "ok"


@requires_cuda
def test_cuda_memory_snapshot(tmp_path):
    from ckptlab.probe.memory import cuda_memory_snapshot

    path = tmp_path / "snapshot.pickle"
    with cuda_memory_snapshot(str(path)):
        torch.randn(1024, 1024, device="cuda").sum().item()
    assert path.stat().st_size > 0


@requires_cuda
def test_cuda_event_timing():
    from ckptlab.probe.timing import time_steps

    x = torch.randn(2048, 2048, device="cuda")
    timing = time_steps(lambda: x @ x, steps=3, warmup=1, device="cuda")
    assert len(timing.times_ms["step"]) == 3 and min(timing.times_ms["step"]) > 0 and timing.device.startswith("cuda")
