import contextlib
import types

import pytest

from ckptlab import parse_policy
from ckptlab.core.policy import HF_KINDS, KINDS, MECHANISMS, POLICY_HELP, as_policy, parse_policies, spread_evenly


@pytest.mark.parametrize(
    "text, n, blocks, density",
    [
        ("none", 8, [], 0.0),
        ("full", 8, list(range(8)), 1.0),
        ("density=0", 8, [], 0.0),
        ("density=0.5", 8, [1, 3, 5, 7], 0.5),
        ("density=0.25", 8, [2, 6], 0.25),
        ("density=1", 8, list(range(8)), 1.0),
        ("density=0.5", 4, [1, 3], 0.5),
        ("every=2", 8, [1, 3, 5, 7], 0.5),
        ("every=3", 8, [2, 5], 0.25),
        ("every=1", 4, [0, 1, 2, 3], 1.0),
        ("layers=0,3,5", 8, [0, 3, 5], 0.375),
        ("layers=5,0", 8, [0, 5], 0.25),
        ("segments=2", 8, [0, 1, 2, 3], 0.5),      # last segment runs normally
        ("segments=4", 8, [0, 1, 2, 3, 4, 5], 0.75),
        ("segments=3", 8, [0, 1, 2, 3], 0.5),      # 8 // 3 = 2 blocks a segment, rest in the last
        ("segments=sqrt", 9, list(range(6)), 6 / 9),
        ("segments=1", 8, [], 0.0),
    ],
)
def test_blocks_and_effective_density(text, n, blocks, density):
    policy = parse_policy(text)
    assert policy.checkpointed_blocks(n) == blocks
    assert policy.effective_density(n) == pytest.approx(density)


def test_segments_are_single_regions():
    assert parse_policy("segments=2").regions(8) == [(0, 4)]
    assert parse_policy("full").regions(3) == [(0, 1), (1, 2), (2, 3)]


def test_round_trip_and_as_policy():
    for text in ["none", "full", "density=0.5", "every=2", "layers=0,3", "segments=sqrt", "segments=3"]:
        policy = parse_policy(text)
        assert str(policy) == text
        assert as_policy(policy) is policy
        assert parse_policy(str(policy)) == policy
    assert parse_policy(" Density = 0.5 ") == parse_policy("density=0.5")


def test_spread_evenly_is_even_and_distinct():
    for n in range(1, 25):
        for k in range(n + 1):
            idx = spread_evenly(k, n)
            assert len(set(idx)) == k and all(0 <= i < n for i in idx)
            gaps = [b - a for a, b in zip(idx, idx[1:])]
            assert not gaps or max(gaps) - min(gaps) <= 1


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("density=1.5", ["density=1.5", "[0, 1]"]),
        ("density=-0.1", ["density=-0.1", "[0, 1]"]),
        ("density=abc", ["density=abc", "a number"]),
        ("density=nan", ["density=nan", "[0, 1]"]),
        ("every=0", ["every=0", ">= 1"]),
        ("every=1.5", ["every=1.5", "an integer"]),
        ("segments=0", ["segments=0", ">= 1", "sqrt"]),
        ("layers=-1", ["layers=-1", ">= 0"]),
        ("layers=1,1", ["layers=1,1", "distinct"]),
        ("foo", ["'foo'", "none | full | density=D"]),
        ("full=1", ["full", "takes no value"]),
        ("density", ["density", "needs a value"]),
        ("", ["policy=''", "allowed"]),
    ],
)
def test_invalid_policy_strings_name_value_and_allowed(text, fragments):
    with pytest.raises(ValueError) as err:
        parse_policy(text)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_errors_that_depend_on_the_number_of_blocks():
    with pytest.raises(ValueError, match=r"layers=99 is invalid for a model with 8 blocks.*0\.\.7"):
        parse_policy("layers=99").regions(8)
    with pytest.raises(ValueError, match=r"segments=9 is invalid for a model with 8 blocks.*1\.\.8"):
        parse_policy("segments=9").regions(8)


def test_non_string_policy_is_rejected():
    with pytest.raises(ValueError, match="policy=0.5 is invalid: expected a string"):
        parse_policy(0.5)


@pytest.mark.parametrize("n_bytes, text", [(6 * 2**30, "budget=6GiB"), (512 * 2**20, "budget=512MiB"),
                                           (44774195, "budget=44774195B"), (44777048, "budget=44777048B")])
def test_budget_in_bytes_prints_as_an_exact_size_that_parses_back(n_bytes, text):
    policy = parse_policy(f"budget={n_bytes}")
    assert str(policy) == text
    assert parse_policy(str(policy)) == policy


@pytest.mark.parametrize("n_bytes", [1, 1023, 1536, 10**9, 2**40 + 1, 44777048, 123456789])
def test_budget_str_round_trips_for_awkward_sizes(n_bytes):
    policy = parse_policy(f"budget={n_bytes}B")
    assert parse_policy(str(policy)).value == n_bytes


