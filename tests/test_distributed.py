"""Checkpointing under FSDP2 (fully_shard): 2 CPU processes, gloo."""

import json
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

from ckptlab import get_workload  # noqa: E402
from ckptlab.apps.cli import main as cli_main  # noqa: E402
from ckptlab.probe.distributed import measure_sharded_many, sharded_gradients  # noqa: E402
from ckptlab.run.store import read_records  # noqa: E402

# dropout off: the sharded run draws its masks per rank on half the batch, the reference on the
# whole batch, so the same seed would give different masks (recompute itself replays masks
# exactly; tests/test_wrap.py proves that with dropout on).
TINY = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=64, dropout=0.0)
POLICIES = ["none", "density=0.5", "full"]


def test_sharded_checkpointed_gradients_equal_unsharded_uncheckpointed():
    per_rank_batch, seq = 2, 16
    sharded = sharded_gradients("gpt-tiny", per_rank_batch, seq, POLICIES, nproc=2, model_overrides=TINY)

    workload = get_workload("gpt-tiny", **TINY)
    model = workload.build()
    workload.loss(model, workload.batch(2 * per_rank_batch, seq)).backward()   # one process, no checkpointing
    reference = {n: p.grad for n, p in model.named_parameters()}

    for policy, grads in zip(POLICIES, sharded):
        assert sorted(grads) == sorted(reference), policy
        for name, grad in grads.items():
            # Tolerance from measurement, not hope: FSDP's reduce-scatter averages the two ranks'
            # gradients (each from half the batch), summing in another order than one process
            # does over the whole batch. Measured on this machine: max |diff| 3.0e-08 and max
            # |diff| / max|grad| 5.8e-07 over all parameters, identical for the three policies
            # (checkpointing adds no difference of its own). atol 1e-6 / rtol 1e-5 is ~30x that,
            # and still far below any real error (a wrong or missing block gradient is ~1e-2).
            torch.testing.assert_close(grad, reference[name], atol=1e-6, rtol=1e-5, msg=f"{policy} {name}")
    # and the comparison can fail: a different batch gives different gradients
    other = {n: g for n, g in sharded[0].items()}
    model.zero_grad()
    workload.loss(model, workload.batch(per_rank_batch, seq)).backward()   # half the batch only
    assert any((model.get_parameter(n).grad - g).abs().max() > 1e-4 for n, g in other.items())


def test_per_rank_peak_memory_falls_with_density_and_step_times_carry_their_interval():
    records = measure_sharded_many("gpt-tiny", 4, 64, POLICIES, nproc=2, model_overrides=TINY, steps=3, warmup=0,
                                   target_ci=0.05)
    for r in records:
        assert r["status"] == "ok", r["message"]
        assert r["world_size"] == 2 and len(r["peak_bytes_per_rank"]) == 2
        assert r["peak_bytes"] == max(r["peak_bytes_per_rank"])
        # Rank 0's median of exactly `steps` steps, its 95% interval, and how it was timed.
        assert r["step_ms_low"] <= r["step_ms"] <= r["step_ms_high"], r
        assert r["step_ms_min"] <= r["step_ms_low"] and r["step_ms_high"] <= r["step_ms_max"]
        assert r["rounds"] == 3 and r["timing_stopped"] in ("target", "max_rounds") and r["timing_target_ci"] == 0.05
        assert r["threads"] == max(1, (os.cpu_count() or 1) // 2)   # the ranks split the cores
        assert r["load_before"] >= 0 and r["load_after"] >= 0 and isinstance(r["busy"], bool)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["step_ms"] / 1e3))
        # Timed one after another, not interleaved: no paired ratio is claimed.
        assert r["time_ratio"] is None and r["significant"] is None and r["timing_baseline"] is None
    none, half, full = records
    assert (none["effective_density"], half["effective_density"], full["effective_density"]) == (0.0, 0.5, 1.0)
    assert (none["recompute_count"], half["recompute_count"], full["recompute_count"]) == (0, 2, 4)
    for rank in range(2):
        peaks = [r["peak_bytes_per_rank"][rank] for r in records]
        assert peaks[0] > peaks[1] > peaks[2], (rank, peaks)
    assert none["saved_activation_bytes"] > half["saved_activation_bytes"] > full["saved_activation_bytes"]
    # At the start of the step each rank holds half of the fp32 parameters and of AdamW's two
    # state tensors (12 B per parameter; gradients were set to None after the warm-up step) plus
    # its batch (inputs + targets, int64): sharding is real, not a copy per rank.
    n_params = get_workload("gpt-tiny", **TINY).n_params
    expected = n_params * 12 / 2 + 2 * 4 * 64 * 8
    for start in none["start_bytes_per_rank"]:
        assert abs(start - expected) < 0.05 * expected, (start, expected)


def test_cli_sweep_nproc_2_records_world_size_and_per_rank_peaks(tmp_path, capsys):
    out = tmp_path / "fsdp"
    code = cli_main(["sweep", "--model", "gpt-tiny", "--set", "n_layer=4", "--set", "n_embd=32", "--set", "n_head=2",
                     "--set", "vocab_size=64", "--batch", "1", "--seq", "16", "--policy", "full", "--steps", "1",
                     "--warmup", "0", "--nproc", "2", "--out", str(out), "--no-plots", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    [record] = read_records(out)
    assert record["status"] == "ok" and record["world_size"] == 2 and record["sharding"] == "fsdp2"
    assert record["peak_bytes"] == max(record["peak_bytes_per_rank"])
    assert record["rounds"] == 1 and record["step_ms"] > 0 and record["threads"] >= 1   # the timing columns reach the run
    assert json.loads((out / "run.json").read_text())["config"]["nproc"] == 2


def test_a_hung_or_dead_rank_group_is_an_error_record_not_a_hang():
    [record] = measure_sharded_many("gpt-tiny", 1, 16, ["full"], nproc=2, model_overrides=TINY, timeout_s=0.5)
    assert record["status"] == "error" and record["message"] == "2 ranks timed out after 0.5 s"
    assert record["world_size"] == 2 and record["peak_bytes"] is None
    # A rank that raises ends its process; the group is stopped and the error reported at once.
    [record] = measure_sharded_many("gpt-tiny", 1, 16, ["layers=9"], nproc=2, model_overrides=TINY, timeout_s=300)
    assert record["status"] == "error" and "exited with code 1" in record["message"]
    assert "layers=9" in record["message"] or "ValueError" in record["message"], record["message"]
    with pytest.raises(ValueError, match="nproc=0 is invalid"):
        measure_sharded_many("gpt-tiny", 1, 16, ["none"], nproc=0)
