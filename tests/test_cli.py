"""The command line: real output for good input, exit 2 and one clear line for bad input."""

import csv
import io
import json

import pytest

from ckptlab.apps.cli import HF_PRESET_NAMES, POLICY_EXAMPLES, main
from ckptlab.core.parsing import split_list
from ckptlab.core.policy import parse_policy
from ckptlab.workloads.models import PRESETS
from ckptlab.workloads.registry import get_workload

TINY = ["--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2"]


def test_measure_prints_a_table_with_overhead(capsys):
    assert main(["measure", *TINY, "--batch", "2", "--seq", "16", "--policy", "none,layers=0,1",
                 "--steps", "1", "--warmup", "0", "--max-seconds", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("gpt-tiny on ") and "policy" in lines[1] and "overhead [95% CI]" in lines[1]
    assert lines[3].split()[:2] == ["none", "0.00"] and "+0% [+0%, +0%]" in lines[3]
    assert lines[4].split()[:2] == ["layers=0,1", "1.00"]


def test_bad_input_exits_2_with_one_clear_line(capsys):
    assert main(["measure", "--policy", "density=2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --policy density=2 is invalid: allowed is a number in [0, 1]"
    assert main(["measure", "--set", "n_layers=2"]) == 2
    assert "override n_layers=2 is invalid for --model gpt-tiny" in capsys.readouterr().err
    assert main(["plan", "--compile", "--budget", "0.5", "--options", "fx"]) == 2
    assert capsys.readouterr().err.startswith("error: --options fx is invalid: allowed are plan letters k, s, f")
    assert main(["plan", "--compile", "--budget", "lots"]) == 2
    assert "--budget lots is invalid" in capsys.readouterr().err


def test_predict_and_plan(capsys):
    assert main(["predict", *TINY, "--batch", "2", "--seq", "16", "--policy", "none,full"]) == 0
    out = capsys.readouterr().out
    assert "none" in out and "full" in out
    n_params = get_workload("gpt-tiny", n_layer=2, n_embd=32, n_head=2).n_params
    assert n_params < 10**6 and out.startswith(f"gpt-tiny ({n_params:,} parameters), fp32")   # a small model exactly
    assert main(["plan", *TINY, "--batch", "2", "--seq", "16", "--budget", "1.0"]) == 0
    assert "plan " in capsys.readouterr().out


def test_tables_name_a_budget_in_bytes_by_its_size(capsys):
    assert main(["predict", *TINY, "--batch", "2", "--seq", "16", "--policy", "budget=100000001"]) == 0
    out = capsys.readouterr().out
    assert "budget=95.4MiB" in out and "100000001" not in out


def test_split_list_keeps_layer_indices_together():
    assert split_list("none,layers=0,2,density=0.5") == ["none", "layers=0,2", "density=0.5"]
    assert split_list("1, 2,4") == ["1", "2", "4"]


def test_version(capsys):
    import ckptlab

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"ckptlab {ckptlab.__version__}"


def test_help_lists_presets_policies_with_examples_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for preset in [*PRESETS, *HF_PRESET_NAMES]:
        assert preset in out
    for example, _ in POLICY_EXAMPLES:
        assert f"  {example} " in out
        parse_policy(example)  # every example is a policy that parses
    table = out[out.index("exit codes:"):].splitlines()[1:]
    assert [line.split()[0] for line in table] == ["0", "1", "2", "3"]
    assert "usage error" in table[2] and "in use" in table[3]


def test_hf_preset_names_match_the_hf_module():
    hf = pytest.importorskip("ckptlab.workloads.hf")
    assert tuple(hf.HF_PRESETS) == HF_PRESET_NAMES


def test_measure_help_says_dtype_takes_one_value(capsys):
    with pytest.raises(SystemExit):
        main(["measure", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--dtype DTYPE one of fp32 | bf16" in out and "comma-separated for sweeps" not in out
    assert "--accum" in out and "--optimizer" in out and "--format {table,json,csv}" in out


def test_measure_accum_and_optimizer_reach_the_record(capsys):
    assert main(["measure", *TINY, "--batch", "2", "--seq", "16", "--policy", "none", "--steps", "1",
                 "--warmup", "0", "--max-seconds", "1", "--accum", "2", "--optimizer", "sgd", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["accum_steps"] == 2 and row["effective_batch_size"] == 4 and row["optimizer"] == "sgd"
    assert row["status"] == "ok" and row["peak_bytes"] > 0


def test_measure_with_accumulation_counts_recomputes_per_optimizer_step(capsys):
    assert main(["measure", *TINY, "--batch", "2", "--seq", "16", "--policy", "full", "--steps", "1",
                 "--warmup", "0", "--max-seconds", "1", "--accum", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    label = "recomputed blocks/step (2 micro-batches)"
    end = lines[1].index(label) + len(label)            # cells are right-aligned under their header
    assert lines[3][:end].split()[-1] == "4"   # 2 blocks, each recomputed in each micro-batch's backward


def test_measure_csv_has_a_header_and_one_line_per_record(capsys):
    assert main(["measure", *TINY, "--batch", "2", "--seq", "16", "--policy", "none,full", "--steps", "1",
                 "--warmup", "0", "--max-seconds", "1", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["policy"] for r in rows] == ["none", "full"]
    assert float(rows[0]["time_ratio"]) == 1 and float(rows[1]["time_ratio_low"]) <= float(rows[1]["time_ratio"])
    assert int(rows[1]["peak_bytes"]) < int(rows[0]["peak_bytes"])


def test_predict_and_plan_as_json(capsys):
    assert main(["predict", *TINY, "--batch", "2", "--seq", "16", "--policy", "none,full", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["none", "full"]
    assert rows[1]["predicted_peak_bytes"] < rows[0]["predicted_peak_bytes"]
    assert main(["plan", *TINY, "--batch", "2", "--seq", "16", "--budget", "1.0", "--format", "json"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)
    assert plan["policy"] == "plan=" + plan["plan"] and len(plan["plan"]) == 2
    assert plan["plan_predicted_peak_bytes"] <= plan["plan_none_peak_bytes"]


def test_compare_as_json_and_csv_keeps_stdout_to_the_rows(capsys):
    compare = ["compare", *TINY, "--batch", "1", "--seq", "16", "--policy", "none,full", "--max-seconds", "0.3",
               "--threads", "1"]
    assert main([*compare, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["none", "full"]
    assert rows[0]["time_ratio"] == 1 and rows[1]["time_ratio_low"] <= rows[1]["time_ratio"] <= rows[1]["time_ratio_high"]
    assert rows[1]["peak_bytes"] > 0 and isinstance(rows[1]["significant"], bool) and rows[1]["rounds"] >= 1
    assert main([*compare, "--format", "csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["policy"] for r in table] == ["none", "full"] and float(table[1]["rounds"]) >= 1
    assert {"step_ms_low", "step_ms_high", "time_ratio_low", "time_ratio_high"} <= set(table[0])


@pytest.mark.parametrize("argv", [["measure", "--format", "xml"], ["compare", "--format", "xml"], ["measure", "--accum", "two"],
                                  ["measure", "--batch", "2,x"], ["measure", "--optimizer", "lion"],
                                  ["predict", "--attention", "fast"], ["predict", "--trace", "slow"], ["bogus"]])
def test_usage_errors_exit_2(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and argv[-1] in err   # one line, naming the value


@pytest.mark.parametrize("argv, says", [
    (["fits", "--workers", "two"], "error: --workers two is invalid: allowed is an integer"),
    (["measure", "--steps", "1.5"], "error: --steps 1.5 is invalid: allowed is an integer"),
    (["compare", "--max-seconds", "lots"], "error: --max-seconds lots is invalid: allowed is a number"),
    # an option the command lacks: the nearest one it has (fits' --cards is predict's --card), else what it took
    (["predict", "--cards", "rtx4090"], "error: ckptlab predict: --cards is not an option here: did you mean "
                                        "--card? (ckptlab predict --help lists them)"),
    (["explain", "--polcy=full"], "error: ckptlab explain: --polcy is not an option here: did you mean --policy? "
                                  "(ckptlab explain --help lists them)"),
    (["fits", "--capacity", "24GiB"], "error: ckptlab fits: --capacity is not an option here: did you mean "
                                      "--cards? (ckptlab fits --help lists them)"),
    (["predict", "--gpu", "h100-80"], "error: ckptlab predict: unrecognized arguments: --gpu h100-80 "
                                      "(ckptlab predict --help lists what it takes)"),
])
def test_a_number_argparse_refuses_is_said_as_ckptlabs_checks_say_theirs(argv, says, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and capsys.readouterr().err == says + "\n"


def test_sweep_into_a_folder_in_use_exits_3(tmp_path, capsys):
    from ckptlab.run.store import RunWriter

    out = tmp_path / "run"
    with RunWriter(out):
        code = main(["sweep", "--model", "mlp-chain", "--batch", "1", "--seq", "8", "--policy", "none",
                     "--steps", "1", "--warmup", "0", "--out", str(out), "--no-progress", "--no-plots"])
    assert code == 3
    assert "in use" in capsys.readouterr().err
