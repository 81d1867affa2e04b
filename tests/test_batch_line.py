"""A composed step's events as a line in the batch size (`estimate.batch_line`): a prediction made
from the line is the traced one to the byte; a step that leaves the line is traced; a table's
search on lines gives the traced search's rows."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from ckptlab.core.cards import parse_capacity
from ckptlab.core.policy import as_policy
from ckptlab.estimate import batch_line, fake_step
from ckptlab.estimate.batch_line import batch_lines, on_line
from ckptlab.estimate.predict import predict_fits, predict_policy
from ckptlab.workloads.registry import get_workload

from .test_fast_path import CUDA, assert_same_fields


@pytest.mark.parametrize("spec, overrides, policy, options", [
    # bf16: flash attention with dropout, whose kernels do not read the batch size (fp32 runs the
    # memory-efficient backward, whose split of 16 keys settles from b x 4 heads >= 256)
    ("gpt-tiny", dict(n_layer=7), "full", dict(CUDA, dtype="bf16")),
    ("gpt-tiny", dict(n_layer=7), "full+offload", dict(CUDA, dtype="bf16")),              # pinned host blocks
    ("gpt-tiny", dict(n_layer=7), "none", dict(CUDA, dtype="bf16", loop="adamw,holds-output")),  # state between steps
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=7), "selective", dict(CUDA, dtype="bf16-weights")),
])
def test_a_prediction_from_the_line_is_the_traced_one(spec, overrides, policy, options):
    workload = get_workload(spec, **overrides)
    with batch_lines():
        for b in (2, 3, 5):
            assert not on_line(predict_policy(workload, b, 16, as_policy(policy), **options).trace)
        from_line = [predict_policy(workload, b, 16, as_policy(policy), **options) for b in (4, 9, 1)]
    assert [on_line(p.trace) for p in from_line] == [True, True, False]   # batch 1 is off the line
    assert from_line[0].trace == "composed, on its batch line (traced at batch sizes 2, 3, 5)"
    fake_step.clear_prepared()
    for p in from_line:
        traced = predict_policy(workload, p.batch_size, 16, as_policy(policy), **options)
        assert traced.trace == "composed"
        assert_same_fields(p, traced)


def test_lines_are_used_only_inside_batch_lines():
    workload = get_workload("gpt-tiny", n_layer=7)
    with batch_lines():
        for b in (2, 3, 4):
            predict_policy(workload, b, 16, as_policy("none"))
    assert predict_policy(workload, 6, 16, as_policy("none")).trace == "composed"
    with batch_lines():
        assert on_line(predict_policy(workload, 6, 16, as_policy("none")).trace)


class PairwiseNet(nn.Module):
    """Repeated blocks, then a loss over every pair of the batch's samples: a b x b tensor,
    whose bytes are not on a line in the batch size."""

    def __init__(self, depth: int = 7, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(depth))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return h.mean(dim=1)


def pairwise_loss(model, batch):
    z = model(batch[0])
    similarity = z @ z.T                       # [b, b]
    return F.cross_entropy(similarity, torch.arange(z.shape[0]))


def pairwise_workload():
    return ckptlab.Workload.custom("pairwise", build_model=PairwiseNet,
                                   make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen),),
                                   loss=pairwise_loss)


def test_a_step_that_grows_faster_than_the_batch_is_traced():
    # Bytes b x b (4 B each, fp32): 2 -> 16 B, 3 -> 36 B, 5 -> 100 B; the line through the first
    # two gives 56 B at 5, so the third traced point leaves the line and nothing comes from it.
    workload = pairwise_workload()
    with batch_lines():
        for b in (2, 3, 5, 8):
            p = predict_policy(workload, b, 16, as_policy("none"))
            assert p.trace == "composed"
    prepared = next(found for _, found in fake_step._PREPARED.values())
    (line,) = prepared.cut.batch_lines.values()
    assert line.broken and list(line.traced) == [2, 3] and line.on_line == []


# A card of 64 MiB without a context or margin: searches of tens of batch sizes through the allocator.
SMALL_CARD = parse_capacity("rtx4090", usable_bytes="64MiB", context_bytes=0, required_margin_bytes=0)


@pytest.mark.parametrize("workload, capacities, dtype, uses_lines", [
    (lambda: get_workload("gpt-tiny", n_layer=7), [SMALL_CARD], "bf16", True),
    (lambda: get_workload("gpt-tiny", n_layer=7), ["a100-40"], "bf16", False),   # batch 1024 fits: 3 predictions
    (pairwise_workload, ["48MiB"], "fp32", False),
])
def test_a_table_searched_on_lines_is_the_traced_search(workload, capacities, dtype, uses_lines, monkeypatch):
    options = dict(seq_len=64, seq_lens=[64], dtype=dtype, max_batch=24)
    made = []
    predicting = predict_policy

    def counted(*args, **kwargs):
        p = predicting(*args, **kwargs)
        made.append(on_line(p.trace))
        return p

    monkeypatch.setattr("ckptlab.estimate.predict.predict_policy", counted)
    on_lines = predict_fits(workload(), ["full"], capacities, **options)
    from_lines = sum(made)
    fake_step.clear_prepared()
    monkeypatch.setattr(batch_line, "MIN_TRACED", 10**9)   # no line is ever long enough
    traced = predict_fits(workload(), ["full"], capacities, **options)
    assert on_lines == traced
    assert (from_lines > 0) == uses_lines


def test_a_line_starts_where_flash_stops_splitting_the_keys():
    """Flash attention without dropout splits the keys while b x heads x ceil(s / 64) blocks fill
    less than 0.8 of the card's 2 x SMs slots: 4 heads, s 16, an RTX 4090's 128 SMs: below
    b = ceil(0.8 x 256 / 4) = 52 (51 x 4 = 204 < 204.8). Its fp32 buffers are not on a line in b,
    so a line starts at 52: below, every prediction is traced."""
    workload = get_workload("hf-llama-tiny", num_hidden_layers=7, attention_dropout=0.0)
    options = dict(CUDA, dtype="bf16")
    with batch_lines():
        for b in (52, 53, 60):
            predict_policy(workload, b, 16, as_policy("none"), **options)
        above = predict_policy(workload, 57, 16, as_policy("none"), **options)
        below = [predict_policy(workload, b, 16, as_policy("none"), **options) for b in (2, 3, 5, 4, 51)]
    assert below[0].attention_backend == "flash"
    assert not any(on_line(p.trace) for p in below)
    assert above.trace == "composed, on its batch line (traced at batch sizes 52, 53, 60)"
    fake_step.clear_prepared()
    assert_same_fields(above, predict_policy(workload, 57, 16, as_policy("none"), **options))


def test_a_line_starts_where_the_efficient_backward_stops_splitting_the_keys():
    """The memory-efficient backward on an RTX 4090 (sm89) in bf16 with head dim 128 stages dk / dv
    in fp32 and splits the keys into at most 200 // (b x heads) parts: 2 heads, one split from
    b x 2 > 100, b = 51. Below, its workspace is not on a line in b, so a line starts at 51."""
    workload = get_workload("gpt-tiny", n_layer=7, n_head=2, n_embd=256, dropout=0.0)
    options = dict(CUDA, dtype="bf16", attention="efficient")
    with batch_lines():
        for b in (51, 52, 60):
            predict_policy(workload, b, 128, as_policy("none"), **options)
        above = predict_policy(workload, 57, 128, as_policy("none"), **options)
        below = [predict_policy(workload, b, 128, as_policy("none"), **options) for b in (2, 3, 5, 40)]
    assert not any(on_line(p.trace) for p in below)
    assert above.trace == "composed, on its batch line (traced at batch sizes 51, 52, 60)"
    fake_step.clear_prepared()
    for p in [above, below[-1]]:
        assert_same_fields(p, predict_policy(workload, p.batch_size, 128, as_policy("none"), **options))
