"""The training loop as one value (`core.loop`): its text, its checks, and each of its options
measured and predicted alike, exact to the byte on the CPU, with what each option adds derived
by hand from the tiny model's shapes."""

import json
import types

import pytest
import torch
import torch.nn.functional as F

import ckptlab
from ckptlab.apps.cli import main
from ckptlab.core.loop import LOOP_COLUMNS, Loop, as_loop, loop_of_record, parse_loop
from ckptlab.core.policy import as_policy
from ckptlab.probe.measure import measure_policy
from ckptlab.probe.step import make_optimizer, training_step

from .tiny_lm import tiny_lm_factory

VOCAB, WIDTH, BATCH, SEQ = 64, 16, 2, 8


def next_token_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def tiny_lm():
    return ckptlab.Workload.custom(
        "tiny-loop", tiny_lm_factory(VOCAB, WIDTH),
        lambda b, s, gen: (torch.randint(0, VOCAB, (b, s), generator=gen), torch.randint(0, VOCAB, (b, s), generator=gen)),
        next_token_loss, blocks="blocks")


PARAM_BYTES = 4 * (VOCAB * WIDTH + 2 * (WIDTH * WIDTH + WIDTH) + WIDTH * VOCAB + VOCAB)   # fp32


# ----------------------------------------------------------------------------- the text

@pytest.mark.parametrize("text", ["adamw", "sgd,accum=4", "adamw-fused,accum=2,holds-output",
                                  "adamw-foreach,zero-grad=zeros,clip=1.0,scaler", "none,clip=0.25"])
def test_a_loop_spells_back_to_itself(text):
    loop = parse_loop(text)
    assert str(loop) == text and parse_loop(str(loop)) == loop == as_loop(text) == as_loop(loop)


def test_the_text_is_read_in_any_order_and_spelled_canonically():
    loop = parse_loop("scaler, clip=1, accum=2 ,zero-grad=zeros,holds-output")
    assert loop == Loop(accum_steps=2, holds_output=True, zero_grad="zeros", clip_grad_norm=1.0, grad_scaler=True)
    assert str(loop) == "adamw,accum=2,holds-output,zero-grad=zeros,clip=1.0,scaler"
    assert as_loop(None) == Loop() and str(Loop()) == "adamw"


def test_the_record_holds_the_label_and_every_field():
    loop = parse_loop("sgd,accum=3,clip=2.0")
    row = loop.record()
    assert tuple(row) == LOOP_COLUMNS and row["loop"] == "sgd,accum=3,clip=2.0"
    assert loop_of_record(row) == loop
    assert loop_of_record({"optimizer": "sgd", "accum_steps": 3.0}) == Loop(accum_steps=3, optimizer="sgd")


