"""The checkpoint-policy vocabulary: which of a model's N blocks recompute their activations.

Policies are strings, because notebook parameters and CLI flags are strings: none, full,
density=D, every=K, layers=0,3,5, segments=S, selective[=V], plan=kfsk, budget=B,
compile[:budget=B], P+offload, P+compile and transformers' own hf, hf:every_n_layers=K, hf:offload.
What each recomputes, and which framework knob it matches: docs/guide/policies.md (or `ckptlab --help`).
Each kind's names, parsing, canonical spelling and regions are one entry of `KINDS`. P+compile is
P, then `torch.compile`: the whole model as one graph, or for a plan block by block, where a
budget digit d gives that block activation_memory_budget=d/10 (plan=00kf+compile).

`parse_policy` only checks the syntax; anything that depends on N (layers out of range, more
segments than blocks) is checked by `Policy.regions(n_blocks)`, which `apply_checkpointing`
calls before touching the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from .parsing import split_list
from .units import format_bytes, size_bytes, size_label

SELECTIVE_VARIANTS = ("mm", "alt", "attn")
PLAN_LETTERS = {"k": "keep", "s": "selective", "f": "full"}
PLAN_OPTIONS = tuple(PLAN_LETTERS.values())   # a plan's per-block options, in order of memory kept

@dataclass(frozen=True)
class Policy:
    """A parsed policy. `value` is None for none/full, a float for density, an int for every,
    a tuple of ints for layers, an int or "sqrt" for segments, a variant name for selective, a
    string of k/s/f letters for plan, bytes (int) or a fraction (float) for budget, and the
    activation memory budget (float, None for the default) for compile. `offload` and
    `compiled` (P+compile) compose."""

    kind: str
    value: object = None
    offload: bool = False
    compiled: bool = False

    def __str__(self) -> str:
        text = KINDS[self.kind].spell(self.value)
        if self.offload:
            return "offload" if self.kind == "none" else text + "+offload"
        return text + "+compile" if self.compiled else text

    @property
    def mechanism(self) -> str:
        """Who applies the checkpointing (`MECHANISMS`): ckptlab's block wrappers, transformers' own
        mechanism, or the compiler alone (compile, compile:budget=B)."""
        return KINDS[self.kind].mechanism

    @property
    def predictable(self) -> bool:
        """Whether a fake step can predict it: not when torch.compile's partitioner decides."""
        return KINDS[self.kind].predictable and not self.compiled

    @property
    def compiles(self) -> bool:
        """Whether the model runs under torch.compile: compile, compile:budget=B or P+compile."""
        return self.kind == "compile" or self.compiled

    def compile_budgets(self, n_blocks: int) -> list[float] | None:
        """Per block, the activation_memory_budget its own compiled graph holds, for a compiled
        plan (compiled block by block); None when the model compiles as one graph."""
        if self.kind != "plan" or not self.compiled:
            return None
        self.regions(n_blocks)  # validates the length
        return [int(c) / 10 if c.isdigit() else 1.0 for c in self.value]

    @property
    def label(self) -> str:
        """The policy for a figure or a table: as `str`, but a budget in bytes reads as a rounded
        size (budget=42.7MiB); `str` stays exact, so that it parses back to the same policy."""
        if self.kind == "budget" and isinstance(self.value, int):
            text = f"budget={format_bytes(self.value, compact=True)}"
            return text + ("+offload" if self.offload else "+compile" if self.compiled else "")
        return str(self)

    def modes(self, n_blocks: int) -> list[str]:
        """Per block: one of `PLAN_OPTIONS` ("keep", "selective", "full"), what wrap applies to
        it; a selective block keeps what `selective_variant` names."""
        if self.kind == "plan":
            self.regions(n_blocks)  # validates the length
            return [PLAN_LETTERS.get(c, "keep") for c in self.value]  # a budget digit checkpoints nothing
        chosen = set(self.checkpointed_blocks(n_blocks))
        mode = "selective" if self.kind == "selective" else "full"
        return [mode if i in chosen else "keep" for i in range(n_blocks)]

    @property
    def selective_variant(self) -> str:
        """What a selective block keeps (`SELECTIVE_VARIANTS`): the policy's own variant, or mm
        (every matmul and attention output) for a plan's selective blocks."""
        return self.value if self.kind == "selective" else "mm"

    def regions(self, n_blocks: int) -> list[tuple[int, int]]:
        """Checkpoint regions as half-open block ranges [start, stop), in block order.

        A region of one block recomputes that block; a longer region (segments) recomputes the
        whole segment from its input. Raises ValueError if the policy cannot apply to n_blocks.
        """
        if n_blocks < 1:
            raise ValueError(f"n_blocks={n_blocks!r} is invalid: a model needs at least 1 block")
        return KINDS[self.kind].regions(self, n_blocks)

    def checkpointed_blocks(self, n_blocks: int) -> list[int]:
        """Indices of the blocks whose activations are recomputed."""
        return [i for start, stop in self.regions(n_blocks) for i in range(start, stop)]

    def checkpoints_like(self, other: "Policy", n_blocks: int) -> bool:
        """Whether `other` checkpoints a model of n_blocks blocks as this one does: the same
        mechanism, regions, mode per block, selective variant, offload and compile (full,
        density=1 and plan of all f are one policy). A policy that needs shapes (budget) is like
        none but itself."""
        def effect(policy: Policy):
            modes = policy.modes(n_blocks)
            variant = policy.selective_variant if "selective" in modes else None
            return policy.mechanism, policy.regions(n_blocks), modes, variant, policy.offload, policy.compiled
        try:
            return effect(self) == effect(other)
        except ValueError:
            return self == other

    def effective_density(self, n_blocks: int) -> float:
        """Fraction of the n_blocks blocks that recompute: the common axis for every policy."""
        return len(self.checkpointed_blocks(n_blocks)) / n_blocks


