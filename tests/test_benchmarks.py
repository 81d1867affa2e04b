"""The benchmarks' verdicts follow their intervals: the wrapper-overhead verdict of
benchmarks/overhead.py and the plan-against-uniform claims of benchmarks/predict_and_plan.py, on
intervals and per-round times with a known answer; overhead.py end to end at a tiny shape; and
frontier.py's smallest setting end to end, with the goal read from per-anchor verdicts."""

import importlib.util
import json
from pathlib import Path
from statistics import median

import pandas as pd
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


overhead = load("overhead")
predict_and_plan = load("predict_and_plan")
frontier = load("frontier")


@pytest.mark.parametrize("low, high, difference, target", [
    (0.99, 1.01, "no difference", "within the +2% target"),
    (0.99, 1.03, "no difference", "target is not shown"),
    (1.005, 1.015, "slower", "within the +2% target"),
    (1.01, 1.05, "slower", "target is not shown"),
    (1.03, 1.05, "slower", "beyond the +2% target"),
    (0.95, 0.98, "faster", "within the +2% target"),
])
def test_wrapper_verdict_says_only_what_the_interval_shows(low, high, difference, target):
    verdict = overhead.wrapper_verdict(low, high)
    assert verdict.startswith(difference) and target in verdict


def row(policy, kind, peak, rounds_ms, none_ms):
    """A timed frontier row: its time ratio to none from the given per-round times (a spread of
    ratios gives the interval)."""
    ratios = sorted(r / n for r, n in zip(rounds_ms, none_ms))
    ratio = ratios[len(ratios) // 2]
    return {"policy": policy, "kind": kind, "status": "ok", "peak_bytes": peak, "saved_activation_bytes": peak // 2,
            "round_ms": rounds_ms, "step_ms": sorted(rounds_ms)[len(rounds_ms) // 2], "time_ratio": ratio, "time_ratio_low": ratios[0], "time_ratio_high": ratios[-1],
            "overhead": ratio - 1, "overhead_low": ratios[0] - 1, "overhead_high": ratios[-1] - 1}


def test_a_plan_dominates_only_when_its_paired_interval_lies_below_one():
    none_ms = [100.0] * 5
    rows = [
        row("none", "uniform", 100, none_ms, none_ms),
        row("full", "uniform", 40, [150.0, 151, 152, 153, 154], none_ms),
        row("selective", "uniform", 60, [140.0, 141, 142, 143, 144], none_ms),
        row("density=0.5", "uniform", 70, [120.0, 122, 124, 126, 128], none_ms),
        row("every=2", "uniform", 80, [113.0, 110, 115, 112, 111], none_ms),
        row("plan=fkkk", "plan", 70, [110.0, 111, 112, 113, 114], none_ms),     # below density=0.5 in every round
        row("plan=fffs", "plan", 40, [149.0, 150, 151, 152, 153], none_ms),     # 1 ms below full in every round
        row("compile:budget=0.0", "compile", 10, [50.0] * 5, none_ms),          # never a plan
    ]
    summary = predict_and_plan.frontier_summary(rows)
    verdicts = {d["uniform"]: d for d in summary["dominance"]}
    assert verdicts["density=0.5"]["best_plan"] == "plan=fkkk" and verdicts["density=0.5"]["dominated"]
    # The unpaired intervals of fffs and full overlap, but paired round by round fffs is faster.
    assert verdicts["full"]["verdict"] == "plan faster" and verdicts["full"]["dominated"]
    # fkkk against every=2: faster in some rounds, slower in others.
    assert verdicts["every=2"]["verdict"] == "no difference" and not verdicts["every=2"]["dominated"]
    assert verdicts["selective"]["best_plan"] == "plan=fffs" and verdicts["selective"]["verdict"] == "plan slower"
    # full over fffs, round by round: 150/149 .. 154/153, all just above 1 (paired, so significant).
    assert summary["best_plan_at_full_peak"] == "plan=fffs" and summary["speedup_verdict"] == "faster"
    assert 0 < summary["speedup_at_full_peak_low"] <= summary["speedup_at_full_peak"] <= summary[
        "speedup_at_full_peak_high"] < 0.01
    assert summary["full_overhead_low"] == pytest.approx(0.5) and summary["full_overhead_high"] == pytest.approx(0.54)


def test_overhead_benchmark_prints_every_time_with_its_interval(capsys):
    overhead.main(["--batch", "1", "--seq", "8", "--max-seconds", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    table = {line[:17].strip(): line for line in lines[3:7]}
    assert set(table) == {"none", "ckptlab full", "manual full", "forward (no grad)"}
    assert all(line.count("[") == 2 for line in table.values())
    wrapper = next(line for line in lines if line.startswith("(a)"))
    assert "[" in wrapper and ("no difference" in wrapper or "slower" in wrapper or "faster" in wrapper)
    assert "threads=1" in lines[0] and "interleaved rounds" in lines[1]


def test_overhead_benchmark_refuses_a_bad_option_before_any_work(capsys):
    with pytest.raises(ValueError, match="target_ci=0"):
        overhead.main(["--target-ci", "0"])
    with pytest.raises(SystemExit):
        overhead.main(["--model", "mlp-chain"])
    assert "--model 'mlp-chain' is invalid: allowed is a GPT workload" in capsys.readouterr().err


def test_frontier_smallest_setting_writes_one_report_entry_per_anchor(tmp_path, capsys):
    pytest.importorskip("transformers")
    report = frontier.run_shape("tiny", 0.3, None, tmp_path)
    written = json.loads((tmp_path / "tiny" / "report.json").read_text())
    assert written["anchors"] == json.loads(json.dumps(report["anchors"]))
    assert [e["anchor"] for e in written["anchors"]] == frontier.SHAPES["tiny"]["anchors"]
    for entry in written["anchors"]:
        assert entry["anchor_gradients"] == "exact" and entry["anchor_peak_bytes"] > 0
        assert entry["ckptlab_peak_bytes"] <= entry["anchor_peak_bytes"] and entry["ckptlab_gradients"] != "wrong"
        low, high = entry["vs_anchor_low"], entry["vs_anchor_high"]
        assert low <= entry["vs_anchor"] <= high and entry["verdict"] == frontier.time_verdict(low, high)
    assert (tmp_path / "tiny" / "report.md").read_text().startswith("## tiny:")
    assert "| anchor | its peak |" in capsys.readouterr().out   # printed too
    again = frontier.report_again("tiny", tmp_path)   # the same report, read back from compare.json
    assert json.loads(json.dumps(again["anchors"], default=frontier._plain)) == written["anchors"]
    # The choice made on the report's rounds, timed again in rounds of its own.
    frontier.main(["--shapes", "tiny", "--confirm", "--max-seconds", "0.3", "--out", str(tmp_path)])
    confirmed = json.loads((tmp_path / "tiny" / "confirm.json").read_text())
    assert [(e["anchor"], e["ckptlab"]) for e in confirmed["anchors"]] == [
        (e["anchor"], e["ckptlab"]) for e in written["anchors"]]
    for entry, first in zip(confirmed["anchors"], written["anchors"]):
        assert entry["ckptlab_peak_bytes"] == first["ckptlab_peak_bytes"] <= entry["anchor_peak_bytes"]
        assert entry["first_run"] == [first["vs_anchor"], first["vs_anchor_low"], first["vs_anchor_high"], first["verdict"]]
        assert entry["verdict"] == frontier.time_verdict(entry["vs_anchor_low"], entry["vs_anchor_high"])
    assert "| anchor | ckptlab row | first run" in (tmp_path / "tiny" / "confirm.md").read_text()


def test_frontier_goal_needs_every_compile_point_no_slower_and_one_faster():
    def entry(anchor, verdict):
        return {"anchor": anchor, "verdict": verdict}
    points = frontier.COMPILE_ANCHORS
    assert frontier.goal([entry(a, "no difference") for a in points[:-1]] + [entry(points[-1], "faster")])["reached"]
    assert not frontier.goal([entry(a, "no difference") for a in points])["reached"]             # none faster
    assert not frontier.goal([entry(a, "faster") for a in points[:-1]] + [entry(points[-1], "slower")])["reached"]
    assert not frontier.goal([entry(a, "faster") for a in points[:-1]])["reached"]                # a point missing
    assert not frontier.goal([entry(a, "faster") for a in points[:-1]] + [{"anchor": points[-1]}])["reached"]


def test_frontier_findings_pair_rows_of_one_comparison():
    none_ms = [100.0] * 5

    def timed(policy, source, peak, rounds_ms, **extra):
        return {"policy": policy, "source": source, "status": "ok", "peak_bytes": peak, "gradients": "within tolerance",
                "round_ms": rounds_ms, "n_blocks": 2, "time_ratio": rounds_ms[0] / 100, "plan_cost_basis": None,
                "plan_at_peak_of": None, **extra}
    anchor = "torch.compile activation_memory_budget=0.5"
    df = pd.DataFrame([
        timed("none", "ckptlab", 100, none_ms),
        timed("compile", "ckptlab", 90, [90.0, 91, 92, 93, 94]),
        timed("plan=kk+compile", "ckptlab plan", 95, [95.0, 96, 97, 98, 99]),
        timed(anchor, "torch.compile", 70, [93.0] * 5),
        timed("plan=ff+compile", "ckptlab plan", 60, [99.0] * 5),
        timed("plan=fk", "ckptlab plan", 70, [110.0] * 5, plan_at_peak_of=anchor),
        timed("plan=fk+compile", "ckptlab plan", 65, [94.0] * 5, plan_at_peak_of=anchor, plan_cost_basis="measured"),
    ])
    found = {f["question"]: f for f in frontier.findings(df)}
    whole = found["one graph (head and embeddings compiled too) vs block by block, budget 1"]
    assert (whole["row"], whole["versus"], whole["verdict"]) == ("compile", "plan=kk+compile", "faster")
    eager = found[f"compiled plan vs eager plan at {anchor}'s peak"]
    assert eager["versus"] == "plan=fk" and eager["ratio"] == pytest.approx(94 / 110) and eager["verdict"] == "faster"
    uniform = found["compiled plan vs the fastest uniform compiled plan at or below its peak"]
    assert uniform["versus"] == "plan=ff+compile" and uniform["verdict"] == "faster"
    assert "one graph vs block by block, budget 0.5" not in found   # plan=55+compile was not measured


# Each benchmark's smallest setting: a run of every step at toy size, so that a rename in ckptlab
# cannot break a benchmark silently. overhead.py and frontier.py run end to end above,
# predict_speed.py and explorer_latency.py below (they write their results: into a temporary
# folder); published.py (and its table of rows) in tests/test_published.py, on a stand-in row
# without its extra's packages.
SMALLEST = {
    "predict_and_plan": ["--quick", "--skip-compile", "--max-seconds", "0.5", "--batch", "2", "--seq", "32"],
    "sweep_cost": ["--quick"],
    "job_overhead": ["--repeats", "1"],
}


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")
                                         if p.stem not in ("overhead", "frontier", "predict_speed", "explorer_latency",
                                                           "published", "published_rows")))
def test_every_benchmark_runs_its_smallest_setting(name, capsys):
    assert name in SMALLEST, f"benchmarks/{name}.py: add its smallest setting to SMALLEST"
    load(name).main(SMALLEST[name])
    assert capsys.readouterr().out.strip()


def test_predict_speed_times_both_paths_and_checks_them_identical(tmp_path, capsys):
    load("predict_speed").main(["--quick", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "predict_speed.json").read_text())
    assert [row["policy"] for row in result["predictions"]] == ["plan=kffkkkkkkkkf"]
    for row in result["predictions"]:
        assert row["identical"] and row["fast_trace"] == "composed"
        assert 0 < row["kept_s"] < row["first_fast_s"]   # asked again: answered from the predictions kept on disk
        for when in ("first", "prepared"):   # one round: its own ratio
            assert row[f"{when}_ratio"] == pytest.approx(row[f"{when}_full_s"] / row[f"{when}_fast_s"])
    on_lines, in_workers = result["fits"]   # --quick: no table traced without lines
    assert on_lines["rows"] and on_lines["rows"] == in_workers["rows"] and on_lines["from_lines"] > 0
    assert result["explain"]["levers"] > 0 and result["explain"]["seconds"] > 0
    modes = result["fake_modes"]   # torch's fake mode and ckptlab's, each first in one of two rounds: the same records
    assert modes["identical"] and modes["rounds"] == 2 and len(modes["first_rounds_torch_s"]) == 2
    assert modes["first_ratio"] == pytest.approx(median(a / b for a, b in zip(modes["first_rounds_torch_s"],
                                                                             modes["first_rounds_ckptlab_s"])))
    command = result["command"]   # a command asked again in a new process: its kept rows, the model not built
    assert command["rows"] == 4 and 0 < command["again_s"] < command["first_s"]
    report = (tmp_path / "predict_speed.md").read_text()
    assert "| gpt-tiny | 64 | fp32 | plan=kffkkkkkkkkf | adamw |" in report
    assert f"| gpt-tiny | 64 | none | {modes['first_torch_s']:.2f} | {modes['first_ckptlab_s']:.2f} |" in report
    start, end = result["python_loop_s"]   # the machine's speed at plain Python, at both ends of the run
    assert start > 0 and end > 0 and f"Python loop in {start:.2f} s of CPU at the start" in report


def test_predict_speed_says_which_goals_a_run_meets():
    speed = load("predict_speed")
    row = dict(model=speed.GOAL_MODEL, seq_len=speed.GOAL_SEQ, policy="none", loop="adamw", first_fast_s=1.3, prepared_fast_s=0.4,
               first_ratio=2.7, prepared_ratio=5.0)
    table = dict(model=speed.GOAL_MODEL, trace="fast", policies=["none", "full"], cards=["rtx4090"], workers=2)
    result = {"predictions": [dict(row, seq_len=2048, prepared_fast_s=9.0),
                              dict(row, loop="adamw,accum=8", prepared_fast_s=9.0, prepared_ratio=2.0), row],
              "fits": [dict(table, seconds=26.0, workers=1), dict(table, seconds=19.5)]}
    assert [met for _, _, met in speed.goals(result)] == ["no / yes", "no / yes", "yes"]
    assert "19.5 s (2 worker(s))" in speed.goals(result)[2][1]
    assert speed.goals({"predictions": [], "fits": []}) == []   # --quick measures none of them


def test_explorer_latency_times_each_widget_change(tmp_path, capsys):
    pytest.importorskip("ipywidgets")
    latency = load("explorer_latency")
    latency.main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "latency.json").read_text())
    changes = result["changes"]
    assert [r["change"] for r in changes] == ["seq_len 64 -> 128", "seq_len 128 -> 256", "batch_size 1 -> 2",
                                              "policy none -> full", "seq_len 256 -> 128", "card rtx4090 -> a100-40"]
    assert result["median_s"] == median(r["seconds"] for r in changes)
    assert result["median_cpu_s"] == median(r["cpu_s"] for r in changes)
    assert all(r["seconds"] >= sum(p["predict_s"] for p in r["predictions"] if p["made_now"]) for r in changes)
    # each change predicts what it changed: the policy change keeps none's prediction, a shape or a card both
    made = [[p["policy"] for p in r["predictions"] if p["made_now"]] for r in changes]
    assert made == [["none"], ["none"], ["none"], ["full"], ["none", "full"], ["none", "full"]]
    assert "| policy none -> full |" in (tmp_path / "latency.md").read_text()
    assert "median change" in capsys.readouterr().out
