"""Policies composed with torch.compile (`P+compile`), their gradients verified against the eager
un-checkpointed model, and the compile anchor whose gradients are wrong.

Compilation takes seconds per graph on a 2-core CPU where inductor's on-disk cache is empty (a
machine's first run): one tiny model of our own (residual MLP blocks with dropout,
width 32; two blocks where a claim needs no more, as inductor compiles each block's kernels on
its own) and as few compiled models as the claims need."""

import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from ckptlab import Workload, compare, compare_gradients, measure, parse_policy
from ckptlab.checkpoint.compiled import apply_policy, fresh_compiler_cache
from ckptlab.plan.compiled import UniformCost, choose_compiled, compositions
from ckptlab.run.compiled_plan import plan_compiled

BATCH, SEQ = 4, 32


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Net(nn.Module):
    def __init__(self, n_blocks=3, width=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n_blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dropout_mlp(n_blocks=3):
    return Workload.custom(f"dropout-mlp-{n_blocks}", lambda: Net(n_blocks),
                           lambda batch, seq, generator: (torch.randn(batch, seq, 32, generator=generator),),
                           lambda model, batch: model(batch[0]).pow(2).mean())


def test_fresh_compiler_cache_resets_before_and_after_only_for_compiling_work(monkeypatch):
    resets = []
    monkeypatch.setitem(sys.modules, "torch._dynamo", types.SimpleNamespace(reset=lambda: resets.append(1)))
    with fresh_compiler_cache(False):
        assert resets == []
    with fresh_compiler_cache():
        assert resets == [1]
    assert resets == [1, 1]


def test_compile_composes_with_any_ckptlab_policy_and_refuses_what_it_cannot():
    for text in ("full+compile", "selective=alt+compile", "plan=ffkk+compile", "budget=0.6+compile",
                 "plan=05kf+compile", "segments=2+compile"):
        policy = parse_policy(text)
        assert policy.compiles and parse_policy(str(policy)) == policy, text
    assert parse_policy("none+compile") == parse_policy("compile")
    assert parse_policy("layers=0,1+compile").compile_budgets(4) is None          # one graph
    assert parse_policy("plan=05kf+compile").compile_budgets(4) == [0.0, 0.5, 1.0, 1.0]  # a graph per block
    assert parse_policy("plan=05kf+compile").checkpointed_blocks(4) == [3]
    for bad, says in (("plan=05kf", r"needs \+compile"), ("full+compile+offload", "offload does not compose"),
                      ("compile:budget=0.5+compile", "compile is given twice"), ("hf+compile", "not the hf")):
        with pytest.raises(ValueError, match=says):
            parse_policy(bad)


def test_checkpointed_blocks_compile_into_one_graph_without_a_break():
    # Eager checkpoint's early stop and ckptlab's recompute counters would each break the graph
    # at every checkpointed block, which then ran eager.
    workload = dropout_mlp()
    for policy in ("full", "plan=fks", "segments=2"):
        model = workload.build().train()
        apply_policy(model, parse_policy(policy))
        explanation = torch._dynamo.explain(model)(*workload.batch(BATCH, SEQ))
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), (policy, explanation.break_reasons)
    torch._dynamo.reset()


def test_compile_gradients_within_tolerance_and_budget_zero_wrong():
    workload = dropout_mlp(2)
    right = compare_gradients(workload, "compile", BATCH, SEQ)
    assert right.verdict == "within tolerance" and 0 < right.max_rel_diff <= right.tolerance, right
    wrong = compare_gradients(workload, "compile:budget=0.0", BATCH, SEQ)
    assert wrong.verdict == "wrong" and wrong.max_rel_diff > 100 * wrong.tolerance, wrong
    assert wrong.loss == right.loss  # the forward is right; the backward redraws dropout
    assert compare_gradients(workload, "full", BATCH, SEQ).verdict == "exact"


def test_full_compile_holds_less_than_compile_with_right_gradients_and_the_wrong_anchor_is_marked():
    workload = dropout_mlp(2)
    df = compare(workload, BATCH, SEQ, ["compile", "full+compile"], verify=True, max_seconds=0.5, compiled_options="",
                 anchors=["torch.compile activation_memory_budget=0.5", "torch.utils.checkpoint per block"])
    rows = df.set_index("policy")
    assert (rows.loc[["compile", "full+compile"], "status"] == "ok").all(), df[["policy", "status", "message"]]
    assert rows.loc["full+compile", "peak_bytes"] < rows.loc["compile", "peak_bytes"]
    assert rows.loc["compile", "compiled_graphs"] == rows.loc["full+compile", "compiled_graphs"] == 1  # ran compiled
    assert rows.loc["full+compile", "gradients"] == rows.loc["compile", "gradients"] == "within tolerance"
    assert rows.loc["torch.compile activation_memory_budget=0.5", "gradients"] == "wrong"
    assert rows.loc["torch.utils.checkpoint per block", "gradients"] == "exact"


