"""The explorer's callbacks as plain functions (the browser test drives the real widgets): measured
here, and predicted for a card."""

import dataclasses

import pytest

import ckptlab
import ckptlab.apps.explorer as explorer_module
from ckptlab import format_bytes, get_workload
from ckptlab.apps.explorer import Explorer, prediction_table
from ckptlab.core.cards import DEFAULT_MARGIN_BYTES, parse_capacity

SMALL = dict(batch_size=2, seq_len=16, steps=1, warmup=0, max_seconds=0.2)


def test_run_measures_the_policy_beside_no_checkpointing():
    explorer = Explorer(get_workload("gpt-tiny", n_layer=2), policy="full", **SMALL)
    df = explorer.run()
    assert list(df.policy) == ["none", "full"]
    assert df.saved_activation_bytes.iloc[1] < df.saved_activation_bytes.iloc[0]
    summary = explorer.summary()
    assert "gpt-tiny  batch 2 x seq 16" in summary and "overhead" in summary and "full: peak" in summary
    # beside the measurement, the explanation of the same step, its peak predicted to the byte
    assert explorer.explanation.peak_bytes == df.peak_bytes.iloc[1]
    assert "why (full, predicted peak" in summary and "lowest peak of any checkpoint policy" in summary


def test_memory_limit_marks_what_does_not_fit():
    # at this shape activations dominate: none peaks at 77.8 MiB, full at 31.0 MiB
    explorer = Explorer(policy="full", memory_limit="48MiB", batch_size=8, seq_len=128, steps=1, warmup=0, max_seconds=0.2,
                        with_explanation=False)
    explorer.run()
    lines = explorer.summary().splitlines()
    assert "DOES NOT FIT" in lines[1] and lines[2].rstrip().endswith("fits")


def test_set_validates_before_changing_anything():
    explorer = Explorer(**SMALL)
    with pytest.raises(ValueError, match="density=3 is invalid"):
        explorer.set(policy="density=3")
    with pytest.raises(ValueError, match="memory_limit='lots' is invalid"):
        explorer.set(memory_limit="lots")
    with pytest.raises(ValueError, match="model='gpt-9' is invalid"):
        explorer.set(model="gpt-9")
    assert explorer.config["policy"] == "density=0.5" and explorer.config["memory_limit"] is None


def test_widget_changes_reach_the_configuration_and_remeasure():
    explorer = Explorer(**SMALL, with_explanation=False)
    explorer.widgets()
    w = explorer._widgets
    w["batch_size"].value = 4                      # what a slider release sends
    assert explorer.config["batch_size"] == 4 and list(explorer.records.batch_size) == [4, 4]
    w["policy_choice"].value = "full"
    assert explorer.config["policy"] == "full" and list(explorer.records.policy) == ["none", "full"]
    w["policy_choice"].value = "density"
    w["density"].value = 0.25
    assert explorer.config["policy"] == "density=0.25"
    w["memory_limit"].value = "1GiB"
    assert explorer.config["memory_limit"] == "1GiB" and bool(explorer.records.fits.all())
    w["loop"].value = "sgd"                        # the loop and dtype are measured too
    assert explorer.config["loop"] == "sgd" and set(explorer.records.loop) == {"sgd"}
    assert all(not control.continuous_update for name, control in w.items()
               if name in ("batch_size", "seq_len", "density"))


def test_static_view_renders_without_widgets(capsys):
    Explorer(policy="every=2", **SMALL, with_explanation=False).show(interactive=False)
    out = capsys.readouterr().out
    assert "every=2: peak" in out


# ---------------------------------------------------------------------------- on a card: predicted
ON_CARD = dict(batch_size=2, seq_len=64, policy="full", card="rtx4090")


def same(a, b) -> bool:
    """Two predictions alike in every field but their wall time."""
    return dataclasses.replace(a, predict_s=0.0) == dataclasses.replace(b, predict_s=0.0)


