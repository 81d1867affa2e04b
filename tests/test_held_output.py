"""A training loop that keeps the model's output into the next step (`out = model(x)` at loop
scope): measured and predicted alike, exact to the byte on the CPU, and the held bytes derived
by hand from the output's shapes."""

import pytest
import torch
import torch.nn.functional as F

import ckptlab
from ckptlab.apps.cli import main
from ckptlab.core.loop import Loop
from ckptlab.core.policy import as_policy
from ckptlab.probe.measure import measure_policy

from .tiny_lm import tiny_lm_factory

VOCAB, WIDTH, BATCH, SEQ = 96, 16, 2, 8


def next_token_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens)["logits"].flatten(0, 1), targets.flatten())


def head_only_loss(model, batch):   # never calls the model itself: nothing to hold
    tokens, targets = batch
    return F.cross_entropy(model.head(model.embed(tokens)).flatten(0, 1), targets.flatten())


def tiny_lm(loss=next_token_loss):
    return ckptlab.Workload.custom(
        "tiny-lm", tiny_lm_factory(VOCAB, WIDTH, returns_dict=True),
        lambda b, s, gen: (torch.randint(0, VOCAB, (b, s), generator=gen), torch.randint(0, VOCAB, (b, s), generator=gen)),
        loss, blocks="blocks")


OUTPUT_BYTES = BATCH * SEQ * (VOCAB + WIDTH) * 4   # the logits and the hidden state, fp32


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_held_output_is_measured_and_predicted_to_the_byte(policy):
    rows = {}
    for holds in (False, True):
        record, report = measure_policy(tiny_lm(), BATCH, SEQ, as_policy(policy), steps=1, warmup=0,
                                        max_seconds=0.1, loop=Loop(holds_output=holds), with_report=True)
        assert record["status"] == "ok", record["message"]
        assert record["holds_output"] is holds
        predicted = ckptlab.predict(tiny_lm(), BATCH, SEQ, policy, loop=Loop(holds_output=holds))
        assert (predicted.peak_bytes, predicted.saved_activation_bytes) == (
            record["peak_bytes"], record["saved_activation_bytes"])
        assert predicted.loop.holds_output is holds and predicted.record()["holds_output"] is holds
        rows[holds] = record, report
    (dropped, dropped_report), (held, held_report) = rows[False], rows[True]
    # The previous step's output is alive when the step starts, and until its forward has made
    # its own: so from the start on, by exactly its bytes.
    assert held_report.start_bytes - dropped_report.start_bytes == OUTPUT_BYTES
    # The peak is AdamW's step, where the dropping loop holds neither (the loss has freed the
    # logits, backward the hidden state) and the holding loop holds this step's output.
    assert dropped["peak_phase"] == held["peak_phase"] == "optimizer"
    assert held["peak_bytes"] - dropped["peak_bytes"] == OUTPUT_BYTES


def test_held_output_on_cuda_adds_the_output_to_the_step_it_starts():
    dropped = ckptlab.predict(tiny_lm(), BATCH, SEQ, "none", device="cuda")
    held = ckptlab.predict(tiny_lm(), BATCH, SEQ, "none", device="cuda", loop="holds-output")
    # As on the CPU, at the optimizer step; each tensor rounded up to the allocator's 512 B.
    rounded = sum(-(-BATCH * SEQ * n * 4 // 512) * 512 for n in (VOCAB, WIDTH))
    assert dropped.peak_phase == held.peak_phase == "optimizer"
    assert held.peak_bytes - dropped.peak_bytes == rounded


def test_a_budget_is_planned_for_the_loop_that_holds_the_output():
    batch, seq = 4, 64   # activations enough for the blocks' options to matter
    plan = ckptlab.plan_budget(tiny_lm(), batch, seq, 0.95, loop="holds-output")
    assert plan.loop.holds_output and "loop adamw,holds-output" in str(plan)
    assert plan.none_peak_bytes == ckptlab.predict(tiny_lm(), batch, seq, "none", loop="holds-output").peak_bytes
    peak = ckptlab.predict(tiny_lm(), batch, seq, f"plan={plan.letters}", loop="holds-output").peak_bytes
    assert plan.predicted_peak_bytes == peak <= plan.budget_bytes
    record = ckptlab.measure(tiny_lm(), batch, seq, "budget=0.95", loop="holds-output", steps=1, warmup=0,
                             max_seconds=0.1)
    assert (record["plan"], record["peak_bytes"], record["holds_output"]) == (plan.letters, peak, True)


def test_a_loss_that_never_calls_the_model_has_no_output_to_hold():
    with pytest.raises(ValueError, match="holds_output=True is invalid for model='tiny-lm'"):
        ckptlab.predict(tiny_lm(head_only_loss), BATCH, SEQ, "none", loop="holds-output")
    record = ckptlab.measure(tiny_lm(head_only_loss), BATCH, SEQ, "none", loop="holds-output", steps=1, warmup=0,
                             max_seconds=0.1)
    assert record["status"] == "error" and "holds_output=True is invalid" in record["message"]
    with pytest.raises(ValueError, match=r"holds_output=1 is invalid: allowed are True, False"):
        ckptlab.predict(tiny_lm(), BATCH, SEQ, "none", loop=Loop(holds_output=1))


def test_cli_predicts_and_measures_a_loop_that_holds_the_output(capsys):
    assert main(["predict", "--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "2", "--seq", "16",
                 "--policy", "none", "--holds-output", "--format", "json"]) == 0
    assert '"holds_output": true' in capsys.readouterr().out
    assert main(["measure", "--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "2", "--seq", "16",
                 "--policy", "none", "--holds-output", "--max-seconds", "0.1", "--steps", "1"]) == 0
    assert "loop adamw,holds-output" in capsys.readouterr().out


def test_explain_offers_releasing_a_held_output():
    batch, seq = 4, 64
    explanation = ckptlab.explain(tiny_lm(), batch, seq, "none", loop="holds-output")
    held = ckptlab.predict(tiny_lm(), batch, seq, "none", loop="holds-output")
    dropped = ckptlab.predict(tiny_lm(), batch, seq, "none")
    assert explanation.peak_bytes == held.peak_bytes and explanation.loop.holds_output
    lever = next(lv for lv in explanation.levers if lv.name == "release the output")
    assert lever.predicted_peak_bytes == dropped.peak_bytes < held.peak_bytes
    assert "loop adamw,holds-output" in str(explanation)
    assert not any(lv.name == "release the output" for lv in ckptlab.explain(tiny_lm(), batch, seq, "none").levers)


def test_what_fits_is_answered_for_the_loop_that_holds_the_output():
    # A size between the two loops' peaks at batch 4: it fits batch 4 only when the output is dropped.
    dropped, held = (ckptlab.predict(tiny_lm(), 4, SEQ, "none", loop=Loop(holds_output=h)).peak_bytes for h in (False, True))
    assert held > dropped
    rows = {h: ckptlab.predict_fits(tiny_lm(), ["none"], [dropped], seq_len=SEQ, max_batch=4, seq_lens=[SEQ],
                                    loop=Loop(holds_output=h))[0] for h in (False, True)}
    assert rows[False]["max_batch_size"] == 4 and rows[True]["max_batch_size"] < 4
    assert rows[True]["holds_output"] and not rows[False]["holds_output"]