def plan_policy(options, offload: bool = False, compiled: bool = False) -> Policy:
    """The `plan=` policy of one option (keep | selective | full) per block."""
    letter = {option: k for k, option in PLAN_LETTERS.items()}
    return Policy("plan", "".join(letter[o] for o in options), offload=offload, compiled=compiled)


def step_policy(policy: Policy) -> Policy:
    """The policy whose training step `policy`'s is: a plan of one option on every block runs as
    that option's uniform policy (plan=kk..k as none, ss..s as selective, ff..f as full, offload
    alike): the same wrappers on the same blocks, the same step (tests/test_fast_path.py compares
    their events), so predictions share its prepared model. Any other policy is its own."""
    if policy.kind != "plan" or policy.compiled or len(set(policy.value)) != 1 or policy.value[0] not in PLAN_LETTERS:
        return policy
    option = PLAN_LETTERS[policy.value[0]]
    if option == "selective":   # a plan's selective blocks keep what bare `selective` keeps
        return Policy("selective", policy.selective_variant, offload=policy.offload)
    return Policy("none" if option == "keep" else "full", offload=policy.offload)


def policy_label(policy: str | Policy) -> str:
    """A policy as tables and figures name it (`Policy.label`: budget=42.7MiB); text that does
    not parse as a policy (an anchor's label) is shown as it is."""
    parsed = policy_of_label(policy)
    return str(policy) if parsed is None else parsed.label