@pytest.mark.parametrize("make, message", [
    (lambda: parse_loop("adamw,accum=0"), "accum_steps=0 is invalid: allowed is an integer >= 1"),
    (lambda: parse_loop("adamw,accum=two"), "accum=two is invalid in loop='adamw,accum=two': allowed is an integer"),
    (lambda: parse_loop("lion"), "optimizer='lion' is invalid: allowed are adamw, adamw-foreach"),
    (lambda: parse_loop("adamw,zero-grad=maybe"), "zero_grad='maybe' is invalid: allowed are set_to_none"),
    (lambda: parse_loop("adamw,clip=-1"), "clip_grad_norm='-1' is invalid: allowed is a finite max norm > 0"),
    (lambda: parse_loop("adamw,clip=nan"), "clip_grad_norm='nan' is invalid"),
    (lambda: parse_loop("adamw,turbo"), "loop='adamw,turbo' is invalid: unknown item 'turbo'"),
    (lambda: parse_loop("accum=2,sgd"), "the optimizer 'sgd' comes first"),
    (lambda: parse_loop("adamw,scaler,scaler"), "scaler is given twice"),
    (lambda: parse_loop("adamw,,scaler"), "an item is empty"),
    (lambda: parse_loop("none,scaler"), "grad_scaler=True is invalid with optimizer='none'"),
    (lambda: Loop(accum_steps=True), "accum_steps=True is invalid"),
    (lambda: Loop(holds_output="yes"), "holds_output='yes' is invalid: allowed are True, False"),
    (lambda: as_loop(3), "loop=3 is invalid: expected a string"),
    (lambda: ckptlab.predict(tiny_lm(), BATCH, SEQ, loop="scaler"),
     "grad_scaler=True is invalid with dtype='fp32': the grad scaler is for fp16 autocast"),
    (lambda: ckptlab.measure(tiny_lm(), BATCH, SEQ, dtype="fp16-weights", loop="scaler"),
     "grad_scaler=True is invalid with dtype='fp16-weights'"),
])
def test_a_bad_loop_is_one_line_naming_the_value(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")) as info:
        make()
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- measured = predicted

@pytest.mark.parametrize("text, dtype", [
    ("adamw,zero-grad=zeros", "fp32"), ("adamw,clip=1.0", "fp32"), ("adamw-foreach,clip=0.5,scaler", "fp16"),
    ("adamw-fused,scaler", "fp16"), ("sgd,accum=2,zero-grad=zeros,clip=1.0", "fp32"),
    ("adamw-fused,accum=2,holds-output,zero-grad=zeros,clip=1.0,scaler", "fp16"),
])
@pytest.mark.parametrize("policy", ["none", "full"])
def test_each_option_is_measured_and_predicted_to_the_byte(text, dtype, policy):
    record = measure_policy(tiny_lm(), BATCH, SEQ, as_policy(policy), dtype=dtype, loop=text, steps=1, warmup=0,
                            max_seconds=0.1)
    assert record["status"] == "ok", record["message"]
    predicted = ckptlab.predict(tiny_lm(), BATCH, SEQ, policy, dtype=dtype, loop=text)
    assert (predicted.peak_bytes, predicted.saved_activation_bytes, predicted.peak_phase) == (
        record["peak_bytes"], record["saved_activation_bytes"], record["peak_phase"])
    assert record["loop"] == predicted.record()["loop"] == str(predicted.loop) == text
    assert f"loop {text}" in str(predicted)


def start_bytes(text, dtype="fp32"):
    _, report = measure_policy(tiny_lm(), BATCH, SEQ, as_policy("none"), dtype=dtype, loop=text, steps=1, warmup=0,
                               max_seconds=0.1, with_report=True)
    return report.start_bytes


def test_zeroed_gradients_and_the_scalers_state_are_held_from_step_to_step():
    # zero_grad(set_to_none=False) keeps every trained parameter's gradient, zero-filled; a grad
    # scaler keeps its scale (fp32) and growth tracker (int32), one scalar each.
    assert start_bytes("adamw,zero-grad=zeros") - start_bytes("adamw") == PARAM_BYTES
    assert start_bytes("adamw,scaler", "fp16") - start_bytes("adamw", "fp16") == 4 + 4


def one_sgd_step(text, dtype="fp32"):
    """The parameters' change after one step of `text` (an SGD loop, lr 1e-3), from the same start."""
    workload = tiny_lm()
    model = workload.build("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    step = training_step(model, workload, workload.batch(BATCH, SEQ, "cpu"), make_optimizer(text, model), dtype, text)
    step()
    return [p.detach() - b for p, b in zip(model.parameters(), before)], step


def test_clipping_bounds_the_update_and_the_scaler_unscales_it():
    plain, _ = one_sgd_step("sgd")
    clipped, _ = one_sgd_step("sgd,clip=0.001")
    norm = lambda deltas: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in deltas]))  # noqa: E731
    assert norm(plain) > 1e-6 and norm(clipped) == pytest.approx(1e-3 * 1e-3, rel=1e-2)   # lr x max norm (fp32 rounding of the change)
    unscaled, step = one_sgd_step("sgd,scaler", "fp16")
    reference, _ = one_sgd_step("sgd", "fp16")
    assert step.scaler.get_scale() == 2.0 ** 16
    # The same update as without the scaler (fp16 rounds the scaled backward otherwise), not 2**16 times it.
    assert float(norm(unscaled)) == pytest.approx(float(norm(reference)), rel=1e-2)


def test_zeroed_gradients_stay_allocated_after_the_step():
    workload = tiny_lm()
    model = workload.build("cpu")
    training_step(model, workload, workload.batch(BATCH, SEQ, "cpu"), None, "fp32", "none,zero-grad=zeros")()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    training_step(model, workload, workload.batch(BATCH, SEQ, "cpu"), None, "fp32", "none")()
    assert all(p.grad is None for p in model.parameters())


def test_accumulation_keeps_the_gradients_through_the_second_forward():
    one, two = (ckptlab.predict(tiny_lm(), BATCH, SEQ, "none", loop=text) for text in ("adamw", "adamw,accum=2"))
    assert two.peak_phase == "backward" and two.peak_by_category["gradients"] == PARAM_BYTES
    assert two.peak_bytes > one.peak_bytes - PARAM_BYTES   # the second pass runs beside the first's gradients


# ----------------------------------------------------------------------------- everywhere the same options

