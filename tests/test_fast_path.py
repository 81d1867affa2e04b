"""The fast path of a prediction (a few blocks traced, the step composed) gives the full trace's
prediction to the byte: presets, LoRA, bf16 weights, offload, selective, plans, CPU and CUDA, and
models whose blocks differ."""

import dataclasses
import enum

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from ckptlab.apps.cli import main
from ckptlab.core.policy import as_policy, plan_policy
from ckptlab.estimate import block_profile, compose, fake_step
from ckptlab.estimate.fake_mode import new_fake_mode
from ckptlab.estimate.predict import predict_policy
from ckptlab.workloads.registry import get_workload

CUDA = dict(device="cuda", card="rtx4090")


def both_ways(workload, policy: str, batch: int = 2, seq: int = 16, **options):
    """(fast, full) predictions of one step."""
    return tuple(predict_policy(workload, batch, seq, as_policy(policy), trace=trace, **options)
                 for trace in ("fast", "full"))


def assert_same(fast, full) -> None:
    """Every field but the wall time and the path is identical."""
    assert_same_fields(fast, full)
    assert full.trace == "full"


def assert_same_fields(one, other) -> None:
    theirs = dataclasses.asdict(other)
    differ = {k: (v, theirs[k]) for k, v in dataclasses.asdict(one).items()
              if k not in ("predict_s", "trace") and v != theirs[k]}
    assert not differ, differ


@pytest.mark.parametrize("spec, overrides, policy, options", [
    ("gpt-tiny", dict(n_layer=7), "none", {}),
    ("gpt-tiny", dict(n_layer=7), "full", CUDA),
    ("gpt-tiny", dict(n_layer=7), "selective", {}),
    ("gpt-tiny", dict(n_layer=7), "full+offload", CUDA),
    ("gpt-tiny", dict(n_layer=7), "full+offload", {}),
    ("gpt-tiny", dict(n_layer=11), "every=2", {}),
    ("gpt-tiny", dict(n_layer=7), "plan=kkkkkks", CUDA),
    ("gpt-tiny", dict(n_layer=11), "plan=kfffkkkkkkf", {}),              # a run of one kind, cut
    ("gpt-tiny", dict(n_layer=11), "plan=kfkkkkkksfs", CUDA),
    ("gpt-tiny", dict(n_layer=12), "plan=ksssssskfkff", dict(CUDA, dtype="bf16")),
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=11), "plan=kffkkkkkkkf", dict(CUDA, dtype="bf16-weights")),
    ("gpt-tiny", dict(n_layer=7), "none", dict(dtype="bf16")),          # autocast's cache of weight casts
    ("gpt-tiny", dict(n_layer=11), "full", dict(dtype="bf16")),         # CPU autocast's casts freed in a recompute,
    ("gpt-tiny", dict(n_layer=11), "selective", dict(dtype="fp16", loop="adamw,scaler")),   # in another order per block
    ("gpt-tiny", dict(n_layer=7), "selective", dict(CUDA, dtype="bf16")),
    ("gpt-tiny", dict(n_layer=12), "every=2", dict(CUDA, dtype="bf16")),      # a period of two blocks' casts:
    ("gpt-tiny", dict(n_layer=12), "density=0.5", dict(dtype="fp16", loop="adamw,scaler")),   # block by block, and
                                                                              # on the CPU, storage by storage
    ("gpt-tiny", dict(n_layer=19), "every=4", dict(dtype="bf16")),          # a tail shorter than the period
    ("gpt-tiny", dict(n_layer=7), "full", dict(loop="adamw,holds-output")),
    ("gpt-tiny", dict(n_layer=7), "none", dict(loop="sgd")),
    ("gpt-tiny", dict(n_layer=7), "full", dict(CUDA, loop="none")),
    ("gpt-tiny", dict(n_layer=7), "none", dict(loop="adamw,zero-grad=zeros,clip=1.0")),
    ("hf-llama-tiny", dict(num_hidden_layers=7), "none", dict(CUDA, dtype="bf16-weights")),
    ("hf-llama-tiny", dict(num_hidden_layers=7), "full", {}),
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=7), "selective", dict(CUDA, dtype="bf16-weights")),
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=7), "none", {}),
])
def test_composed_prediction_is_the_full_one(spec, overrides, policy, options):
    fast, full = both_ways(get_workload(spec, **overrides), policy, **options)
    assert fast.trace == "composed"
    assert_same(fast, full)


@pytest.mark.parametrize("spec, overrides, policy, options", [
    ("gpt-tiny", dict(n_layer=8), "none", dict(loop="adamw,accum=2")),
    ("gpt-tiny", dict(n_layer=8), "full", dict(CUDA, loop="adamw,accum=3")),
    ("gpt-tiny", dict(n_layer=8), "selective", dict(CUDA, dtype="bf16", loop="adamw,accum=5")),
    ("gpt-tiny", dict(n_layer=8), "full+offload", dict(CUDA, loop="adamw,accum=4")),
    ("gpt-tiny", dict(n_layer=12), "every=2", dict(dtype="fp16", loop="adamw,accum=4,scaler")),
    ("gpt-tiny", dict(n_layer=8), "full", dict(loop="sgd,accum=4,zero-grad=zeros,holds-output")),
    ("gpt-tiny", dict(n_layer=11), "plan=kfffkkkkkkf", dict(CUDA, loop="adamw,accum=2,clip=1.0")),
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=8), "none", dict(CUDA, dtype="bf16-weights", loop="adamw,accum=6")),
    ("hf:t5", dict(num_layers=7, num_decoder_layers=7, d_model=32, d_ff=64, num_heads=2, d_kv=16), "none",
     dict(loop="adamw,accum=2")),   # two stacks, the decoder's blocks reading the encoder's output in each pass
])
def test_an_accumulation_step_composed_is_the_full_one(spec, overrides, policy, options):
    """A step of several accumulation passes is composed pass by pass (a cut block's units in
    each pass are its template's in that pass); above three passes, three are traced and composed,
    and the rest copied (`micro_steps`). The full trace runs every pass on every block."""
    fast, full = both_ways(get_workload(spec, **overrides), policy, **options)
    accum = int(options["loop"].split("accum=")[1].split(",")[0])
    assert fast.trace == "composed" + (f" (3 of its {accum} passes traced, the rest copies of the last: "
                                       "`micro_steps`)" if accum > 3 else "")
    assert fast.recompute_count == full.recompute_count
    assert_same(fast, full)