def spread_evenly(k: int, n: int) -> list[int]:
    """k of n indices spread evenly: the midpoints of k equal slices of range(n).

    k=1 of 8 -> [4]; k=2 of 8 -> [2, 6]; k=4 of 8 -> [1, 3, 5, 7]; k=n -> all. Spreading keeps
    the recomputed blocks apart, so the backward pass never recomputes two neighbours at once.
    """
    if not 0 <= k <= n:
        raise ValueError(f"k={k!r} is invalid: allowed is 0..{n}")
    return [(2 * j + 1) * n // (2 * k) for j in range(k)]  # integer arithmetic: no float rounding


def parse_policy(text: str) -> Policy:
    """Parse a policy string such as `density=0.5` into its Policy: once, where text comes in
    (the command line, notebook parameters, a sweep's configuration, the public functions).

    Raises ValueError naming the parameter, the value and what is allowed.
    """
    if not isinstance(text, str):
        raise ValueError(f"policy={text!r} is invalid: expected a string, {POLICY_HELP}")
    return _parse(text)


def _parse(text: str, compiled: bool = False) -> Policy:
    if "+" in text:
        parts = [p.strip().lower() for p in text.split("+")]
        if "compile" in parts:
            return _parse_compiled(text, parts)
        if "offload" not in parts or parts.count("offload") > 1 or len(parts) > 2 or "" in parts:
            raise ValueError(
                f"policy={text!r} is invalid: '+' composes one policy with offload only, "
                "e.g. density=0.5+offload"
            )
        base = _parse(next((p for p in parts if p != "offload"), "none"))
        if base.offload:
            raise ValueError(f"policy={text!r} is invalid: offload is given twice")
        return Policy(base.kind, base.value, offload=True)
    spec = text.strip().lower()
    if spec == "offload":
        return Policy("none", offload=True)
    name, sep, arg = (part.strip() for part in spec.partition("="))
    kind = next((k for k in KINDS.values() if name in k.names), None)
    if kind is None:
        what = "Hugging Face policy" if name.startswith("hf") else "policy"
        raise ValueError(f"policy={text!r} is invalid: unknown {what} {name!r}; allowed is {POLICY_HELP}")
    if sep and kind.parse is None:
        raise ValueError(f"policy={text!r} is invalid: {name!r} takes no value; allowed is {kind.syntax}")
    if not (sep and arg):
        if name not in kind.bare:
            raise ValueError(f"policy={text!r} is invalid: {name!r} needs a value; allowed is {kind.syntax}")
        return Policy(kind.name, kind.bare[name])
    value = kind.parse(text, name, arg)
    if kind.name == "plan" and not compiled and set(value) & set(COMPILE_DIGITS):
        raise ValueError(f"plan={arg} is invalid: a compile budget digit needs +compile (plan=...+compile); "
                         "allowed are k (keep), s (selective), f (full), one per block")
    return Policy(kind.name, value)


def policy_of_label(label: str | Policy) -> Optional[Policy]:
    """A record's policy column read back (a run's CSV, a comparison's rows): its Policy, or None
    for a label that is no ckptlab policy (an anchor's, such as "torch.utils.checkpoint per
    block"). A Policy is returned as it is."""
    if isinstance(label, Policy):
        return label
    try:
        return parse_policy(label)
    except ValueError:
        return None


def budget_value(budget) -> int | float:
    """What a `budget=` policy holds, from any form a public function takes a budget in: a budget
    Policy; its text with or without `budget=` ("budget=0.5", "6GiB"); a fraction in (0, 1] of the
    no-checkpointing peak; or bytes. Raises ValueError naming the value and what is allowed."""
    if isinstance(budget, Policy):
        if budget.kind != "budget":
            raise ValueError(f"policy={budget} is invalid here: expected budget=...")
        return budget.value
    if isinstance(budget, str):
        text = budget.strip()
        return parse_policy(text if text.lower().startswith("budget") else f"budget={text}").value
    if isinstance(budget, float) and 0 < budget <= 1:
        return budget
    return size_bytes("budget", budget)


def as_policy(value: str | Policy) -> Policy:
    """What a public function does with its `policy` argument: a Policy as it is, text parsed."""
    return value if isinstance(value, Policy) else parse_policy(value)


def parse_policies(value, name: str = "policies") -> list[Policy]:
    """A list of policies, each parsed once and kept once, in order: a list of strings or
    Policies, or one comma-separated string ("none,layers=0,2,full" is none, layers=0,2 and full:
    a comma followed by a bare index continues a layers= list). Empty is refused; a bad item's
    error says which list it is in."""
    items = split_list(value, name) if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items:
        raise ValueError(f"{name}={value!r} is invalid: allowed is a comma-separated list of policies, "
                         "e.g. none,density=0.5,full")
    try:
        return list(dict.fromkeys(as_policy(item) for item in items))
    except ValueError as exc:
        if len(items) == 1 and isinstance(value, str):
            raise ValueError(f"{name} {exc}" if name.startswith("--") else str(exc)) from None
        raise ValueError(f"{exc} (in {name}={value!r})") from None


def _parse_budget(text: str, name: str, arg: str) -> int | float:
    """'0.5' -> 0.5 (a fraction of the no-checkpointing peak); '6GiB', '512MB', '1e9' -> bytes. A
    number above 1 written as a fraction ('1.5', '2.0') is refused, not taken for a few bytes."""
    try:
        number = float(arg)
    except ValueError:
        number = None
    if number is not None and 0 < number <= 1:
        return number
    refusal = ValueError(f"budget={text.strip().partition('=')[2].strip()} is invalid: allowed is a fraction in "
                         "(0, 1] of the no-checkpointing peak, or a size such as 6GiB, 512MiB, 2GB")
    if number is not None and (number <= 0 or ("." in arg and "e" not in arg)):
        raise refusal
    try:
        return size_bytes("budget", arg)
    except ValueError:
        raise refusal from None


def _number(text: str, name: str, arg: str, kind: type):
    try:
        return kind(arg)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"{name}={arg} is invalid in policy={text!r}: expected {expected}") from None


