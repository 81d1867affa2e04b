"""`explain`: the cause it names on models written here (each built so one thing holds the peak),
its levers against `predict`, the command line, and the FSDP2 model against a measured 2-rank run."""

import json

import pytest
import torch

from ckptlab import get_workload, predict
from ckptlab.apps.cli import main as cli_main
from ckptlab.core.cards import card
from ckptlab.core.policy import parse_policy
from ckptlab.core.units import format_bytes
from ckptlab.estimate import fake_step
from ckptlab.estimate.fsdp import fsdp_peak, fsdp_units
from ckptlab.probe.distributed import measure_sharded
from ckptlab.report.explain import BREAKDOWN, POLICY_LEVERS, explain
from ckptlab.workloads.base import Workload
from ckptlab.workloads.models import with_chunked_loss

from .test_progress import Terminal

SPEC = "tests/explain_models.py:factory"


def token_workload(**overrides):
    return get_workload(SPEC, **overrides)


# Wide and shallow at one short sequence: weights, gradients and AdamW's state dwarf activations.
OPTIMIZER_BOUND = dict(width=256, depth=2, vocab=64)
# A large vocabulary over narrow blocks: the logits and the loss's buffers dwarf the blocks.
LOGITS_BOUND = dict(width=32, depth=2, vocab=8192)
# Many narrow blocks over many tokens, a tiny vocabulary: the blocks' activations dominate.
BLOCKS_BOUND = dict(width=32, depth=8, vocab=16)