def test_budget_label_is_a_rounded_size():
    assert parse_policy("budget=44777048B").label == "budget=42.7MiB"
    assert parse_policy("budget=6GiB+offload").label == "budget=6GiB+offload"
    assert parse_policy("budget=0.5").label == "budget=0.5"
    assert parse_policy("density=0.5").label == "density=0.5"


def test_a_list_of_policies_splits_one_way():
    assert [str(p) for p in parse_policies("none,layers=0,2,full")] == ["none", "layers=0,2", "full"]
    assert [str(p) for p in parse_policies(["full", "FULL", parse_policy("none")])] == ["full", "none"]
    for empty in ("", [], " , "):
        with pytest.raises(ValueError, match="policies=.* is invalid: allowed is a comma-separated list of policies"):
            parse_policies(empty)


def _counting_parse(text):
    _parse_policy_calls.append(text)  # noqa: F821 - a name of ckptlab.core.policy while counting
    return _parse_policy_uncounted(text)  # noqa: F821 - as above


@contextlib.contextmanager
def parse_policy_calls():
    """Counts every call of parse_policy, however it was imported: its code object is swapped
    for one that counts, then runs a copy of the original."""
    calls, original = [], parse_policy.__code__
    module = parse_policy.__globals__
    module["_parse_policy_calls"] = calls
    module["_parse_policy_uncounted"] = types.FunctionType(original, module)
    parse_policy.__code__ = _counting_parse.__code__
    try:
        yield calls
    finally:
        parse_policy.__code__ = original
        del module["_parse_policy_calls"], module["_parse_policy_uncounted"]


def test_a_policy_is_parsed_once_from_the_edge_to_the_wrapper():
    import ckptlab

    texts = ["none", "layers=0,1", "full+offload", "budget=1GiB"]
    with parse_policy_calls() as calls:
        for text in texts:
            ckptlab.measure("gpt-tiny", 1, 16, text, steps=1, warmup=0, max_seconds=0.1)
    assert sorted(calls) == sorted(texts)
    with parse_policy_calls() as calls:
        for text in texts:
            ckptlab.predict("gpt-tiny", 1, 16, text)
    assert sorted(calls) == sorted(texts)
    with parse_policy_calls() as calls:
        ckptlab.compare("gpt-tiny", 1, 16, ",".join(texts), max_seconds=0.1, target_ci=0.5)
    assert sorted(calls) == sorted(texts)


def test_each_kind_is_one_entry_whose_example_parses_to_it():
    for kind in KINDS.values():
        policy = parse_policy(kind.example)
        assert policy.kind == kind.name and str(policy) == kind.example
        assert policy.mechanism == kind.mechanism in MECHANISMS
        assert kind.syntax.split("=")[0].split("[")[0] in POLICY_HELP
    assert HF_KINDS == ("hf", "hf:every_n_layers", "hf:offload")
    assert not parse_policy("compile").predictable and not parse_policy("full+compile").predictable
    assert parse_policy("plan=05kf+compile").compile_budgets(4) == [0.0, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="plan=05kf is invalid: a compile budget digit needs"):
        parse_policy("plan=05kf")


def test_a_record_label_reads_back_as_its_policy_and_an_anchor_label_as_none():
    from ckptlab.core.policy import Policy, policy_label, policy_of_label

    assert policy_of_label("density=0.5") == Policy("density", 0.5)
    assert policy_of_label(Policy("full")) == Policy("full")
    assert policy_of_label("torch.utils.checkpoint per block") is None
    assert policy_label("torch.utils.checkpoint per block") == "torch.utils.checkpoint per block"
    assert policy_label("budget=44739243") == "budget=42.7MiB"


def test_a_budget_in_any_form_is_the_value_budget_holds():
    from ckptlab.core.policy import Policy, budget_value

    assert budget_value("budget=0.5") == budget_value("0.5") == budget_value(0.5) == 0.5
    assert budget_value("6GiB") == budget_value(" budget=6GiB") == budget_value(6 * 2**30) == 6 * 2**30
    assert budget_value("budget=0.5+compile") == budget_value(Policy("budget", 0.5, compiled=True)) == 0.5
    for bad, says in (("lots", "budget=lots is invalid"), (Policy("full"), "expected budget="), (0, "budget=0 is invalid")):
        with pytest.raises(ValueError, match=says):
            budget_value(bad)


@pytest.mark.parametrize("a, b, alike", [
    ("full", "plan=ffff", True), ("full", "density=1", True), ("none", "plan=kkkk", True),
    ("selective", "plan=ssss", True), ("selective=attn", "plan=ssss", False),   # a plan's selective keeps mm
    ("segments=sqrt", "plan=ffkk", False),          # one region of two blocks against two of one
    ("full", "full+offload", False), ("full", "hf", False), ("budget=0.5", "budget=0.5", True),
    ("budget=0.5", "full", False),
])
def test_policies_that_checkpoint_alike(a, b, alike):
    assert parse_policy(a).checkpoints_like(parse_policy(b), 4) is alike
    assert parse_policy(b).checkpoints_like(parse_policy(a), 4) is alike
