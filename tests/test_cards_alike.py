"""A step traced on one card is the step of another card that answers every question the trace
asked about the card alike (`CudaSemantics.ask`): predictions for several cards from one prepared
model equal predictions traced for each card alone, and cards that choose other kernels trace
their own step."""

import pytest

from ckptlab.core.cards import card
from ckptlab.core.policy import as_policy
from ckptlab.estimate import compose, fake_step
from ckptlab.estimate.compose import FROM_ALIKE_CARD, composed_step
from ckptlab.estimate.predict import predict_policy
from ckptlab.workloads.registry import get_workload

from .test_fast_path import assert_same_fields

# sm89 with 128 SMs, sm80 108, sm90 132, sm86 82, sm89 58, and sm80 108 again (the A100-40's kernels)
CARDS = ("rtx4090", "a100-40", "h100-80", "rtx3090", "l4", "a100-80")
NOT_HOPPER = {"rtx4090", "a100-40", "rtx3090", "l4", "a100-80"}


@pytest.mark.parametrize("spec, overrides, dtype, seq, options, groups", [
    # flash without dropout on sm80 / sm86 / sm89 (its split of the keys settles at another batch on
    # each SM count: the line starts there); cuDNN first on sm90 with torch 2.13
    ("hf-llama-tiny", dict(num_hidden_layers=7, attention_dropout=0.0), "bf16", 16, {}, [NOT_HOPPER, {"h100-80"}]),
    # fp32 head dim 128: the memory-efficient backward's 128 x 64 kernel needs more shared memory
    # than sm86 / sm89 give; two accumulation passes, blocks offloaded
    ("gpt-tiny", dict(n_layer=7, n_head=2, n_embd=256, dropout=0.0), "fp32", 32,
     dict(policy="full+offload", loop="adamw,accum=2"), [{"rtx4090", "rtx3090", "l4"}, {"a100-40", "h100-80", "a100-80"}]),
    # bf16 head dim 208 with dropout: flash's backward refuses it on sm86 / sm89 (efficient runs);
    # cuDNN refuses a dropout of 0.1 (not in sixteenths)
    ("gpt-tiny", dict(n_layer=7, n_head=1, n_embd=208), "bf16", 32, dict(policy="selective"),
     [{"rtx4090", "rtx3090", "l4"}, {"a100-40", "h100-80", "a100-80"}]),
    # flash without dropout splitting 257 keys in two at batch 1 on every SM count (cuDNN on sm90)
    ("gpt-tiny", dict(n_layer=7, block_size=512, dropout=0.0), "bf16", 257, {}, [NOT_HOPPER, {"h100-80"}]),
])
def test_cards_that_answer_alike_share_a_trace_and_predict_what_each_traced_alone(spec, overrides, dtype, seq, options,
                                                                                    groups, monkeypatch):
    workload = get_workload(spec, **overrides)
    traces = []
    tracking = compose.track_memory
    monkeypatch.setattr(compose, "track_memory", lambda *a, **k: traces.append(k) or tracking(*a, **k))
    fake_step.clear_prepared()
    policy = as_policy(options.get("policy", "none"))
    options = dict(dtype=dtype, device="cuda", loop=options.get("loop"))
    shared = {}
    for name in CARDS:
        before = len(traces)
        step = composed_step(workload, 1, seq, policy, card=card(name), **options)[0]
        prediction = predict_policy(workload, 1, seq, policy, card=name, **options)
        shared[name] = (step, prediction, len(traces) > before)
    traced_on = {name for name, (_, _, traced) in shared.items() if traced}
    assert [len(g & traced_on) for g in groups] == [1] * len(groups), traced_on   # one trace per group
    for group in groups:   # the prediction says which card's step it was made from
        traced_for = next(iter(group & traced_on))
        assert {name: shared[name][1].trace for name in group} == {
            name: "composed" if name == traced_for else f"{FROM_ALIKE_CARD} {traced_for} (the same kernels)"
            for name in group}
    for name in set(CARDS) - traced_on:   # each step taken from another card's is the one traced for it alone
        step, prediction, _ = shared[name]
        fake_step.clear_prepared()
        alone = composed_step(workload, 1, seq, policy, card=card(name), **options)[0]
        assert step == alone, name
        assert_same_fields(prediction, predict_policy(workload, 1, seq, policy, card=name, **options))