def test_the_peak_in_the_optimizer_step_is_named_and_no_policy_lowers_it(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    e = explain(token_workload(**OPTIMIZER_BOUND), 1, 4, progress=False)
    assert terminal.getvalue() == ""   # a bar switched off stays off on a terminal
    assert (e.cause_kind, e.peak_phase, e.peak_block) == ("optimizer", "optimizer", None)
    assert "optimizer step" in e.cause and "no checkpoint policy can lower it" in e.cause
    assert e.checkpoint_floor_bytes == e.peak_bytes
    assert any(lv.name == "SGD" and lv.predicted_peak_bytes < e.peak_bytes for lv in e.levers)


def test_no_lever_suggests_what_the_step_already_does():
    # Weights bound, already in bf16 weights with SGD and every block fully recomputed (as a plan):
    # the cause and the levers name only changes to the step.
    e = explain(token_workload(**OPTIMIZER_BOUND), 1, 4, "plan=ff", dtype="bf16-weights", loop="sgd")
    assert e.cause_kind == "weights"
    assert e.cause.endswith(f"Checkpointing lowers only activations (to {format_bytes(e.checkpoint_floor_bytes)} at "
                            "best); FSDP sharding lowers the rest.")
    names = {lv.name for lv in e.levers}
    assert not names & {"bf16 weights", "bf16 autocast", "SGD", "AdamW fused", "policy full", "plan with the lowest peak"}
    applied = parse_policy("plan=ff")
    assert not any(parse_policy(lv.policy).checkpoints_like(applied, 2) for lv in e.levers if lv.policy)
    # the same step in fp32 with AdamW has those levers
    e = explain(token_workload(**OPTIMIZER_BOUND), 1, 4, "plan=ff", loop="adamw")
    assert {"bf16 weights", "SGD"} <= {lv.name for lv in e.levers}


def test_logits_that_outweigh_the_blocks_are_named():
    e = explain(token_workload(**LOGITS_BOUND), 4, 64)
    assert e.cause_kind == "logits"
    assert "logits" in e.cause
    b = e.breakdown
    assert b["activations_outside_blocks"] + b["temporaries"] > 4 * b["activations_in_blocks"]
    assert e.checkpoint_floor_bytes > 0.8 * e.peak_bytes   # checkpointing the blocks barely helps


def test_block_activations_are_named_and_checkpointing_lowers_the_peak(monkeypatch):
    prepared = []
    monkeypatch.setattr(fake_step.PreparedStep, "__init__", lambda self, *args, _init=fake_step.PreparedStep.__init__,
                        **kwargs: (prepared.append(args[1:5] + (kwargs.get("cut") is not None,)),
                                   _init(self, *args, **kwargs))[1])
    builds = []   # models built under fake tensors (a measurement or FSDP's units build real ones)
    monkeypatch.setattr(Workload, "new_model", lambda self, _build=Workload.new_model: (
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None and builds.append(self),
        _build(self))[1])
    e = explain(token_workload(**BLOCKS_BOUND, frozen_embedding=True), 8, 128)
    # each weights' dtype is built once, each lever's model prepared once: the floor plan's profile
    # and roofline take those builds and the policies' models again
    built = [fake_step.workload_key(w) for w in builds]
    assert len(built) == len(set(built)) and len(prepared) == len(set(prepared)) >= 5, (built, prepared)
    assert e.cause_kind == "blocks"
    assert e.checkpoint_floor_bytes < 0.5 * e.peak_bytes
    assert e.breakdown["activations_in_blocks"] > 0.5 * e.peak_bytes
    assert e.breakdown["frozen_parameters"] == 16 * 32 * 4          # the frozen embedding
    assert sum(e.breakdown[k] for k in BREAKDOWN) == e.peak_bytes
    assert e.levers == sorted(e.levers, key=lambda lv: (lv.predicted_peak_bytes is None, lv.predicted_peak_bytes or 0,
                                                        lv.name))
    text = str(e)
    assert "cause: Block activations" in text and "checkpoint floor" in text


def test_policy_levers_equal_predict_and_a_plan_at_capacity_fits_it():
    workload = token_workload(**BLOCKS_BOUND)
    base = predict(workload, 8, 128, "none")
    full = predict(workload, 8, 128, "full")
    capacity = (base.peak_bytes + full.peak_bytes) // 2
    e = explain(workload, 8, 128, capacity=capacity)
    policies = {lv.policy: lv.predicted_peak_bytes for lv in e.levers if lv.policy in POLICY_LEVERS}
    assert set(policies) == set(POLICY_LEVERS) - {"none"}
    for policy, peak in policies.items():
        assert peak == predict(workload, 8, 128, policy).peak_bytes, policy
    plan = next(lv for lv in e.levers if lv.name.startswith("plan at"))
    assert plan.predicted_peak_bytes <= capacity
    assert predict(workload, 8, 128, plan.policy).peak_bytes == plan.predicted_peak_bytes
    assert e.steps[0].predicted_peak_bytes == e.peak_bytes == base.peak_bytes
    assert e.steps[-1].predicted_peak_bytes <= capacity
    # every lever with a peak says whether it fits, or by how much it stays over
    lines = str(e).splitlines()
    for lever in e.levers:
        if lever.predicted_peak_bytes is None:
            continue
        line = next(ln for ln in lines if f"  {lever.name}" in ln and ln.lstrip().startswith(
            format_bytes(lever.predicted_peak_bytes)))
        over = lever.predicted_peak_bytes - capacity
        assert ("  fits:" in line) == (over <= 0), line
        assert (f"  over by {format_bytes(over)}:" in line) == (over > 0), line
    # the waterfall's path gives each step's peak once, beside its name
    path = next(ln for ln in lines if ln.startswith("  together: "))
    assert path == "  together: " + " -> ".join(f"{s.name} ({format_bytes(s.predicted_peak_bytes)})" for s in e.steps)


def test_on_a_card_a_step_whose_peak_cublas_workspaces_outweigh_names_the_allocator():
    e = explain(get_workload("gpt-tiny"), 8, 128, "full", capacity="rtx4090", progress=False)
    b = e.breakdown
    weights = sum(b[k] for k in ("parameters", "frozen_parameters", "buffers", "gradients", "optimizer_state"))
    activations = b["activations_in_blocks"] + b["activations_outside_blocks"] + b["temporaries"]
    assert e.peak_phase == "backward" and b["workspaces"] + b["rounding"] > max(weights, activations)
    assert e.cause_kind == "allocator" and e.cause.startswith(
        f"The allocator's own bytes hold the peak: cuBLAS workspaces {format_bytes(b['workspaces'])}")
    assert sum(v for k, v in b.items() if k != "fragmentation") == e.peak_bytes   # all of it inside the peak


def test_a_peak_in_the_heads_backward_says_the_blocks_still_hold_their_activations():
    workload = get_workload("gpt-tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    e = explain(workload, 2, 64)
    assert (e.cause_kind, e.peak_phase, e.peak_block) == ("blocks", "backward", None)
    assert ("The peak comes in backward, while the loss and the head run theirs, before any block's backward "
            "has freed its activations.") in e.cause
    assert "outside the blocks (" not in str(e)
    # each lever carries its change as settings, and its peak is the prediction of that change
    by_name = {lv.name: lv for lv in e.levers}
    assert by_name["bf16 weights"].change == {"dtype": "bf16-weights"}
    assert by_name["bf16 weights"].predicted_peak_bytes == predict(workload, 2, 64, dtype="bf16-weights").peak_bytes
    assert by_name["micro-batch 1 x 2 accumulation steps"].change == {"batch_size": 1, "accum_steps": 2}
    assert all(step.change == by_name[step.name].change for step in e.steps[1:])


def test_a_policy_that_checkpoints_no_block_is_named():
    e = explain(token_workload(**BLOCKS_BOUND), 2, 16, "density=0.05")
    assert e.cause_kind == "not_applied"
    assert "0 of 8 blocks" in e.cause


def test_checkpointing_a_model_that_checkpoints_itself_is_named():
    e = explain(token_workload(**BLOCKS_BOUND, own_checkpoint=True), 2, 16, "full")
    assert e.cause_kind == "double"
    assert "twice" in e.cause


# FSDP2 shards frozen parameters too: a frozen embedding of 512 KiB, left whole, would put the
# model 0.4% high (it is within 0.02%).
@pytest.mark.parametrize("overrides, tolerance", [(BLOCKS_BOUND, 0.1),
                                                  (dict(BLOCKS_BOUND, vocab=4096, frozen_embedding=True), 0.002)])
def test_fsdp_model_against_a_measured_two_rank_run(overrides, tolerance):
    workload = token_workload(**overrides)
    measured = measure_sharded(workload, 8, 128, "none", nproc=2, steps=1, warmup=0)
    assert measured["status"] == "ok", measured["message"]
    modelled = fsdp_peak(predict(workload, 8, 128, "none"), fsdp_units(workload), 2)
    assert abs(modelled / measured["peak_bytes"] - 1) < tolerance


def test_cli_prints_the_report_and_json(capsys, tmp_path):
    args = ["explain", "--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "2", "--seq", "16"]
    assert cli_main(args + ["--figure", str(tmp_path / "waterfall")]) == 0
    out = capsys.readouterr().out
    assert "cause:" in out and "levers" in out
    assert (tmp_path / "waterfall.png").stat().st_size > 0
    assert cli_main(args + ["--format", "json", "--capacity", "rtx4090"]) == 0
    data = json.loads(capsys.readouterr().out)
    # on a card every size is predicted for it: its device bytes may reach its usable bytes less its margin
    rtx = card("rtx4090")
    assert set(data["breakdown"]) == set(BREAKDOWN) | {"workspaces", "rounding", "fragmentation"}
    assert data["capacity_bytes"] == rtx.usable_bytes - rtx.required_margin_bytes
    assert data["capacity_card"].startswith("RTX 4090") and data["device"] == "cuda"
    assert data["margin_bytes"] == rtx.usable_bytes - rtx.required_margin_bytes - data["device_bytes"] and data["steps"][0]["predicted_peak_bytes"] == data["device_bytes"]
    assert data["fit"] == "yes" and data["fit_reason"].startswith("fits: reserved")   # margin_bytes >= 0
    assert data["capacity_is_card"]
    # the cause compares the floor in the device bytes it is in, not with the allocated peak
    assert f"{format_bytes(data['checkpoint_floor_bytes'])} of device bytes" in data["cause"]

    # a size on a card: the levers against that size, not the card's; a capacity naming another card: refused
    assert cli_main(args + ["--card", "rtx4090", "--capacity", "20GiB"]) == 0
    assert "levers (one change each, capacity 20.0 GiB):" in capsys.readouterr().out
    assert cli_main(args + ["--card", "rtx4090", "--capacity", "h100-80"]) == 2
    assert capsys.readouterr().err == ("error: --capacity h100-80 is invalid with --card rtx4090: a capacity that "
                                       "names a card is predicted for that card; allowed is --capacity rtx4090 or a "
                                       "size such as 24GiB, or no card\n")
    offload = next(lever for lever in data["levers"] if lever["name"] == "offload")
    assert offload["basis"] == "predicted" and offload["predicted_peak_bytes"] > 0   # on a card, predicted
    assert data["peak_phase"] in ("forward", "backward", "optimizer")


@pytest.mark.parametrize("flag, value", [("--capacity", "lots"), ("--capacity", "0"), ("--capacity", "rtx5090"),
                                         ("--batch", "0"),
                                         ("--seq", "100000")])
def test_cli_refuses_a_bad_capacity_or_shape_in_one_line(capsys, flag, value):
    assert cli_main(["explain", "--model", "gpt-tiny", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and value in err[0]


# `import ckptlab.report.explain` loads no plotting library: tests/test_install.py, in the one
# fresh process that checks what `import ckptlab` loads.


def test_the_chunked_loss_lever_computes_the_same_loss_and_gradients():
    workload = get_workload("gpt-tiny", n_layer=1, dropout=0.0)
    chunked = with_chunked_loss(workload, chunks=3)
    model = workload.build()
    batch = workload.batch(2, 8)
    results = []
    for w in (workload, chunked):
        model.zero_grad()
        loss = w.loss(model, batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("allocated_left, why", [
    (0.25, "no plan fits (in allocated bytes: the capacity less the "),   # below the weights and their state
    (-0.25, "no plan fits: the card's context and today's fragmentation"),
])
def test_on_a_card_that_no_plan_fits_the_plan_lever_says_why_in_its_terms(allocated_left, why):
    from ckptlab.core.cards import parse_capacity
    base = predict("gpt-tiny", 2, 16, "none", device="cuda", card="rtx4090")
    usable = base.device_bytes - base.peak_bytes + int(allocated_left * base.peak_bytes)
    tight = parse_capacity("rtx4090", usable_bytes=usable, required_margin_bytes=0)
    e = explain("gpt-tiny", 2, 16, capacity=tight, progress=False)
    lever = next(lv for lv in e.levers if lv.name.startswith("plan at"))
    assert lever.predicted_peak_bytes is None and lever.cost.startswith(why)
    assert "invalid" not in lever.cost