def test_offloaded_copies_of_sizes_that_are_not_powers_of_two():
    """The host caching allocator rounds each pinned copy up to a power of two: at batch 3 the
    blocks' saved tensors are 3 x 16 x 128 x 4 B = 24,576 B each, held in 32,768 B blocks. The
    composed step counts its copies by the same rounding as the full trace."""
    fast, full = both_ways(get_workload("gpt-tiny", n_layer=7), "full+offload", batch=3, **CUDA)
    assert fast.trace == "composed" and fast.host_bytes % 32_768 == 0
    assert_same(fast, full)


def test_encoder_decoder_composes_each_stack():
    workload = get_workload("hf:t5", num_layers=7, num_decoder_layers=7)
    fast, full = both_ways(workload, "full", seq=8)
    assert fast.trace == "composed"
    assert_same(fast, full)


# ----------------------------------------------------------------------------- models of our own

class Block(nn.Module):
    """A residual MLP block; `wide` ones have a wider hidden layer, `reads` the first block's
    output too, `shared` a weight that every block shares, `dropout` a dropout's rate."""

    def __init__(self, width: int, hidden: int, shared: nn.Linear | None = None, dropout: float | None = None):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.shared = shared
        self.drop = nn.Identity() if dropout is None else nn.Dropout(dropout)

    def forward(self, h, first=None, before=None):
        x = h if first is None else h + first
        x = x if before is None else x * before
        if self.shared is not None:
            x = self.shared(x)
        return h + self.drop(self.down(F.gelu(self.up(x))))


class Net(nn.Module):
    def __init__(self, kind: str, depth: int = 9, width: int = 16):
        super().__init__()
        self.kind = kind
        shared = nn.Linear(width, width) if kind == "shared" else None
        hidden = [(2 if kind == "alternating" and j % 2 else 4) * width for j in range(depth)]
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, hidden[j], shared, (0.5 if j == 5 else 0.0) if kind == "one-drops" else None)
                                    for j in range(depth))
        self.head = nn.Linear(width, 3)
        self.features = []
        if kind == "one-hooked":   # a feature taken from one block
            self.blocks[5].register_forward_hook(lambda module, args, out: self.features.append(out * 2))

    def forward(self, x):
        h = self.embed(x)
        first = before = None
        outs = []
        if self.kind == "counts":   # a buffer with a row per block
            rows = h.new_zeros(len(self.blocks), *h.shape)
        if self.kind == "slices":   # a skip around the blocks after the fifth (a U-Net's)
            for block in self.blocks[:5]:
                h = block(h)
            skip = h * 2   # held outside the blocks until the end
            for block in self.blocks[5:]:
                h = block(h)
            return self.head((h + skip).mean(dim=1))
        blocks = {"sliced-whole": lambda: self.blocks[:], "children": self.blocks.children}.get(self.kind, lambda: self.blocks)
        for j, block in enumerate(blocks()):
            if self.kind == "reads-first":
                out = block(h, first=first)
                first = out if first is None else first
            elif self.kind == "reads-before":
                out = block(h, before=before)
                before = h
            else:
                out = block(h)
            if self.kind == "counts":
                rows[j] = out
            h = out
            if self.kind == "stacks-outputs":
                outs.append(h)
        self.features.clear()
        if self.kind == "stacks-outputs":   # a mix of every block's output
            h = torch.stack(outs).mean(dim=0)
        if self.kind == "counts":
            h = rows.mean(dim=0)
        return self.head(h.mean(dim=1))


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def workload(kind: str, depth: int = 7):
    return ckptlab.Workload.custom(
        f"net-{kind}", build_model=lambda: Net(kind, depth),
        make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)),
        loss=loss)


@pytest.mark.parametrize("kind", ["alternating", "shared", "reads-first", "reads-before", "sliced-whole"])
@pytest.mark.parametrize("policy, options", [("none", {}), ("full", CUDA)])
def test_blocks_that_differ_compose_or_fall_back_exactly(kind, policy, options):
    fast, full = both_ways(workload(kind, depth=11 if kind == "alternating" else 7), policy, **options)
    assert_same(fast, full)
    assert fast.trace == "composed"


@pytest.mark.parametrize("kind, heads", [("plain", [2]), ("reads-first", [2, 3])])
def test_a_step_that_a_head_of_two_periods_does_not_compose_is_composed_with_three(kind, heads, monkeypatch):
    """The first block's output, which every block reads, is the second block's input too: the
    short head's template (block 2) refers to it unlike the cut blocks do, which the tail's check
    sees; the long head's template (block 3) is a block like the cut ones. A refusal is kept: a
    later prediction goes to the long head at once."""
    tried = []
    real = compose._composed_step
    monkeypatch.setattr(compose, "_composed_step", lambda *args: tried.append(args[-1].head_periods) or real(*args))
    net = workload(kind, depth=8)
    fast, full = both_ways(net, "none")
    assert_same(fast, full)
    assert fast.trace == "composed" and tried == heads
    tried.clear()
    fast, full = both_ways(net, "none", seq=24)
    assert_same(fast, full)
    assert tried == heads


