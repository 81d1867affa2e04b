"""The command line: real output for good input, exit 2 and one clear line for bad input."""

from ckptlab.apps.cli import main
from ckptlab.core.parsing import split_list

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
    assert capsys.readouterr().err.strip() == "error: density=2 is invalid: allowed is a number in [0, 1]"
    assert main(["measure", "--set", "n_layers=2"]) == 2
    assert "override n_layers=2 is invalid for model='gpt-tiny'" in capsys.readouterr().err


def test_predict_and_plan(capsys):
    assert main(["predict", *TINY, "--batch", "2", "--seq", "16", "--policy", "none,full"]) == 0
    out = capsys.readouterr().out
    assert "none" in out and "full" in out
    assert main(["plan", *TINY, "--batch", "2", "--seq", "16", "--budget", "1.0"]) == 0
    assert "plan " in capsys.readouterr().out


def test_split_list_keeps_layer_indices_together():
    assert split_list("none,layers=0,2,density=0.5") == ["none", "layers=0,2", "density=0.5"]
    assert split_list("1, 2,4") == ["1", "2", "4"]
