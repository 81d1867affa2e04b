
import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ckptlab import apply_checkpointing, find_blocks, get_workload, parse_policy
from ckptlab.checkpoint.blocks import handle_of
from ckptlab.core.policy import KINDS
from ckptlab.plan.budget import resolve
from ckptlab.probe.verify import compare_gradients

# Every kind of the vocabulary that ckptlab's block wrappers apply, by its example, and the variants
# of each (other values, +offload); compile kinds: tests/test_compile_policies.py; hf: tests/test_hf.py.
EXAMPLES = [k.example for k in KINDS.values() if k.mechanism == "blocks"]
VARIANTS = ["density=0.25", "every=3", "segments=sqrt", "selective=alt", "selective=attn", "plan=sfks", "offload",
            "density=0.5+offload", "segments=2+offload", "selective+offload"]
MODELS = {"gpt": dict(name="gpt-tiny", n_layer=4, n_embd=32, n_head=2, vocab_size=64, dropout=0.2),
          "mlp": dict(name="mlp-chain", n_layer=4, n_embd=16)}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", EXAMPLES + VARIANTS)
def test_gradients_equal_the_unckeckpointed_model(policy, model):
    workload, seq_len = get_workload(**MODELS[model]), 16 if model == "gpt" else 8
    policy = resolve(parse_policy(policy), workload, 2, seq_len).policy  # a budget becomes its plan
    cmp = compare_gradients(workload, policy, batch_size=2, seq_len=seq_len)
    # CPU fp32: the recompute replays the same kernels on the same inputs with the same RNG
    # state (dropout on), so the results are bitwise equal; any difference is a bug, not rounding.
    assert cmp.exact, cmp


def test_dropout_really_randomizes_so_the_equality_test_can_fail():
    # Without preserved RNG state the recompute draws different dropout masks: gradients differ.
    workload = get_workload("gpt-tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64, dropout=0.2)
    cmp = compare_gradients(workload, "full", preserve_rng_state=False)
    assert cmp.max_abs_diff > 1e-6


def test_reentrant_mode_also_matches_on_gpt():
    workload = get_workload("gpt-tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64, dropout=0.2)
    assert compare_gradients(workload, "full", use_reentrant=True).exact


def _gpt(n_layer=4):
    return get_workload("gpt-tiny", n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64)


def test_recompute_count_equals_checkpointed_blocks():
    workload = _gpt(4)
    batch = workload.batch(2, 8)
    for policy, expected in [("none", 0), ("full", 4), ("density=0.5", 2), ("layers=3", 1), ("segments=2", 2)]:
        model = workload.build()
        handle = apply_checkpointing(model, policy)
        workload.loss(model, batch).backward()
        assert handle.recompute_count == expected, policy
        handle.reset_counts()
        with torch.no_grad():  # inference saves nothing and recomputes nothing
            workload.loss(model, batch)
        assert handle.recompute_count == 0


def _forward_backward_flops(workload, policy, batch):
    model = workload.build()
    apply_checkpointing(model, policy, early_stop=False)
    with FlopCounterMode(display=False) as fwd:
        loss = workload.loss(model, batch)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("name", ["mlp-chain", "gpt-tiny"])
def test_backward_flops_grow_by_the_checkpointed_blocks_forward_flops(name):
    workload = get_workload(name, n_layer=4) if name == "mlp-chain" else _gpt(4)
    batch = workload.batch(2, 16)
    fwd0, bwd0 = _forward_backward_flops(workload, "none", batch)
    block_flops = []
    model = workload.build()
    x = model.wte(batch[0]) + model.wpe(torch.arange(16)) if name == "gpt-tiny" else batch[0]
    for block in find_blocks(model):
        with FlopCounterMode(display=False) as one:
            x = block(x)
        block_flops.append(one.get_total_flops())
    assert min(block_flops) > 0
    for policy, blocks in [("full", [0, 1, 2, 3]), ("density=0.5", [1, 3]), ("layers=0", [0])]:
        fwd, bwd = _forward_backward_flops(workload, policy, batch)
        assert fwd == fwd0
        assert bwd - bwd0 == sum(block_flops[i] for i in blocks), policy


def test_handle_removes_and_state_dict_is_unchanged():
    workload = _gpt(4)
    model = workload.build()
    keys = list(model.state_dict())
    with apply_checkpointing(model, "full") as handle:
        assert list(model.state_dict()) == keys
        assert all("forward" in b.__dict__ for b in find_blocks(model))
        assert "removed" not in repr(handle)
    assert all("forward" not in b.__dict__ for b in find_blocks(model))
    handle.remove()  # idempotent


def test_applying_twice_replaces_instead_of_nesting():
    workload = _gpt(4)
    model = workload.build()
    first = apply_checkpointing(model, "full")
    second = apply_checkpointing(model, "layers=1")
    workload.loss(model, workload.batch(2, 8)).backward()
    assert second.recompute_count == 1 and first.recompute_count == 0
    assert "removed" in repr(first) and first.removed and not second.removed
    assert [handle_of(b) is second for b in find_blocks(model)] == [False, True, False, False]
    second.remove()
    assert all("forward" not in b.__dict__ and handle_of(b) is None for b in find_blocks(model))


def test_inference_runs_are_not_counted_as_recomputes():
    workload = _gpt(2)
    model = workload.build()
    with apply_checkpointing(model, "full") as handle, torch.no_grad():
        workload.loss(model, workload.batch(2, 8))
        assert handle.recompute_count == 0


def test_invalid_policy_raises_before_touching_the_model():
    model = _gpt(4).build()
    with pytest.raises(ValueError, match="layers=9 is invalid for a model with 4 blocks"):
        apply_checkpointing(model, "layers=9")
    with pytest.raises(ValueError, match="density=1.5"):
        apply_checkpointing(model, "density=1.5")
    assert all("forward" not in b.__dict__ for b in find_blocks(model))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return (self.lin(x) * scale,)  # a tuple, as older Hugging Face layers return


class _HFDecoder(nn.Module):
    """The Llama layout: model.layers, layers return tuples, keyword arguments passed."""

    def __init__(self, n=4):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Linear(4, 4)
        self.model.layers = nn.ModuleList(_Layer() for _ in range(n))
        self.model.norms = nn.ModuleList([nn.LayerNorm(4), nn.LayerNorm(4)])  # a smaller list

    def forward(self, x):
        h = self.model.embed(x)
        for layer in self.model.layers:
            h = layer(h, scale=0.5)[0]
        return h.sum()


class _GPT2Layout(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


def test_find_blocks_on_common_layouts():
    decoder = _HFDecoder()
    assert find_blocks(decoder) == list(decoder.model.layers)
    gpt2 = _GPT2Layout()
    assert find_blocks(gpt2) == list(gpt2.transformer.h)
    assert len(find_blocks(get_workload("mlp-chain").build())) == 8


def test_find_blocks_error_and_explicit_blocks():
    with pytest.raises(ValueError, match="Linear has no repeated blocks.*blocks="):
        find_blocks(nn.Linear(2, 2))
    model = _HFDecoder()
    handle = apply_checkpointing(model, "full", blocks=list(model.model.norms))
    assert handle.n_blocks == 2
    shared = nn.Sequential(nn.Linear(2, 4), nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU())] * 3))
    with pytest.raises(ValueError, match=r"it holds 0 \(Linear\), 1 \(ModuleList of one Sequential, 3 times: a shared "
                                         r"block, not blocks of their own\)\. Name them with blocks="):
        find_blocks(shared)