@pytest.mark.parametrize("kind, why", [
    ("one-drops", "no stack has repeated middle blocks to compose"),      # alike but for a dropout's rate
    ("one-hooked", "no stack has repeated middle blocks to compose"),     # alike but for a hook
    ("stacks-outputs", "an op outside the blocks reads the tensors of blocks 1, 2, 3, 9"),
    ("counts", "the model counts its blocks (len of its ModuleList), so they cannot be cut"),
    ("slices", "the model takes a part of its blocks (ModuleList[:5]), so they cannot be cut"),
    ("children", "block 4 ran out of its stack's order (the model runs its blocks otherwise than in order through "
                 "their container: its children(), a list of its own)"),
])
@pytest.mark.parametrize("policy, options", [("none", {}), ("full", CUDA)])
def test_blocks_alike_but_for_a_setting_or_seen_together_outside_are_traced_in_full(kind, why, policy, options):
    fast, full = both_ways(workload(kind, depth=11), policy, **options)
    assert_same(fast, full)
    assert fast.trace == f"full ({why})"


class Width(enum.Enum):
    NARROW = "narrow"
    WIDE = "wide"


def _swish(x):
    return x * torch.sigmoid(x)


class SetBlock(nn.Module):
    """A block whose work follows its settings: `heads` (scores of heads x s x s), `act` (a
    function kept as an attribute) and `width` (an enum: WIDE doubles its input first). Every
    block has the same parameters; `layer_idx` numbers it, as transformers' blocks are numbered."""

    def __init__(self, layer_idx: int, heads: int = 1, act=F.gelu, width: Width = Width.NARROW):
        super().__init__()
        self.layer_idx, self.heads, self.act, self.width = layer_idx, heads, act, width
        self.name = f"blocks.{layer_idx}"
        self.lin = nn.Linear(16, 16)

    def forward(self, h):
        b, s, _ = h.shape
        x = torch.cat([h, h], dim=-1)[..., :16] if self.width is Width.WIDE else h
        q = x.view(b, s, self.heads, -1).transpose(1, 2)
        mixed = (q @ q.transpose(-1, -2)).softmax(-1) @ q
        return h + self.lin(self.act(mixed.transpose(1, 2).reshape(b, s, 16)))


def settings_workload(differ: str, blocks=range(4, 8), depth: int = 12):
    """`depth` SetBlocks, those of `blocks` with another `differ` setting."""
    other = {"heads": dict(heads=4), "act": dict(act=_swish), "width": dict(width=Width.WIDE), "none": {}}[differ]

    def build():
        net = Net("plain", depth=1)
        net.blocks = nn.ModuleList(SetBlock(j, **(other if j in blocks else {})) for j in range(depth))
        return net

    return ckptlab.Workload.custom(
        f"settings-{differ}", build_model=build, loss=loss,
        make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)))


@pytest.mark.parametrize("differ", ["heads", "act", "width"])
@pytest.mark.parametrize("policy, options", [("none", {}), ("full", CUDA)])
def test_blocks_that_differ_in_a_number_a_function_or_an_enum_are_not_taken_for_each_other(differ, policy, options):
    """Blocks 4-7 of 12 differ from the others only in a setting: they are cut blocks, whose
    units a template of another setting would stand for unseen by the tail's check."""
    fast, full = both_ways(settings_workload(differ), policy, **options)
    assert_same(fast, full)
    assert fast.trace == "full (no stack has repeated middle blocks to compose)"
    fast, full = both_ways(settings_workload(differ, blocks=range(1, 12, 2)), policy, **options)   # every other one
    assert_same(fast, full)
    assert fast.trace == "composed"


def test_the_numbers_and_names_of_blocks_do_not_make_them_differ():
    fast, full = both_ways(settings_workload("none"), "none")
    assert_same(fast, full)
    assert fast.trace == "composed"


def test_a_plan_whose_kinds_change_composes_blocks_that_read_an_earlier_blocks_tensor():
    """The first kept block after the selective ones has as many events as the selective one
    before it, a recompute's mark among them: its fixed references are found by event, not by
    position alone."""
    fast, full = both_ways(workload("reads-before", depth=13), "plan=kssskkkkkkkff", batch=1)
    assert_same(fast, full)
    assert fast.trace == "composed"


def test_a_block_after_a_cut_run_that_reads_a_block_before_the_cut_is_traced_in_full():
    fast, full = both_ways(workload("reads-first", depth=13), "plan=kkkkkkkkkfkff", batch=1)
    assert_same(fast, full)
    assert fast.trace == "full (block 9 refers to block 0 across the cut of a run)"


def test_a_short_stack_is_traced_in_full_and_says_why():
    fast, full = both_ways(workload("plain", depth=4), "none")
    assert_same(fast, full)
    assert fast.trace == "full (no stack is long enough to compose: one of 4 blocks whose middle repeats every block " \
                         "needs 6 or more)"
    fast, full = both_ways(workload("alternating", depth=8), "none")
    assert_same(fast, full)
    assert fast.trace == "full (no stack is long enough to compose: one of 8 blocks whose middle repeats every 2 " \
                         "blocks needs 9 or more)"
    assert both_ways(workload("alternating", depth=9), "none")[0].trace == "composed"
    assert both_ways(workload("plain", depth=6), "none")[0].trace == "composed"


def test_a_model_whose_blocks_cannot_be_cut_is_built_once(monkeypatch):
    spec = get_workload("gpt-tiny", n_layer=3)
    built = []
    monkeypatch.setattr(type(spec), "new_model", lambda self, made=type(spec).new_model: built.append(1) or made(self))
    fake_step.clear_prepared()
    for b in (1, 2):
        assert predict_policy(spec, b, 16, as_policy("none")).trace.startswith("full (no stack")
        assert predict_policy(spec, b, 16, as_policy("none"), trace="full").trace == "full"
    assert len(built) == 1


