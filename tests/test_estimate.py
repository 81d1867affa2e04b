"""Prediction without allocation: the fake-tensor run must match measurement, cheaply."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from ckptlab import closed_form, get_workload, measure, predict, predict_fits
from ckptlab.core.policy import as_policy
from ckptlab.estimate.closed_form import gpt_block_bytes
from ckptlab.estimate.predict import _largest, _largest_of, llama7b_shape, predict_policy, prediction_error

GPT_POLICIES = ["none", "full", "density=0.5", "every=2", "segments=sqrt", "selective", "selective=alt",
                "plan=kfsk", "density=0.5+offload"]
MLP_POLICIES = ["none", "full", "density=0.25", "segments=sqrt", "selective", "plan=kfskkfsk"]
BOUND = 0.03  # the bound; on CPU the prediction is in fact exact (same ops, same tracker)


def _check(workload, batch, seq, policy, dtype="fp32"):
    predicted = predict(workload, batch, seq, policy, dtype=dtype)
    measured = measure(workload, batch, seq, policy, dtype=dtype, steps=1, warmup=0, max_seconds=0.1)
    assert measured["status"] == "ok", measured["message"]
    assert abs(prediction_error(predicted.peak_bytes, measured["peak_bytes"])) <= BOUND, (policy, predicted)
    assert abs(prediction_error(predicted.saved_activation_bytes, measured["saved_activation_bytes"])) <= BOUND
    return predicted, measured


@pytest.mark.parametrize("policy", GPT_POLICIES)
def test_prediction_matches_measurement_on_gpt(policy):
    _check(get_workload("gpt-tiny"), 2, 32, policy)


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_prediction_matches_measurement_in_bf16(policy):
    _check(get_workload("gpt-tiny", n_layer=2), 2, 32, policy, dtype="bf16")


@pytest.mark.parametrize("policy", MLP_POLICIES)
def test_prediction_matches_measurement_on_mlp_chain(policy):
    _check(get_workload("mlp-chain"), 4, 16, policy)


def test_prediction_of_a_budget_policy_resolves_a_plan():
    workload = get_workload("gpt-tiny")
    p = predict(workload, 4, 64, "budget=0.85")
    none = predict(workload, 4, 64, "none")
    assert p.plan and set(p.plan) <= set("ksf") and p.peak_bytes <= 0.85 * none.peak_bytes


def test_prediction_of_shapes_that_do_not_fit_here_is_fast():
    # gpt2-small at batch 64, seq 1024 holds tens of GiB; the fake run allocates none of it.
    p = predict(get_workload("gpt2-small"), 64, 1024, "none")
    assert p.peak_bytes > 40 * 2**30 and p.predict_s < 30
    assert p.peak_phase in ("forward", "backward")


LLAMA = """
import json, resource
from ckptlab.estimate.predict import llama7b_shape
from ckptlab.plan.budget import predict
p = predict(llama7b_shape(), 8, 4096, "full", dtype="bf16")
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak": p.peak_bytes, "params": p.peak_by_category["parameters"]}))
"""


def test_llama7b_shape_at_batch_8_seq_4096_is_predicted_in_under_2GiB():
    # Its time is a benchmark's (benchmarks/predict_and_plan.py, section 3), not a test's.
    out = subprocess.run([sys.executable, "-c", LLAMA], capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rss"] < 2 * 2**30, result    # maximum resident set of the whole process
    assert 6.5e9 * 4 < result["params"] < 7e9 * 4  # 6.7B fp32 parameters, never allocated


def test_compile_and_bad_input_are_refused_clearly():
    with pytest.raises(ValueError, match="cannot be predicted"):
        predict("gpt-tiny", 2, 16, "compile:budget=0.5")
    with pytest.raises(ValueError, match="seq_len=999"):
        predict("gpt-tiny", 2, 999)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        predict("gpt-tiny", 2, 16, dtype="fp8")


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_closed_form_is_close_to_measurement(policy):
    workload = get_workload("gpt-tiny", dropout=0.0)  # fused attention, as on a GPU
    cf = closed_form(workload, 4, 64, policy)
    p = predict(workload, 4, 64, policy)
    assert abs(prediction_error(cf["closed_form_saved_activation_bytes"], p.saved_activation_bytes)) < 0.15
    assert abs(prediction_error(cf["closed_form_peak_bytes"], p.peak_bytes)) < 0.15


@pytest.mark.parametrize("policy", ["none", "full"])
def test_closed_form_counts_16_bit_weights_as_2_bytes(policy):
    workload = get_workload("gpt-tiny", dropout=0.0)
    cf = closed_form(workload, 4, 64, policy, dtype="bf16-weights")
    p = predict(workload, 4, 64, policy, dtype="bf16-weights")
    assert abs(prediction_error(cf["closed_form_saved_activation_bytes"], p.saved_activation_bytes)) < 0.15
    assert abs(prediction_error(cf["closed_form_peak_bytes"], p.peak_bytes)) < 0.15
    fp32 = closed_form(workload, 4, 64, policy, dtype="fp32")
    # every tensor half as large, but attention's logsumexp (fp32 in both)
    assert 0.5 < cf["closed_form_peak_bytes"] / fp32["closed_form_peak_bytes"] < 0.52


def test_closed_form_block_terms_match_korthikanti_shape():
    cfg = get_workload("gpt-tiny", dropout=0.0).config
    t, h = 4 * 64, cfg.n_embd
    per = gpt_block_bytes(cfg, 4, 64, "fp32")
    assert per["full"] == 4 * t * h  # only the block input (Korthikanti: 2sbh in 16-bit)
    # fp32, fused attention, no dropout: 17 (T x h) fp32 tensors, logsumexp, LayerNorm stats
    assert per["keep"] == 68 * t * h + 4 * 4 * cfg.n_head * 64 + 16 * t


def test_predict_fits_is_consistent_with_predict():
    workload = get_workload("gpt-tiny", n_layer=2)
    cap = 16 * 2**20
    rows = predict_fits(workload, ["none", "full"], capacities=["16MiB"], seq_len=64, batch_size=2,
                     dtype="fp32", max_batch=32, seq_lens=[64, 128, 256])
    by = {r["policy"]: r for r in rows}
    for pol in ("none", "full"):
        b = by[pol]["max_batch_size"]
        assert 1 <= b < 32 and predict(workload, b, 64, pol).peak_bytes <= cap
        assert predict(workload, b + 1, 64, pol).peak_bytes > cap
    assert by["full"]["max_batch_size"] > by["none"]["max_batch_size"]
    assert by["full"]["max_seq_len"] >= by["none"]["max_seq_len"] >= 64


def test_batch_search_finds_the_largest_from_any_guess_and_a_close_guess_is_cheap():
    for upper in (1, 2, 7, 64):
        for answer in range(upper + 1):
            for guess in range(1, upper + 1):
                calls = []
                assert _largest(lambda b: calls.append(b) or b <= answer, upper, guess) == answer
                if answer and guess in (answer, answer + 1):
                    assert len(calls) <= 4, (upper, answer, guess, calls)


def test_sequence_search_finds_the_largest_of_the_values_and_a_close_guess_is_cheap():
    values = [2**k for k in range(7, 16)]
    for answer in [0] + values:
        for guess in [0] + values + [2**20]:
            calls = []
            assert _largest_of(lambda s: calls.append(s) or s <= answer, values, guess) == answer
            assert len(calls) == len(set(calls))
            if answer and guess == answer:
                assert len(calls) <= 2, (answer, guess, calls)   # the guess, and the value above it


def test_shape_preset_carries_its_own_name():
    workload = llama7b_shape(n_layer=2, n_embd=64, n_head=2, vocab_size=64)
    assert workload.name == "llama7b-shape"
    assert predict(workload, 1, 8, "full").model == "llama7b-shape"
    assert 6.5e9 < get_workload("llama7b-shape").n_params < 6.9e9


@pytest.mark.parametrize("factory", ["unused_parameter", "reentrant_checkpoint"])
def test_the_warm_up_leaves_the_state_a_first_step_leaves(factory):
    # A prediction warms up with the forward alone: no optimizer state for a parameter the loss never
    # reaches, and the whole step where a custom autograd Function hides parameters from the graph.
    # The peak is in backward, where a missing optimizer state would show.
    predicted, measured = _check(get_workload(f"tests/custom_model.py:{factory}"), 32, 32, "none")
    assert predicted.peak_phase == measured["peak_phase"] == "backward"
    assert predicted.peak_bytes == measured["peak_bytes"]
    assert predicted.peak_by_category["optimizer_state"] == measured["peak_optimizer_state_bytes"]


class MaskedBlock(nn.Module):
    """Attention by hand over a causal mask the block keeps as a buffer (the LLMs-from-scratch
    book's `mask`: context x context floats, in every block)."""

    def __init__(self, width: int, context: int):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.triu(torch.ones(context, context), diagonal=1))

    def forward(self, h):
        s = h.shape[1]
        scores = (h @ h.transpose(1, 2)).masked_fill(self.mask.bool()[:s, :s], -torch.inf)
        return h + self.proj(torch.softmax(scores, dim=-1) @ h)