def _parse_density(text: str, name: str, arg: str) -> float:
    density = _number(text, name, arg, float)
    if not (0.0 <= density <= 1.0) or math.isnan(density):
        raise ValueError(f"density={arg} is invalid: allowed is a number in [0, 1]")
    return density + 0.0  # -0.0 becomes 0.0: one policy, one cell


def _parse_at_least_one(text: str, name: str, arg: str) -> int:
    k = _number(text, name, arg, int)
    if k < 1:
        raise ValueError(f"{name}={arg} is invalid: allowed is an integer >= 1")
    return k


def _parse_layers(text: str, name: str, arg: str) -> tuple:
    indices = tuple(_number(text, name, part.strip(), int) for part in arg.split(","))
    if any(i < 0 for i in indices):
        raise ValueError(f"layers={arg} is invalid: allowed are block indices >= 0")
    if len(set(indices)) != len(indices):
        raise ValueError(f"layers={arg} is invalid: an index is repeated; allowed are distinct indices")
    return tuple(sorted(indices))


def _parse_segments(text: str, name: str, arg: str) -> int | str:
    if arg == "sqrt":
        return "sqrt"
    n_segments = _number(text, name, arg, int)
    if n_segments < 1:
        raise ValueError(f"segments={arg} is invalid: allowed is an integer >= 1 or 'sqrt'")
    return n_segments


def _parse_selective(text: str, name: str, arg: str) -> str:
    if arg not in SELECTIVE_VARIANTS:
        raise ValueError(f"selective={arg} is invalid: allowed variants are {', '.join(SELECTIVE_VARIANTS)}")
    return arg


def _parse_plan(text: str, name: str, arg: str) -> str:
    bad = sorted(set(arg) - set(PLAN_LETTERS) - set(COMPILE_DIGITS))
    if bad:
        raise ValueError(f"plan={arg} is invalid: letter {bad[0]!r} is not allowed; allowed are k (keep), "
                         "s (selective), f (full), or with +compile a digit d (compile budget d/10), one per block")
    return arg


COMPILE_DIGITS = "0123456789"   # in a compiled plan: that block's activation_memory_budget, in tenths


def _parse_compiled(text: str, parts: list[str]) -> Policy:
    """P+compile: P is any ckptlab policy but compile itself; not with offload or hf policies."""
    if "offload" in parts:
        raise ValueError(f"policy={text!r} is invalid: offload does not compose with compile (dynamo cannot "
                         "trace save_on_cpu); allowed is P+offload or P+compile")
    if parts.count("compile") > 1 or len(parts) != 2 or "" in parts:
        raise ValueError(f"policy={text!r} is invalid: '+compile' composes one policy with compilation, "
                         "e.g. full+compile or plan=ffkk+compile")
    base = _parse(next(p for p in parts if p != "compile"), compiled=True)
    if base.kind == "compile":
        raise ValueError(f"policy={text!r} is invalid: compile is given twice; allowed is compile, "
                         "compile:budget=B or P+compile")
    if KINDS[base.kind].mechanism == "transformers":
        raise ValueError(f"policy={text!r} is invalid: '+compile' composes with ckptlab's policies, "
                         "not the hf ones")
    if base.kind == "none":
        return Policy("compile")
    return Policy(base.kind, base.value, compiled=True)