def test_the_policies_of_one_model_step_copies_of_one_build(monkeypatch):
    spec = get_workload("hf-llama-tiny+lora=4", num_hidden_layers=7)
    built = []
    monkeypatch.setattr(type(spec), "new_model", lambda self, made=type(spec).new_model: built.append(1) or made(self))
    fake_step.clear_prepared()
    copies = [predict_policy(spec, 2, 16, as_policy(policy), trace=trace)
              for policy in ("none", "full", "selective") for trace in ("fast", "full")]
    assert len(built) == 1 and [p.trace for p in copies[::2]] == ["composed"] * 3
    fake_step.clear_prepared()
    for policy, (fast, full) in zip(("none", "full", "selective"), zip(copies[::2], copies[1::2])):
        assert_same(fast, full)
        assert_same_fields(fast, predict_policy(spec, 2, 16, as_policy(policy)))   # built for it alone
        fake_step.clear_prepared()


@pytest.mark.parametrize("trace, options, taking", [
    ("full", {}, True),
    ("fast", dict(CUDA, dtype="bf16-weights"), True),
    ("full", dict(CUDA, loop="adamw-fused,zero-grad=zeros"), True),
    ("full", dict(loop="sgd"), True),
    ("full", dict(CUDA, dtype="bf16", loop="adamw,holds-output,clip=1.0"), True),
    ("full", dict(CUDA, loop="none"), True),
    ("full", dict(CUDA, dtype="fp16", loop="adamw,scaler"), False),   # a scaler's state is its own: each steps
])
def test_a_step_that_takes_another_policys_warm_state_predicts_what_a_warmed_up_one_does(trace, options, taking,
                                                                                         monkeypatch):
    """The steps of a model's other policies (same dtype, loop, device and path) take the first
    one's warm state (`fake_step.WarmState`: optimizer state, kept gradients) instead of stepping
    the optimizer in their warm-up; each predicts what a step warmed up alone does, to the byte
    (LoRA: only the adapters train)."""
    took = []
    warm_up = fake_step.warm_up
    monkeypatch.setattr(fake_step, "warm_up", lambda *args: took.append(warm_up(*args)) or took[-1])
    workload = get_workload("hf-llama-tiny+lora=4", num_hidden_layers=7 if trace == "fast" else 3)
    policies = ("none", "full", "selective")
    fake_step.clear_prepared()
    taken = [predict_policy(workload, 2, 16, as_policy(p), trace=trace, **options) for p in policies]
    assert took == [False, taking, taking] and taken[0].trace.startswith(("composed", "full"))
    for policy, prediction in zip(policies[1:], taken[1:]):
        fake_step.clear_prepared()
        alone = predict_policy(workload, 2, 16, as_policy(policy), trace=trace, **options)
        assert alone.trace == prediction.trace
        assert_same_fields(prediction, alone)


class ManyLayouts(nn.Module):
    """Parameters of several layouts, repeated: one transposed (same shape as another, other
    strides), one that trains in fp32 among bf16 ones, and one that gets no gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.ParameterList(nn.Parameter(torch.zeros(4, 6)) for _ in range(3))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(6, 4).t()) for _ in range(2))
        self.c = nn.ParameterList(nn.Parameter(torch.zeros(5, dtype=torch.bfloat16)) for _ in range(3))
        self.d = nn.Parameter(torch.zeros(5))
        self.frozen = nn.Parameter(torch.zeros(7))


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, foreach=False),
    lambda params: torch.optim.AdamW(params, foreach=True),
    lambda params: torch.optim.AdamW(params, fused=True),
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.SGD(params, lr=0.1),   # no momentum: no state
    lambda params: torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}]),
])
def test_a_warm_up_steps_one_parameter_per_layout_and_leaves_the_state_a_whole_step_does(make, monkeypatch):
    """`fake_step.step_by_representatives` steps the optimizer on one parameter per param group
    and layout, and leaves the state that stepping every parameter leaves: each tensor's layout
    and known value (the step count), in the same order."""
    mode = new_fake_mode()
    with mode:
        models = [ManyLayouts() for _ in range(2)]
        for model in models:
            for p in model.parameters():
                if p is not model.frozen:
                    p.grad = torch.zeros_like(p)
    whole, shared = (make(list(model.parameters())) for model in models)
    with mode:
        whole.step()
    stepped = []   # how many parameters each step of `shared` held
    step = type(shared).step
    monkeypatch.setattr(type(shared), "step", lambda self, *a: stepped.append(
        sum(len(g["params"]) for g in self.param_groups)) or step(self, *a))
    with mode:
        fake_step.step_by_representatives(shared)
    assert stepped == [4] or stepped == [5]   # a, b, c, d; in two groups a and b in each
    warm = [fake_step.WarmState.of(list(model.parameters()), opt) for model, opt in zip(models, (whole, shared))]
    assert warm[0] is not None and warm[0] == warm[1]
    places = [{id(p): i for i, p in enumerate(model.parameters())} for model in models]
    assert [places[1][id(p)] for p in shared.state] == [places[0][id(p)] for p in whole.state]   # in order


class TableBlock(nn.Module):
    """A block that keeps a table on itself: in a dict by sequence length, or made the first time
    it runs inside a checkpoint (saved-tensor hooks set), so only under a checkpointing policy."""

    def __init__(self, width: int, keeps: str):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.keeps, self.tables, self.table = keeps, {}, None

    def forward(self, h):
        if self.keeps == "dict" and h.shape[1] not in self.tables:
            self.tables[h.shape[1]] = torch.ones(h.shape[1], h.shape[2])
        checkpointed = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        if self.keeps == "checkpointed" and self.table is None and checkpointed:
            self.table = torch.ones(64, *h.shape[1:])
        return h + self.down(F.gelu(self.up(h + self.tables.get(h.shape[1], 0))))


class TableNet(nn.Module):
    def __init__(self, keeps: str, width: int = 16):
        super().__init__()
        self.embed, self.head = nn.Linear(8, width), nn.Linear(width, 3)
        self.blocks = nn.ModuleList(TableBlock(width, keeps) for _ in range(3))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).mean(1)


@pytest.mark.parametrize("keeps", ["dict", "checkpointed"])
def test_a_step_that_takes_a_warm_state_still_runs_its_forward(keeps):
    """What a model keeps on its modules can depend on the policy, or sit where `state_made` does
    not look: a step that takes another's warm state runs its own warm-up forward, and predicts
    what a step warmed up alone does (which `measure` measures)."""
    net = ckptlab.Workload.custom(
        f"tables-{keeps}", build_model=lambda: TableNet(keeps),
        make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)),
        loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))
    fake_step.clear_prepared()
    predict_policy(net, 2, 16, as_policy("none"), trace="full")
    taken = predict_policy(net, 2, 16, as_policy("full"), trace="full")
    fake_step.clear_prepared()
    alone = predict_policy(net, 2, 16, as_policy("full"), trace="full")
    assert_same_fields(taken, alone)
    assert alone.peak_bytes == ckptlab.measure(net, 2, 16, "full", steps=1, warmup=1, max_seconds=0.1)["peak_bytes"]


class ExtraBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.extra = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h, uses_extra: bool = False):
        return h + F.gelu(self.up(self.extra(h) if uses_extra else h))


class PositionalNet(nn.Module):
    """Blocks alike, but the model passes a per-layer flag zipped with its blocks, so that block 6
    alone uses its `extra` layer: the fast path's known blind spot (`compose`), whose cut blocks
    train as their template. (`len(self.blocks)` would make the fast path refuse the model.)"""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed, self.head = nn.Linear(8, width), nn.Linear(width, 3)
        self.blocks = nn.ModuleList(ExtraBlock(width) for _ in range(12))

    def forward(self, x):
        h = self.embed(x)
        for block, uses_extra in zip(self.blocks, [j == 6 for j in range(12)]):
            h = block(h, uses_extra)
        return self.head(h).mean(1)


def test_the_full_trace_never_takes_a_cut_steps_warm_state():
    """A cut step's warm state is what its cut trains (the cut blocks as their template): the
    full trace, the reference, warms up from its own or another full step's, never from that."""
    net = ckptlab.Workload.custom(
        "positional", build_model=PositionalNet, loss=loss,
        make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)))
    fake_step.clear_prepared()
    assert predict_policy(net, 2, 16, as_policy("none"), trace="fast").trace == "composed"
    after_fast = predict_policy(net, 2, 16, as_policy("full"), trace="full")
    fake_step.clear_prepared()
    assert_same_fields(after_fast, predict_policy(net, 2, 16, as_policy("full"), trace="full"))