def test_predict_fits_plan_and_explain_take_the_loop():
    loop = "adamw,accum=2,zero-grad=zeros"
    row = ckptlab.predict_fits(tiny_lm(), ["none"], ["1MiB"], seq_len=SEQ, max_batch=2, seq_lens=[SEQ], dtype="fp32",
                               loop=loop)[0]
    assert (row["loop"], row["accum_steps"], row["zero_grad"]) == (loop, 2, "zeros")
    plan = ckptlab.plan_budget(tiny_lm(), 4, 64, 1.0, loop=loop)
    assert plan.loop == parse_loop(loop) and f"loop {loop}" in str(plan)
    assert plan.predicted_peak_bytes == ckptlab.predict(tiny_lm(), 4, 64, f"plan={plan.letters}", loop=loop).peak_bytes
    explanation = ckptlab.explain(tiny_lm(), 4, 16, "none", loop=loop)
    assert f"loop {loop}" in str(explanation) and explanation.to_dict()["loop"] == loop
    micro = next(lv for lv in explanation.levers if lv.name.startswith("micro-batch"))
    assert micro.change == {"batch_size": 2, "accum_steps": 4}   # the loop's 2 accumulation steps, times 2


def test_the_cli_builds_one_loop_from_the_same_flags_and_prints_it(capsys):
    flags = ["--optimizer", "adamw-fused", "--accum", "2", "--holds-output", "--zero-grad", "zeros",
             "--clip-grad-norm", "1", "--grad-scaler", "--dtype", "fp16"]
    text = "adamw-fused,accum=2,holds-output,zero-grad=zeros,clip=1.0,scaler"
    shape = ["--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "2", "--seq", "16", "--policy", "none"]
    assert main(["predict", *shape, *flags, "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["loop"] == text and row["grad_scaler"] is True and row["clip_grad_norm"] == 1.0
    assert main(["predict", *shape, *flags]) == 0
    assert f"loop {text}:" in capsys.readouterr().out
    assert main(["measure", *shape, *flags, "--steps", "1", "--warmup", "0", "--max-seconds", "0.1"]) == 0
    assert f"loop {text})" in capsys.readouterr().out


@pytest.mark.parametrize("command", [
    ["measure"], ["predict"], ["compare"], ["plan", "--budget", "0.5"], ["explain"],
    ["sweep", "--out", "{tmp}/never"],
])
@pytest.mark.parametrize("flags, message", [
    (["--accum", "0"], "error: --accum 0 is invalid: allowed is an integer >= 1"),
    (["--accum", "two"], "error: --accum two is invalid: allowed is an integer >= 1"),
    (["--optimizer", "lion"], "error: --optimizer lion is invalid: allowed are adamw"),
    (["--zero-grad", "maybe"], "error: --zero-grad maybe is invalid: allowed are set_to_none"),
    (["--clip-grad-norm", "-1"], "error: --clip-grad-norm -1 is invalid: allowed is a finite max norm > 0, or no "
                                 "--clip-grad-norm (no clipping)"),
    (["--grad-scaler"], "error: --grad-scaler is invalid with --dtype fp32: the grad scaler is for fp16 autocast; "
                        "allowed is --dtype fp16, or no --grad-scaler"),
])
def test_a_bad_loop_flag_is_one_line_and_exit_2_on_every_command(command, flags, message, tmp_path, capsys):
    if command[0] == "sweep" and flags[0] == "--accum":   # the sweep's accumulation is its grid's list
        message = "error: --accum {} is invalid: allowed is a comma-separated list of integers >= 1".format(flags[1])
    argv = [c.replace("{tmp}", str(tmp_path)) for c in command] + ["--model", "gpt-tiny", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "never").exists()


def test_the_trainer_loop_is_read_from_its_arguments():
    pytest.importorskip("transformers")
    from ckptlab.run.trainer import training_loop
    args = types.SimpleNamespace(optim="adamw_torch_fused", gradient_accumulation_steps=4, max_grad_norm=1.0, fp16=True)
    assert training_loop(args) == Loop(accum_steps=4, optimizer="adamw-fused", clip_grad_norm=1.0, grad_scaler=True)
    args = types.SimpleNamespace(optim="sgd", gradient_accumulation_steps=1, max_grad_norm=0.0, fp16=False)
    assert training_loop(args) == Loop(optimizer="sgd")
    with pytest.raises(ValueError, match="optim='adafactor' is invalid for CkptlabCallback"):
        training_loop(types.SimpleNamespace(optim="adafactor", gradient_accumulation_steps=1, max_grad_norm=1.0,
                                            fp16=False))