@pytest.mark.parametrize("policy", ["full", "segments=2", "layers=1,2"])
def test_tuple_outputs_and_keyword_arguments(policy):
    torch.manual_seed(0)
    model = _HFDecoder()
    x = torch.randn(3, 4)
    model(x).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    handle = apply_checkpointing(model, policy)
    model(x).backward()
    assert len(ref) == 10  # embed + 4 layers, weight and bias each
    for n, g in ref.items():
        assert torch.equal(model.get_parameter(n).grad, g), n
    assert handle.recompute_count == len(handle.checkpointed_blocks)


def test_segments_refuse_out_of_order_calls():
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    apply_checkpointing(model, "segments=2")
    with pytest.raises(RuntimeError, match="segments policy: blocks were not called in order"):
        model[1](torch.randn(2, 4))


NORMS = [lambda c: nn.BatchNorm1d(c), lambda c: nn.BatchNorm1d(c, momentum=None),   # None: a cumulative average
         lambda c: nn.InstanceNorm1d(c, affine=True, track_running_stats=True), lambda c: nn.SyncBatchNorm(c)]


class _NormedBlock(nn.Module):
    def __init__(self, width: int, norm):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(width, width, 1), norm(width), nn.ReLU(), nn.Dropout(0.1))

    def forward(self, x):
        return x + self.body(x)


class _NormedBlocks(nn.Module):
    """Blocks with batch norms of every kind that keeps running statistics, and dropout."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.stem = nn.Conv1d(width, width, 1)   # the blocks' inputs require grad (reentrant checkpoint needs it)
        self.blocks = nn.ModuleList(_NormedBlock(width, norm) for norm in NORMS)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _trained_state(policy: str, held: bool = True, **options) -> dict:
    torch.manual_seed(0)
    model = _NormedBlocks()
    if policy != "none":
        apply_checkpointing(model, policy, **options)
    torch.manual_seed(1)
    for _ in range(2):
        model(torch.randn(8, 16, 5)).backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state | {f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()}


BLOCK_POLICIES = ["full", "density=0.5", "every=2", "layers=1,2", "segments=2", "full+offload"]
SELECTIVE_POLICIES = ["selective", "selective=alt", "plan=sfks"]   # non-reentrant only


@pytest.mark.parametrize("policy, use_reentrant", [(p, False) for p in BLOCK_POLICIES + SELECTIVE_POLICIES]
                         + [(p, True) for p in BLOCK_POLICIES])
def test_a_recompute_leaves_batch_norm_running_statistics_as_the_forward_left_them(policy, use_reentrant):
    # the recompute runs each batch norm again: without care it counts the batch twice in the
    # running mean, variance and num_batches_tracked, which eval mode then uses
    expected, got = _trained_state("none"), _trained_state(policy, use_reentrant=use_reentrant)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_without_holding_the_statistics_a_recompute_counts_the_batch_twice(monkeypatch):
    from ckptlab.checkpoint import wrap  # noqa: PLC0415 - the module whose helper this test turns off
    monkeypatch.setattr(wrap, "_recomputing_without_statistics", lambda region, run: run)
    got, expected = _trained_state("full"), _trained_state("none")
    assert got["blocks.0.body.1.num_batches_tracked"] == 2 * expected["blocks.0.body.1.num_batches_tracked"] == 4
    assert not torch.equal(got["blocks.0.body.1.running_mean"], expected["blocks.0.body.1.running_mean"])