def test_what_cannot_be_composed_is_traced_in_full():
    fast, full = both_ways(workload("plain"), "segments=2")
    assert_same(fast, full)
    assert fast.trace == "full (checkpoint regions span several blocks)"


@pytest.mark.parametrize("spec, overrides, policy, options", [
    ("gpt-tiny", dict(n_layer=2), "none", dict(loop="adamw,accum=5")),
    ("gpt-tiny", dict(n_layer=2), "full", dict(CUDA, loop="adamw,accum=4")),
    ("gpt-tiny", dict(n_layer=3), "selective", dict(dtype="bf16", loop="adamw,accum=6,holds-output")),
    ("gpt-tiny", dict(n_layer=2), "full", dict(CUDA, loop="sgd,accum=4,zero-grad=zeros")),
    ("gpt-tiny", dict(n_layer=2), "every=2", dict(dtype="fp16", loop="adamw,accum=4,scaler")),
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=2), "full", dict(CUDA, dtype="bf16-weights", loop="adamw,accum=4")),
])
def test_a_step_of_many_accumulation_passes_from_three_traced_is_the_step_traced_with_all(spec, overrides, policy,
                                                                                         options):
    work = get_workload(spec, **overrides)
    fast = predict_policy(work, 2, 16, as_policy(policy), trace="fast", **options)
    full = predict_policy(work, 2, 16, as_policy(policy), trace="full", **options)
    assert fast.trace.endswith("passes traced, the rest copies of the last (`micro_steps`))")
    assert fast.recompute_count == full.recompute_count
    assert_same(fast, full)


class AlternatingNet(Net):
    """A model whose every other forward makes one more temporary: its passes alternate."""

    def __init__(self, kind: str, depth: int):
        super().__init__(kind, depth)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x if self.calls % 2 else x + torch.zeros_like(x))


def test_passes_that_differ_trace_every_pass_and_a_cpu_step_of_many_is_measured_as_predicted():
    """A model whose passes alternate cannot have its passes copied: composed, the extension is
    refused, and the full trace runs every pass (its own extension refused too)."""
    alternating = ckptlab.Workload.custom(
        "net-alternating", build_model=lambda: AlternatingNet("plain", 8), loss=loss,
        make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)))
    fast = predict_policy(alternating, 2, 16, as_policy("full"), loop="adamw,accum=5")
    fake_step.clear_prepared()   # a prepared step's model has counted its calls: each trace from a fresh one
    full = predict_policy(alternating, 2, 16, as_policy("full"), loop="adamw,accum=5", trace="full")
    assert fast.trace == "full (accum=5: the third pass runs other events than the second)"
    assert_same(fast, full)
    plain = workload("plain", depth=8)
    fast = predict_policy(plain, 2, 16, as_policy("full"), loop="adamw,accum=7")
    assert fast.trace.startswith("composed (3 of its 7 passes traced")
    assert fast.peak_bytes == ckptlab.measure(plain, 2, 16, "full", loop="adamw,accum=7", steps=1, warmup=0,
                                              max_seconds=0.1)["peak_bytes"]