def test_a_budget_per_block_compiles_each_block_and_never_silently_runs_eager():
    # 9 blocks of one class, each with a backend of its own: past dynamo's default recompile
    # limit (8), which would have run the 9th block eager without a word.
    workload = dropout_mlp(9)
    rec = measure(workload, BATCH, SEQ, "plan=" + "k" * 8 + "5+compile", steps=1, warmup=0, max_seconds=0.1)
    assert rec["status"] == "ok", rec["message"]
    assert rec["compiled_graphs"] == 9 and rec["recompute_count"] is None
    assert torch._dynamo.config.fail_on_recompile_limit_hit


def test_compiled_plan_counts_and_bad_input():
    assert sorted(compositions(3, 2)) == [(0, 3), (1, 2), (2, 1), (3, 0)]
    with pytest.raises(ValueError, match="a compiled budget's plan is chosen from measured costs"):
        ckptlab.measure(dropout_mlp(2), 2, 8, "budget=0.5+compile")
    for bad, says in (({"options": "fx"}, "options='fx'"), ({"options": "f0"}, "k included"),
                      ({"budget": "lots"}, "budget=lots")):
        with pytest.raises(ValueError, match=says):
            plan_compiled(dropout_mlp(2), 2, 8, **{"budget": 0.5, **bad})


@pytest.mark.slow  # compiles about ten models: minutes on 2 cores
def test_compiled_plan_choice_rests_on_measurements_and_is_verified_by_one():
    plan = plan_compiled(dropout_mlp(2), 8, 64, 0.8, options="kf0", max_seconds=0.3)
    rows = plan.comparison.set_index("policy")
    assert rows.loc["plan=00+compile", "gradients"] == "wrong" and "0" not in plan.options  # never chosen
    assert set(plan.letters) <= set("kf") and plan.letters != "kk"
    assert plan.peak_bytes == rows.loc["budget=0.8+compile", "peak_bytes"]  # measured
    assert plan.fits and plan.gradients == "within tolerance"
    assert "measured" in str(plan) and "predicted" in str(plan)


def test_a_compiled_plan_mixes_measured_options_to_the_least_predicted_time_that_fits():
    # 4 blocks; all-keep holds 100 and takes 10; full saves 10 per block for +2 each; budget 0 saves
    # 5 per block for +0.5 each (its uniform plan: 80 MB, 12 ms).
    costs = {"k": UniformCost(100, 10.0), "f": UniformCost(60, 18.0), "0": UniformCost(80, 12.0)}
    assert choose_compiled(costs, 4, 100).letters == "kkkk"
    mixed = choose_compiled(costs, 4, 75)   # 25 to save: 3 x budget 0 + 1 x full (25) beats 2 x full + ... (+4.5 ms)
    assert sorted(mixed.letters) == sorted("f000") and mixed.letters[0] == "f"   # the options saving most first
    assert (mixed.predicted_peak_bytes, mixed.predicted_step_ms) == (75, 13.5)
    assert mixed.compile_budgets() == [1.0, 0.0, 0.0, 0.0] and mixed.record()["plan"] == mixed.letters
    with pytest.raises(ValueError, match="lowest measured peak of a uniform plan with right gradients is 60 B"):
        choose_compiled(costs, 4, 59)


@pytest.mark.slow  # compiles about ten models: minutes on 2 cores
def test_compare_adds_the_compiled_plan_at_an_anchors_peak_with_its_verdict():
    anchor = "torch.compile activation_memory_budget=0.5"
    df = compare(dropout_mlp(2), 8, 64, ["none", "budget=0.9+compile"], anchors=[anchor], compiled_options="kf0",
                 max_seconds=0.3)
    compiled = df[df["plan_cost_basis"].notna()]
    at_anchor = compiled[compiled["plan_at_peak_of"] == anchor].iloc[0]
    assert at_anchor["peak_bytes"] <= df.set_index("policy").loc[anchor, "peak_bytes"]   # measured, fits
    assert at_anchor["gradients"] == "within tolerance" and "0" not in at_anchor["plan"]    # dropout: budget 0 wrong
    budget = df.set_index("policy").loc["budget=0.9+compile"]
    assert budget["plan"] and budget["gradients"] == "within tolerance" and budget["round_ms"]


def test_a_compiled_budget_builds_each_options_uniform_plan_itself():
    # The uniform compiled plans are not among the policies given: compare makes and measures them.
    df = compare(dropout_mlp(2), BATCH, SEQ, ["none", "budget=0.9+compile"], compiled_options="kf", max_seconds=0.2,
                 progress=False).set_index("policy")
    assert (df.loc[["plan=kk+compile", "plan=ff+compile", "budget=0.9+compile"], "status"] == "ok").all(), df["message"]
    assert df.loc["budget=0.9+compile", "plan"] and df.loc["budget=0.9+compile", "gradients"] != "wrong"


def test_the_context_fn_notice_stays_off_the_terminal():
    import logging

    from ckptlab.checkpoint.compiled import CONTEXT_FN_NOTICE

    apply_policy(dropout_mlp().build(), parse_policy("selective+compile"))  # compiles on first call
    notices = logging.getLogger("torch._higher_order_ops.wrap")
    notice = notices.makeRecord(notices.name, logging.WARNING, __file__, 0, f"\n{CONTEXT_FN_NOTICE}.\n", (), None)
    other = notices.makeRecord(notices.name, logging.WARNING, __file__, 0, "another warning", (), None)
    assert not notices.filter(notice) and notices.filter(other)