def test_card_view_shows_what_predict_answers_side_by_side():
    explorer = Explorer("hf-llama-tiny", dtype="bf16-weights", loop="adamw-fused,accum=2", **ON_CARD)
    df = explorer.run()
    assert list(df.policy) == ["none", "full"] and explorer.explanation is None   # two predictions, no explain
    table = prediction_table(explorer.predictions)
    for p in explorer.predictions:
        direct = ckptlab.predict("hf-llama-tiny", 2, 64, p.policy, dtype="bf16-weights", loop="adamw-fused,accum=2",
                                 device="cuda", card="rtx4090")
        assert same(p, direct)
        assert table[p.policy]["device bytes"] == format_bytes(direct.device_bytes)
        assert table[p.policy]["margin left"] == format_bytes(direct.margin_bytes)
        assert table[p.policy]["allocated / reserved"] == \
            f"{format_bytes(direct.peak_bytes)} / {format_bytes(direct.reserved_bytes)}"
        assert table[p.policy]["attention"] == direct.attention_backend
        assert table[p.policy]["peak in"] == direct.peak_phase
        assert table[p.policy]["predicted in"] == f"{p.predict_s:.2f} s"
    kept = dataclasses.replace(explorer.predictions[0], answered_from_cache=True)
    assert prediction_table([kept])[kept.policy]["predicted in"] == f"{kept.predict_s:.2f} s (kept on disk)"
    summary = explorer.summary()
    assert summary.startswith("hf-llama-tiny  batch 2 x seq 64  bf16-weights, loop adamw-fused,accum=2  predicted "
                              "for RTX 4090")
    assert "device bytes" in summary and "predicted in" in summary


def test_card_widgets_repredict_on_each_change():
    explorer = Explorer(get_workload("gpt-tiny", n_layer=2), **ON_CARD)
    explorer.widgets()
    w = explorer._widgets
    assert w["card"].options == tuple(c.name for c in ckptlab.cards()) and "memory_limit" not in w
    w["batch_size"].value = 4                     # a slider's release
    assert [(p.batch_size, p.policy) for p in explorer.predictions] == [(4, "none"), (4, "full")]
    assert same(explorer.predictions[1], ckptlab.predict(explorer.workload, 4, 64, "full", device="cuda",
                                                         card="rtx4090"))
    w["card"].value = "h100-80"
    assert {p.card for p in explorer.predictions} == {"h100-80"}
    w["loop"].value = "sgd,accum=2"
    w["dtype"].value = "bf16"
    assert {(str(p.loop), p.dtype) for p in explorer.predictions} == {("sgd,accum=2", "bf16")}
    none = explorer.predictions[0]
    w["policy_choice"].value = "none"              # only the baseline, the same prediction as before
    assert explorer.predictions == [none]
    w["loop"].value = "adamw,nonsense"             # shown, nothing changes
    assert explorer.config["loop"] == "sgd,accum=2" and explorer.predictions == [none]