def test_predict_on_the_command_line_says_why_a_row_was_traced_in_full(capsys):
    small = ["predict", "--model", "gpt-tiny", "--set", "n_embd=32", "--set", "n_head=2", "--batch", "2", "--seq", "16"]
    assert main([*small, "--set", "n_layer=8", "--policy", "none,segments=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "traced in full, not composed (segments=2 b=2 s=16): checkpoint regions span several blocks"
    assert lines[-2].split()[0] == "segments=2"   # the table's last row, then the one note
    assert main([*small, "--set", "n_layer=4", "--policy", "none,full"]) == 0   # every row: no rows named
    assert capsys.readouterr().out.splitlines()[-1] == ("traced in full, not composed: no stack is long enough to "
                                                        "compose: one of 4 blocks whose middle repeats every block "
                                                        "needs 6 or more")
    assert main([*small, "--set", "n_layer=4", "--policy", "none", "--trace", "full"]) == 0   # asked for: no note
    assert capsys.readouterr().out.splitlines()[-1].split()[0] == "none"


def test_broken_composition_is_caught(monkeypatch):
    """The equality test fails when a repeated unit goes missing: dropping one cut block's
    backward changes the prediction (or the composition refuses it)."""
    insert = compose._Units._split

    def drop_one(self):
        insert(self)
        for at, blocks in self.backward_inserts.items():
            self.backward_inserts[at] = blocks[1:]

    monkeypatch.setattr(compose._Units, "_split", drop_one)
    fast, full = both_ways(workload("plain"), "none")
    assert fast.trace != "composed" or fast.peak_bytes != full.peak_bytes or \
        fast.peak_by_category != full.peak_by_category


def test_the_equality_test_fails_on_a_wrong_composition(monkeypatch):
    """Composition broken on purpose past its own checks: cut blocks copied from the head's second
    period, whose units still differ from the later blocks' (block 0's output stays alive there),
    and the check against the tail turned off. The prediction is then wrong, and assert_same says so."""
    def second_period(self, block):
        start = self.first + 1 + self.period
        return start + (block - start) % self.period

    monkeypatch.setattr(compose._Stack, "template", second_period)
    monkeypatch.setattr(compose._Units, "_check_alike", lambda self: None)
    fast, full = both_ways(workload("reads-first"), "none")
    assert fast.trace == "composed"
    with pytest.raises(AssertionError, match="peak_bytes"):
        assert_same(fast, full)


def test_measure_equals_the_fast_prediction_on_cpu():
    net = workload("alternating", depth=11)
    fast = predict_policy(net, 2, 32, as_policy("full"))
    measured = ckptlab.measure(net, 2, 32, "full", steps=1, warmup=0, max_seconds=0.1)
    assert fast.trace == "composed"
    assert fast.peak_bytes == measured["peak_bytes"]
    assert fast.saved_activation_bytes == measured["saved_activation_bytes"]


@pytest.mark.parametrize("trace", ["fast", "full"])
def test_no_cycle_collection_runs_inside_a_prediction_and_the_collector_is_left_as_found(trace):
    import gc
    import sys
    inside = []   # collections that started while a prediction was on the stack

    def count(phase, info):
        frame = sys._getframe()
        while frame is not None and phase == "start":
            if frame.f_code.co_name == "predict_policy":
                inside.append(info["generation"])
                return
            frame = frame.f_back

    net = get_workload("gpt-tiny", n_layer=7)
    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(1)   # without the pause, a collection would start every few allocations
    try:
        predict_policy(net, 2, 16, as_policy("full"), trace=trace, **CUDA)
        assert gc.isenabled()
        gc.disable()
        predict_policy(net, 2, 24, as_policy("full"), trace=trace, **CUDA)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    assert inside == []


def test_a_step_traced_before_at_that_shape_and_on_those_kernels_is_taken_not_traced_again(monkeypatch):
    net = get_workload("gpt-tiny", n_layer=7)
    shapes = []
    stepped = compose.stepped
    monkeypatch.setattr(compose, "stepped", lambda prepared, b, s, *a, **k: (shapes.append((b, s)), stepped(
        prepared, b, s, *a, **k))[1])
    first = predict_policy(net, 2, 16, as_policy("full"), **CUDA)
    again = predict_policy(net, 2, 16, as_policy("full"), **CUDA)
    assert_same_fields(first, again)
    assert again.trace == "composed"
    predict_policy(net, 2, 16, as_policy("full"), device="cuda", card="h100-80")   # its kernels alike: taken
    predict_policy(net, 2, 16, as_policy("full"), **CUDA, attention="math")        # other kernels: traced
    predict_policy(net, 2, 24, as_policy("full"), **CUDA)                          # another shape: traced
    assert shapes == [(2, 16), (2, 16), (2, 24)]
    # the planner's profile of a uniform option and its prediction of that plan share one trace
    profile = block_profile.block_memory(net, 2, 32, "keep", **CUDA)
    keep = compose.fast_memory(net, 2, 32, plan_policy(["keep"] * 7), **CUDA)
    assert shapes[3:] == [(2, 32)]
    assert len(profile.kept) == 7 and keep.trace == "composed"


def test_trace_is_checked():
    with pytest.raises(ValueError, match="trace='quick' is invalid"):
        predict_policy("gpt-tiny", 1, 8, as_policy("none"), trace="quick")


# The full trace steps the same `PreparedStep.at` as the fast path: it is checked on the loops and
# devices whose reuse differs most (a held output, offload's host copies, LoRA in bf16 on CUDA).
@pytest.mark.parametrize("trace, spec, overrides, policy, options", [
    (trace, *case) for case, traces in [
        (("gpt-tiny", dict(n_layer=7), "none", {}), ["fast"]),
        (("gpt-tiny", dict(n_layer=7), "full", dict(CUDA, loop="adamw,holds-output")), ["fast", "full"]),
        (("gpt-tiny", dict(n_layer=7), "selective", dict(CUDA, dtype="bf16", loop="adamw,zero-grad=zeros,clip=1.0")),
         ["fast"]),
        (("gpt-tiny", dict(n_layer=7), "full+offload", CUDA), ["fast", "full"]),
        (("gpt-tiny", dict(n_layer=7), "every=2", dict(dtype="fp16", loop="adamw-foreach,scaler,holds-output")),
         ["fast"]),
        (("hf-llama-tiny+lora=4", dict(num_hidden_layers=7), "none", dict(CUDA, dtype="bf16-weights")), ["fast", "full"]),
    ] for trace in traces])
def test_a_reused_step_predicts_what_a_fresh_one_does(trace, spec, overrides, policy, options, monkeypatch):
    """Predictions of one model at several shapes and, on CUDA, for several cards and torch
    versions, in turn, step one prepared model (the composed ones take the first step's optimizer
    phase); each equals the prediction of a model prepared for it alone."""
    spliced = []
    splice = compose._OptimizerPhase.spliced_into
    monkeypatch.setattr(compose._OptimizerPhase, "spliced_into",
                        lambda self, *args: spliced.append(splice(self, *args)) or spliced[-1])
    workload = get_workload(spec, **overrides)
    cases = [dict(batch_size=2, seq_len=16), dict(batch_size=1, seq_len=24), dict(batch_size=3, seq_len=8),
             dict(batch_size=2, seq_len=16)]
    if options.get("device") == "cuda":
        cases[1]["card"], cases[3]["torch_version"] = "h100-80", "2.4"
    fake_step.clear_prepared()
    reused = [predict_policy(workload, policy=as_policy(policy), trace=trace, **{**options, **case}) for case in cases]
    assert len(fake_step._PREPARED) == (1 if reused[0].trace in ("composed", "full") else 2)   # a fallback: both
    if reused[0].trace == "composed":   # the first step per card and torch traces its optimizer phase, the others
        # take it; a case seen before (on the CPU, the last) is the step traced then (`compose.TRACED_KEPT`)
        kernels = {(case.get("card"), case.get("torch_version")) for case in cases}
        stepped = [case for k, case in enumerate(cases) if case not in cases[:k]]
        assert sum(s is not None for s in spliced) == len(stepped) - len(kernels) > 0
    fresh = [reused[0]]   # the first prediction prepared its model for itself: nothing was kept
    for k, case in enumerate(cases[1:], 1):
        if case in cases[:k]:
            fresh.append(fresh[cases.index(case)])
        else:
            fake_step.clear_prepared()
            fresh.append(predict_policy(workload, policy=as_policy(policy), trace=trace, **{**options, **case}))
    for prediction, alone in zip(reused, fresh):
        assert alone.trace == prediction.trace and "failed" not in prediction.trace
        assert_same_fields(prediction, alone)


class CachingBlock(Block):
    """A block that makes a table for the sequence length on its first call and keeps it: as an
    attribute, made again for a longer sequence (as rotary embeddings' caches do), or in a dict
    by sequence length."""

    def __init__(self, width: int, keep: str):
        super().__init__(width, 4 * width)
        self.keep, self.table, self.tables = keep, None, {}

    def forward(self, h):
        s = h.shape[1]
        if self.keep == "dict":
            if s not in self.tables:
                self.tables[s] = torch.ones(s, h.shape[2], dtype=h.dtype, device=h.device)
            return super().forward(h + self.tables[s])
        if self.table is None or self.table.shape[0] < s:
            self.table = torch.ones(2 * s, h.shape[2], dtype=h.dtype, device=h.device)
        return super().forward(h + self.table[:s])


@pytest.mark.parametrize("keep", ["attribute", "dict"])
@pytest.mark.parametrize("trace", ["fast", "full"])
def test_a_model_that_keeps_a_table_of_its_shape_is_prepared_again_for_another_shape(trace, keep, monkeypatch):
    """...and on the fast path, whose cut refuses such a model after its warm-up, the refusal is
    kept for every shape: only the full trace's step is warmed up again."""
    warmed = []
    warm_up = fake_step.warm_up
    monkeypatch.setattr(fake_step, "warm_up", lambda *args: warmed.append(1) or warm_up(*args))

    def build():
        model = Net("plain", depth=9)
        model.blocks = nn.ModuleList(CachingBlock(16, keep) for _ in range(9))
        return model

    caching = ckptlab.Workload.custom("net-caching", build_model=build, loss=loss, make_batch=lambda b, s, gen: (
        torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)))
    fake_step.clear_prepared()
    alone = predict_policy(caching, 2, 32, as_policy("none"), trace=trace)
    fake_step.clear_prepared()
    predict_policy(caching, 2, 16, as_policy("none"), trace=trace)
    before = len(warmed)
    after_another_shape = predict_policy(caching, 2, 32, as_policy("none"), trace=trace)
    assert len(warmed) == before + 1
    assert_same_fields(after_another_shape, alone)
    assert alone.trace == ("full (the model's forward leaves tensors on its modules (a cache made on its first call), "
                           "which the cut blocks never make)" if trace == "fast" else "full")
    measured = ckptlab.measure(caching, 2, 32, "none", steps=1, warmup=0, max_seconds=0.1)
    assert alone.peak_bytes == measured["peak_bytes"]
    assert alone.peak_by_category["buffers"] == measured["peak_buffers_bytes"] == 9 * 32 * 16 * 4 * (
        2 if keep == "attribute" else 1)


@pytest.mark.parametrize("spec, overrides, dtype, options, block_options", [
    ("gpt-tiny", dict(n_layer=7), "fp32", {}, ("keep", "selective", "full")),
    # the storages of a step on CUDA, its autocast's casts among them, come and go: a storage is
    # told from another that takes its place by its number in the events
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=7), "bf16-weights", dict(device="cuda", card="h100-80"),
     ("keep", "full")),
])
def test_the_planners_block_profile_from_a_composed_step_is_the_full_steps(spec, overrides, dtype, options,
                                                                          block_options, monkeypatch):
    from ckptlab.estimate import block_profile

    workload = get_workload(spec, **overrides)
    composed = {o: block_profile.block_memory(workload, 2, 16, o, dtype, **options) for o in block_options}

    def refuse(*args, **kwargs):
        raise compose.NotComposable("traced in full for the test")
    monkeypatch.setattr(block_profile, "composed_step", refuse)
    fake_step.clear_prepared()
    for option, memory in composed.items():
        assert memory == block_profile.block_memory(workload, 2, 16, option, dtype, **options), option
        middle = memory.kept[1:-1]
        assert len(set(middle)) == 1 and middle[0] > 0, memory   # alike blocks keep alike bytes