def _parse_compile_budget(text: str, name: str, arg: str) -> float:
    if name != "compile:budget":
        raise ValueError(f"policy={text!r} is invalid: allowed is compile or compile:budget=B with 0<=B<=1")
    budget = _number(text, name, arg, float)
    if not (0.0 <= budget <= 1.0) or math.isnan(budget):
        raise ValueError(f"compile:budget={arg} is invalid: allowed is a number in [0, 1]")
    return budget + 0.0


def _every_block(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n_blocks)]


def _no_region(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    return []


def _density_regions(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in spread_evenly(round(policy.value * n_blocks), n_blocks)]


def _every_regions(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    if policy.value > n_blocks:   # no block is the K-th: the policy would checkpoint nothing
        raise ValueError(f"every={policy.value} is invalid for a model with {n_blocks} blocks: allowed is "
                         f"every=1..{n_blocks}")
    return [(i, i + 1) for i in range(policy.value - 1, n_blocks, policy.value)]


def _layers_regions(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    bad = [i for i in policy.value if i >= n_blocks]
    if bad:
        raise ValueError(f"layers={','.join(map(str, policy.value))} is invalid for a model with {n_blocks} blocks: "
                         f"index {bad[0]} out of range; allowed indices are 0..{n_blocks - 1}")
    return [(i, i + 1) for i in policy.value]


def _segments_regions(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    n_segments = max(1, round(math.sqrt(n_blocks))) if policy.value == "sqrt" else policy.value
    if n_segments > n_blocks:
        raise ValueError(f"segments={policy.value} is invalid for a model with {n_blocks} blocks: "
                         f"allowed is 1..{n_blocks} segments")
    # Same cut as torch.utils.checkpoint.checkpoint_sequential: equal segments of N // S blocks,
    # the remainder going to the last (uncheckpointed) one.
    size = n_blocks // n_segments
    return [(s * size, (s + 1) * size) for s in range(n_segments - 1)]


def _plan_regions(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    if len(policy.value) != n_blocks:
        raise ValueError(f"plan={policy.value} is invalid for a model with {n_blocks} blocks: allowed is "
                         f"exactly {n_blocks} letters (k keep, s selective, f full), one per block")
    return [(i, i + 1) for i, c in enumerate(policy.value) if c in "sf"]  # k and budget digits: none


def _budget_regions(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    raise ValueError(f"policy={policy} needs the workload's shapes to become a per-block plan: use "
                     "ckptlab.measure(...) or ckptlab.plan_budget(...) and apply the plan it returns")


def _hf_regions(policy: Policy, n_blocks: int) -> list[tuple[int, int]]:
    # nominal: ckptlab.checkpoint.hf reports the layers transformers marks
    step = policy.value if policy.kind == "hf:every_n_layers" else 1
    return [(i, i + 1) for i in range(0, n_blocks, step)]


MECHANISMS = ("blocks", "transformers", "compiler")   # ckptlab's block wrappers, transformers' own, torch.compile


@dataclass(frozen=True)
class Kind:
    """One kind of policy, in one place: how it is written (`names`, before any "="; `syntax`,
    for errors and --help), what a name without a value means (`bare`), how a value is parsed
    and spelled back, which blocks it recomputes (`regions`), an example with its meaning, the
    mechanism that applies it (`MECHANISMS`) and whether a fake step can predict it."""

    name: str
    names: tuple[str, ...]
    regions: Callable[[Policy, int], list[tuple[int, int]]]
    syntax: str
    example: str
    meaning: str
    parse: Optional[Callable[[str, str, str], object]] = None   # (text, name, arg) -> value; None: no value
    spell: Callable[[object], str] = str
    bare: dict = field(default_factory=dict)                     # a name without a value -> its value
    mechanism: str = "blocks"
    predictable: bool = True


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("none", ("none",), _no_region, "none", "none", "no checkpointing",
         spell=lambda v: "none", bare={"none": None}),
    Kind("full", ("full",), _every_block, "full", "full", "recompute every block",
         spell=lambda v: "full", bare={"full": None}),
    Kind("density", ("density",), _density_regions, "density=D (0<=D<=1)", "density=0.5",
         "recompute round(0.5 x N) blocks, spread evenly", _parse_density, lambda v: f"density={v}"),
    Kind("every", ("every",), _every_regions, "every=K (K>=1)", "every=2", "recompute every 2nd block",
         _parse_at_least_one, lambda v: f"every={v}"),
    Kind("layers", ("layers",), _layers_regions, "layers=i,j,... (block indices)", "layers=0,2",
         "recompute these blocks (indices)", _parse_layers, lambda v: "layers=" + ",".join(map(str, v))),
    Kind("segments", ("segments",), _segments_regions, "segments=S (S>=1) | segments=sqrt", "segments=2",
         "checkpoint_sequential with 2 segments (segments=sqrt: sqrt(N))", _parse_segments, lambda v: f"segments={v}"),
    Kind("selective", ("selective",), _every_block, "selective[=mm|alt|attn]", "selective",
         "op-level: keep matmul/attention outputs (selective=alt, selective=attn)", _parse_selective,
         lambda v: "selective" if v == "mm" else f"selective={v}", bare={"selective": "mm"}),
    Kind("plan", ("plan",), _plan_regions, "plan=<k|s|f per block>", "plan=kfsk",
         "one letter per block: k keep, s selective, f full", _parse_plan, lambda v: f"plan={v}"),
    Kind("budget", ("budget",), _budget_regions, "budget=<size like 6GiB, or fraction like 0.5>", "budget=6GiB",
         "the planner picks keep/selective/full per block to fit (budget=0.5: of none's peak)", _parse_budget,
         lambda v: f"budget={size_label(v)}" if isinstance(v, int) else f"budget={v}"),
    # the compiler decides what to recompute, inside the compiled graph: no block regions
    Kind("compile", ("compile", "compile:budget"), _no_region, "compile | compile:budget=B (0<=B<=1)", "compile",
         "torch.compile (compile:budget=0.5 sets PyTorch's activation_memory_budget)", _parse_compile_budget,
         lambda v: "compile" if v is None else f"compile:budget={v}", bare={"compile": None},
         mechanism="compiler", predictable=False),
    Kind("hf", ("hf",), _hf_regions, "hf", "hf", "transformers models: their own checkpointing on every layer",
         spell=lambda v: "hf", bare={"hf": None}, mechanism="transformers"),
    Kind("hf:every_n_layers", ("hf:every_n_layers",), _hf_regions, "hf:every_n_layers=K (K>=1)",
         "hf:every_n_layers=2", "transformers models: their own checkpointing on every 2nd layer",
         _parse_at_least_one, lambda v: f"hf:every_n_layers={v}", mechanism="transformers"),
    Kind("hf:offload", ("hf:offload",), _hf_regions, "hf:offload", "hf:offload",
         "transformers models: their own checkpointing, saved tensors in host memory",
         spell=lambda v: "hf:offload", bare={"hf:offload": None}, mechanism="transformers"),
)}
HF_KINDS = tuple(k.name for k in KINDS.values() if k.mechanism == "transformers")
COMPOSITIONS = (   # what '+' adds to a kind, one example each
    ("full+offload", "any policy with saved activations in host memory (offload alone: none+offload)"),
    ("full+compile", "any policy, then torch.compile (plan=00kf+compile: a compile budget per block)"),
    ("budget=0.5+compile", "the compiled plan for a budget, chosen from measured compiled runs (compare, sweep)"),
)
POLICY_HELP = ("one of: " + " | ".join(k.syntax for k in KINDS.values() if k.mechanism != "transformers")
               + "; any of them +offload, any but compile +compile; transformers models also: "
               + " | ".join(KINDS[k].syntax for k in HF_KINDS))