class MaskedNet(nn.Module):
    def __init__(self, depth: int = 7, width: int = 16, context: int = 64):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(MaskedBlock(width, context) for _ in range(depth))
        self.head = nn.Linear(width, 3)
        self.scale = torch.ones(width)   # a tensor kept as a plain attribute

    def forward(self, x):
        h = self.embed(x) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h).mean(1)


def test_buffers_and_tensors_kept_on_modules_are_counted_measured_and_predicted():
    """A model's buffers and tensor attributes sit on its device from the start: measured and
    predicted (both paths, CPU and a card) as `buffers`, to the byte."""
    net = ckptlab.Workload.custom(
        "masked-net", build_model=MaskedNet,
        make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)),
        loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))
    held = 7 * 64 * 64 * 4 + 16 * 4
    measured = measure(net, 2, 32, "full", steps=1, warmup=0, max_seconds=0.1)
    assert measured["status"] == "ok" and measured["peak_buffers_bytes"] == held
    for options in ({}, dict(device="cuda", card="rtx4090")):
        fast, full = (predict_policy(net, 2, 32, as_policy("full"), trace=trace, **options) for trace in ("fast", "full"))
        assert fast.trace == "composed" and fast.peak_bytes == full.peak_bytes
        assert fast.peak_by_category["buffers"] == full.peak_by_category["buffers"] == held
        if not options:   # on the CPU, the measured step's
            assert fast.peak_bytes == measured["peak_bytes"]