@pytest.mark.parametrize("spec, overrides, letter, uniform, options", [
    ("gpt-tiny", dict(n_layer=7), "s", "selective", {}),
    ("gpt-tiny", dict(n_layer=7), "f", "full+offload", CUDA),
    ("hf-llama-tiny+lora=4", dict(num_hidden_layers=7), "f", "full", dict(CUDA, dtype="bf16-weights")),
    ("hf:t5", dict(num_layers=7, num_decoder_layers=7), "k", "none+offload", {}),
])
def test_a_plan_of_one_option_steps_as_that_options_policy(spec, overrides, letter, uniform, options, monkeypatch):
    """A plan with one option on every block runs the step of that option's policy, event for
    event (the plan traced on its own, `step_policy` off); so a prediction of it takes that
    policy's prepared model and traced step, and a plan of the wrong length is still refused."""
    workload = get_workload(spec, **overrides)
    offload = "+offload" if "offload" in uniform else ""
    plan = as_policy(f"plan={letter * block_profile.block_count(workload)}{offload}")
    kernels = dict(card=fake_step.as_card(options["card"]), device="cuda") if "card" in options else {}
    dtype = options.get("dtype", "fp32")
    with monkeypatch.context() as patched:
        patched.setattr(fake_step, "step_policy", lambda policy: policy)
        fake_step.clear_prepared()
        alone = compose.composed_step(workload, 2, 16, plan, dtype, **kernels)[0].events
    fake_step.clear_prepared()
    prepared = []
    monkeypatch.setattr(fake_step.PreparedStep, "__init__", lambda self, *args, _init=fake_step.PreparedStep.__init__,
                        **kwargs: (prepared.append(args[1]), _init(self, *args, **kwargs))[1])
    assert compose.composed_step(workload, 2, 16, as_policy(uniform), dtype, **kernels)[0].events == alone
    shared = [predict_policy(workload, 2, 16, p, **options) for p in (as_policy(uniform), plan)]
    assert prepared == [as_policy(uniform)] and shared[1].trace == "composed"
    assert_same_fields(dataclasses.replace(shared[1], policy=shared[0].policy), shared[0])
    with pytest.raises(ValueError, match="plan=kk is invalid for a model with"):
        predict_policy(workload, 2, 16, as_policy(f"plan=kk{offload}"), **options)