def test_fit_line_is_predicts_answer_with_its_reason():
    explorer = Explorer(get_workload("gpt-tiny", n_layer=2), batch_size=8, seq_len=128, policy="full", card="rtx4090")
    explorer.run()
    none, full = explorer.predictions
    # a card between the two: full fits it, none does not
    card = parse_capacity("rtx4090", usable_bytes=(none.device_bytes + full.device_bytes) // 2 + DEFAULT_MARGIN_BYTES)
    explorer.set(card=card)
    explorer.run()
    table = prediction_table(explorer.predictions)
    summary = explorer.summary()
    assert [p.fit for p in explorer.predictions] == ["no", "yes"]
    for p in explorer.predictions:
        assert table[p.policy]["fits"] == p.fit and f"{p.policy}: {p.fit_reason}" in summary
    fig = explorer.figure()
    assert fig.axes[0].get_title() == "predicted peak on rtx4090"   # the card's line drawn: within reach
    assert [t.get_text() for t in fig.axes[0].texts] == [f"{format_bytes(p.device_bytes)}\n{w}" for p, w in
                                                        zip(explorer.predictions, ["does not fit", "fits"])]


def test_largest_batch_is_the_largest_that_fits():
    explorer = Explorer(get_workload("gpt-tiny", n_layer=2), batch_size=4, seq_len=128, policy="none", card="rtx4090")
    explorer.run()
    # a card that batch 4 just fits: the search stays among small batches
    explorer.set(card=parse_capacity("rtx4090", usable_bytes=explorer.predictions[0].device_bytes + DEFAULT_MARGIN_BYTES))
    (row,) = explorer.largest_batch()
    largest = row["max_batch_size"]
    on = dict(device="cuda", card=explorer.config["card"])
    assert ckptlab.predict(explorer.workload, largest, 128, **on).fit == "yes"
    assert ckptlab.predict(explorer.workload, largest + 1, 128, **on).fit != "yes"
    assert (f"largest batch at seq 128 on RTX 4090: none {largest} ({row['max_batch_size_with_flushes']} with "
            "cache flushes)") in explorer.summary()
    explorer.set(batch_size=2)
    explorer.run()
    assert "largest batch" not in explorer.summary()     # of another configuration: asked for again


def test_largest_batch_at_the_search_limit_says_or_more(monkeypatch):
    monkeypatch.setattr(explorer_module, "LARGEST_BATCH_SEARCHED", 2)
    explorer = Explorer(get_workload("gpt-tiny", n_layer=2), batch_size=1, seq_len=16, policy="none", card="rtx4090")
    explorer.run()
    (row,) = explorer.largest_batch()
    assert row["max_batch_size"] == 2
    assert "none 2 or more (the search stops there) (2 or more (the search stops there) with cache flushes)" in explorer.summary()


def test_card_view_refuses_bad_input_before_any_work():
    explorer = Explorer(get_workload("gpt-tiny", n_layer=2), **ON_CARD)
    before = dict(explorer.config)
    for change, message in [
        (dict(card="gtx1080"), "card='gtx1080' is invalid: allowed are rtx3090, rtx4090"),
        (dict(card="24GiB"), "card='24GiB' is invalid: allowed are rtx3090"),
        (dict(card=None), "card=None is invalid for an explorer that predicts: allowed are rtx3090"),
        (dict(policy="density=3"), "density=3 is invalid"),
        (dict(policy="full+compile"), "policy=full\\+compile cannot be predicted"),
        (dict(loop="adamw,accum=0"), "accum_steps=0 is invalid: allowed is an integer >= 1"),
        (dict(loop="lion"), "optimizer='lion' is invalid: allowed are adamw"),
        (dict(dtype="fp8"), "dtype='fp8' is invalid: allowed are fp32"),
        (dict(memory_limit="1GiB"), "memory_limit='1GiB' is invalid with card='rtx4090': the card is the limit"),
        (dict(batch_size=0), "batch_size=0 is invalid"),
    ]:
        with pytest.raises(ValueError, match=message):
            explorer.set(**change)
        assert explorer.config == before and explorer.predictions is None
    # the cheap checks come before the model is loaded: an unknown card is named, not the model
    with pytest.raises(ValueError, match="card='gtx1080' is invalid"):
        Explorer("gpt-9", card="gtx1080")
    with pytest.raises(ValueError, match="card='rtx4090' is invalid for an explorer that measures: allowed is None"):
        Explorer(**SMALL).set(card="rtx4090")
    with pytest.raises(ValueError, match="largest_batch is for an explorer with a card"):
        Explorer(**SMALL).largest_batch()


def test_card_view_renders_without_widgets(capsys):
    Explorer(get_workload("gpt-tiny", n_layer=2), **ON_CARD).show(interactive=False)
    out = capsys.readouterr().out
    assert "predicted for RTX 4090" in out and "fits" in out and "full: fits" in out