class StatsNet(Net):
    """Each block's output statistic kept on the model, a new list each forward, by hooks that
    refer to the model itself (a lambda over `self`: a copy of the model keeps the lambda, whose
    `self` is the original)."""

    def __init__(self):
        super().__init__("plain", depth=9)
        self.stats = []
        for block in self.blocks:
            block.register_forward_hook(lambda module, args, out: self.stats.append(out.detach().pow(2).mean()))

    def forward(self, x):
        self.stats = []
        return super().forward(x)


class LastBlock(Block):
    """A block that keeps its last output's row sums, replaced at each call."""

    def __init__(self):
        super().__init__(16, 64)
        self.last = None

    def forward(self, h):
        out = super().forward(h)
        self.last = out.detach().sum(-1)
        return out


def _last_net():
    net = Net("plain", depth=9)
    net.blocks = nn.ModuleList(LastBlock() for _ in range(9))
    return net


@pytest.mark.parametrize("build", [StatsNet, _last_net])
@pytest.mark.parametrize("loop", ["adamw", "adamw,accum=2", "adamw,accum=3"])
def test_a_model_that_keeps_what_its_forward_made_is_predicted_as_measured(loop, build):
    """Predictions step a copy of the model built once, where they can: StatsNet's copies would
    append to the build's list, which no forward resets (32 B a pass here, and more each
    prediction), so it is built anew for each. What the warm-up's forward left on the model is
    freed where the step's forward replaces it, as in a real step."""
    stats = ckptlab.Workload.custom("net-stats", build_model=build, loss=loss, make_batch=lambda b, s, gen: (
        torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)))
    measured = ckptlab.measure(stats, 2, 16, "none", loop=loop, steps=1, warmup=1, max_seconds=0.1)
    for policy in ("none", "full"):   # two policies: two steps of the model in this process
        for trace in ("fast", "full"):
            predicted = predict_policy(stats, 2, 16, as_policy("none"), loop=loop, trace=trace)
            assert (predicted.peak_bytes, predicted.saved_activation_bytes) == (
                measured["peak_bytes"], measured["saved_activation_bytes"])
    assert fake_step.refers_to_itself(fake_step.model_as_built(stats)) == (build is StatsNet)
    assert not fake_step.refers_to_itself(fake_step.model_as_built(workload("plain")))



class ConcatNet(Net):
    """A head over every block's output side by side: sized by the number of blocks."""

    def __init__(self):
        super().__init__("plain", depth=9)
        self.head = nn.Linear(16 * 9, 3)

    def forward(self, x):
        h, outs = self.embed(x), []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        return self.head(torch.cat(outs, dim=-1).mean(dim=1))


def test_a_model_sized_by_its_blocks_is_traced_in_full_and_its_failing_shortened_step_logs_nothing(caplog):
    concat = ckptlab.Workload.custom("net-concat", build_model=ConcatNet, loss=loss, make_batch=lambda b, s, gen: (
        torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)))
    fast, full = both_ways(concat, "none")
    assert_same(fast, full)
    assert fast.trace.startswith("full (the shortened step failed with RuntimeError: ")
    assert fast.trace.endswith("(the model cannot run with blocks cut: its other layers may be sized by the number of "
                               "blocks))")
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
