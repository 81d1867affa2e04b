"""Bad input, from the command line, the API and the notebook runner: one line naming the
parameter, the value and what is allowed (CLI: `error: ...`, exit 2), before any work — no
traceback, no model built on a real device, nothing written."""

import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

import ckptlab
from ckptlab import analysis, plots
from ckptlab.apps.cli import main
from ckptlab.apps.notebooks import check_parameters, find_notebook, run_notebooks
from ckptlab.core.units import parse_bytes, size_bytes, size_label
from ckptlab.core.validate import no_credential, output_folder, run_name
from ckptlab.run.store import RUN_MARKER, fresh_run_folder, load_run, read_meta
from ckptlab.workloads.base import Workload

FAKE_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123"


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working folder holding a file, an empty folder, a torn run and bad YAML files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "empty-run").mkdir()
    torn = tmp_path / "torn-run"
    torn.mkdir()
    (torn / "records.jsonl").write_text(json.dumps({"status": "ok"}) + "\n")
    (torn / "run.json").write_text('{"run": "torn-run", "grid": {"mod')
    (tmp_path / "malformed.yaml").write_text("01_quickstart: {batch_size: [1, 2\n")
    (tmp_path / "tagged.yaml").write_text("01_quickstart:\n  policy: !!python/object/apply:os.system ['echo hi']\n")
    return tmp_path


SWEEP = ["sweep", "--model", "mlp-chain", "--out", "o"]
NB = ["notebooks", "run", "01", "--out", "runs"]

CLI_CASES = [
    (SWEEP + ["--model", "gpt-tiny", "--set", "n_layer=abc"], "override n_layer='abc' is invalid: allowed is an integer >= 1"),
    (SWEEP + ["--model", "gpt-tiny", "--set", "n_layer=2.5"], "override n_layer=2.5 is invalid: allowed is an integer >= 1"),
    (SWEEP + ["--model", "gpt-tiny", "--set", "n_head=0"], "override n_head=0 is invalid: allowed is an integer >= 1"),
    (SWEEP + ["--model", "gpt-tiny", "--set", "n_embd=-128"], "override n_embd=-128 is invalid: allowed is an integer >= 1"),
    (SWEEP + ["--model", "gpt-tiny", "--set", "block_size=0"], "override block_size=0 is invalid: allowed is an integer >= 1"),
    (SWEEP + ["--memory-limit", "1e400"], "--memory-limit 1e400 is invalid: allowed is a positive size"),
    (SWEEP + ["--memory-limit", "0.5B"], "--memory-limit 0.5B is invalid: allowed is a positive size"),
    (SWEEP + ["--policy", "budget=1e400"], "budget=1e400 is invalid: allowed is a fraction in (0, 1]"),
    (["sweep", "--out", "afile"], "--out afile is invalid: it is an existing file"),
    (["sweep", "--out", "afile/run"], "--out afile/run is invalid: 'afile' is a file"),
    (["sweep", "--out", ""], "--out '' is invalid: allowed is a folder path"),
    (["compare", "--out", "afile"], "--out afile is invalid: it is an existing file"),
    (["compare", "--out", "afile/run"], "--out afile/run is invalid: 'afile' is a file"),
    (["sweep", "--out", "x" * 300], "is invalid: the name 'xxxx"),
    (SWEEP + ["--policy", "hf"], "--policy hf is invalid for --model mlp-chain: the hf policies apply"),
    (SWEEP + ["--policy", "layers=99"], "layers=99 is invalid for a model with 8 blocks"),
    (SWEEP + ["--policy", "every=9"], "every=9 is invalid for a model with 8 blocks: allowed is every=1..8"),
    (SWEEP + ["--batch", "0"], "--batch 0 is invalid: allowed is a comma-separated list of integers >= 1"),
    (SWEEP + ["--seq", "16,,32"], "--seq 16,,32 is invalid: allowed is a comma-separated list of integers >= 1"),
    (["predict", "--batch", "1,2,"], "--batch 1,2, is invalid: allowed is a comma-separated list of integers >= 1"),
    (["measure", "--policy", "none,,full"], "--policy none,,full is invalid: allowed is a comma-separated list, none empty"),
    (["measure", "--policy", "none,density=1.5"], "density=1.5 is invalid: allowed is a number in [0, 1] (in --policy "
     "none,density=1.5)"),
    (SWEEP + ["--device", "cpu:1"], "--device cpu:1 is invalid: allowed are cpu, cuda, cuda:N"),
    (["measure", "--device", "cpu:0"], "--device cpu:0 is invalid: allowed are cpu, cuda, cuda:N"),
    (["explain", "--card", "rtx4090", "--capacity", "100GiB"], "--capacity 100GiB is invalid with --card rtx4090: it "
     "is more than the 23.4 GiB the card's device bytes may reach"),
    (["measure", "--policy", ""], "--policy '' is invalid: allowed is a comma-separated list of policies"),
    (["measure", "--policy", "plan=kk"], "plan=kk is invalid for a model with 4 blocks"),
    (["measure", "--batch", ""], "--batch '' is invalid: allowed is a comma-separated list of integers >= 1"),
    (["measure", "--batch", "a"], "--batch a is invalid"),
    (["measure", "--batch", "2.5"], "--batch 2.5 is invalid"),
    (["measure", "--seq", "1,x"], "--seq 1,x is invalid"),
    (["predict", "--policy", ","], "--policy ',' is invalid"),
    (["plot", "empty-run"], "run_dir='empty-run' is invalid: it holds no records"),
    (["plot", "torn-run"], "torn-run/run.json is invalid: not readable as JSON"),
    (["plot", "missing-run"], "run_dir='missing-run' is invalid: no such run folder"),
    (NB[:3] + ["--out", "afile"], "--out afile is invalid: it is an existing file"),
    (NB[:3] + ["--out", ""], "--out '' is invalid"),
    (NB + ["--timeout", "-5"], "--timeout -5.0 is invalid: allowed is a finite number in (0, inf]"),
    (NB + ["--name", "../keep"], "--name ../keep is invalid: allowed is a folder name (one path component"),
    (NB + ["--name", ".."], "--name '..' is invalid"),
    (NB + ["--name", "."], "--name '.' is invalid"),
    (NB + ["--name", ""], "--name '' is invalid"),
    (NB + ["--name", "/tmp/keep"], "--name /tmp/keep is invalid"),
    (NB + ["-f", "malformed.yaml"], "-f malformed.yaml is invalid: malformed.yaml is not plain YAML"),
    (NB + ["-f", "tagged.yaml"], "-f tagged.yaml is invalid: tagged.yaml is not plain YAML"),
    (NB + ["-p", "batch_size", "[1, 2"], "-p batch_size '[1, 2' is invalid"),
    (NB + ["-p", "policy", "!!python/object/apply:os.system ['echo hi']"], "-p policy \"!!python/object/apply"),
    (NB + ["-p", "batch_size", "0"], "notebook 01_quickstart: batch_size=0 is invalid: allowed is an integer >= 1"),
    (NB + ["-p", "steps", "-1"], "notebook 01_quickstart: steps=-1 is invalid"),
    (NB + ["-p", "model", "gpt-huge"], "notebook 01_quickstart: model='gpt-huge' is invalid"),
    (NB + ["-p", "policy", "bogus"], "notebook 01_quickstart: policy='bogus' is invalid: unknown policy"),
    (NB + ["-p", "policy", "layers=9"], "notebook 01_quickstart: layers=9 is invalid for a model with 4 blocks"),
    (NB + ["-p", "policy", "hf"], "notebook 01_quickstart: policy='hf' is invalid for model='gpt-tiny'"),
    (NB + ["-p", "device", "tpu"], "notebook 01_quickstart: device='tpu' is invalid"),
    (NB + ["-p", "model", FAKE_TOKEN], "parameter model is invalid: its value looks like a credential"),
    (["notebooks", "run", "02", "--out", "runs", "-p", "densities", "[0.5, 2]"], "densities=2 is invalid"),
    # the library's parameters, named by the flags that set them, with what each allows on the command line
    (["predict", "--device", "cuda", "--torch-version", "2.3"], "--torch-version 2.3 is invalid: allowed are 2.4, 2.5"),
    (["predict", "--alloc-conf", "expandable_segments:True"],
     "--alloc-conf expandable_segments:True is invalid with --device cpu: a card"),
    (["predict", "--attention", "math"], "allowed is --device cuda"),
    (["predict", "--card", "h200", "--alloc-conf", "x"], "--alloc-conf x is invalid: allowed are "
     "expandable_segments:True, expandable_segments:False, or no --alloc-conf (the default allocator)"),
    (["predict", "--card", "rtx5090"], "--card rtx5090 is invalid: allowed are rtx3090"),
    (["predict", "--dtype", "fp8"], "--dtype fp8 is invalid: allowed are fp32"),
    (["predict", "--policy", "bogus"], "--policy bogus is invalid: unknown policy"),
    (["predict", "--grad-scaler"], "--grad-scaler is invalid with --dtype fp32: the grad scaler is for fp16 "
     "autocast; allowed is --dtype fp16, or no --grad-scaler"),
    (["predict", "--dtype", "fp16", "--grad-scaler", "--optimizer", "none"], "--grad-scaler is invalid with --optimizer none"),
    (["predict", "--clip-grad-norm", "0"], "--clip-grad-norm 0 is invalid: allowed is a finite max norm > 0, or no "
     "--clip-grad-norm (no clipping)"),
    (["plan", "--budget", "0.5", "--batch", "0"], "--batch 0 is invalid: allowed is an integer >= 1"),
    (["plan", "--budget", "0.5", "--seq", "100000"], "--seq 100000 is invalid for --model gpt-tiny: allowed is 1..256"),
    (["plan", "--budget", "0.5", "--cost", "guess"], "--cost guess is invalid: allowed are auto"),
    (["plan", "--budget", "0.5", "--torch-version", "2.3"], "--torch-version 2.3 is invalid"),
    (["plan", "--budget", "2.0"], "--budget 2.0 is invalid: allowed is a fraction in (0, 1] of the no-checkpointing "
     "peak, or a size such as 6GiB"),
    (["plan", "--budget", "lots"], "--budget lots is invalid: allowed is a fraction in (0, 1]"),
    (["explain", "--seq", "0"], "--seq 0 is invalid: allowed is an integer >= 1"),
    (["explain", "--ranks", "1"], "--ranks 1 is invalid: allowed is an integer >= 2"),
    (["explain", "--capacity", "lots"], "--capacity lots is invalid: allowed is a card"),
    (["explain", "--capacity", "h100-80", "--measure"], "--measure is invalid with --device cuda: the step is "
     "measured here, on the CPU; allowed is no --measure"),
    (["measure", "--steps", "0"], "--steps 0 is invalid: allowed is an integer >= 1"),
    (["measure", "--dtype", "fp8"], "--dtype fp8 is invalid: allowed are fp32"),
    (["compare", "--batch", "0"], "--batch 0 is invalid: allowed is an integer >= 1"),
    (["compare", "--target-ci", "2"], "--target-ci 2.0 is invalid"),
    (["compare", "--model", "gpt-huge"], "--model gpt-huge is invalid: allowed presets are"),
    (SWEEP + ["--executor", "submitit", "--cluster", "pbs"], "--cluster pbs is invalid: allowed are slurm, local, "
     "debug or no --cluster (auto)"),
]


@pytest.mark.parametrize("argv, message", CLI_CASES, ids=[" ".join(a)[:60] for a, _ in CLI_CASES])
def test_cli_bad_input_is_one_line_exit_2_nothing_written(workdir, capsys, argv, message):
    before = snapshot(workdir)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    assert message in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert snapshot(workdir) == before


def never_built_on_a_device(monkeypatch):
    built = []
    real = Workload.build
    monkeypatch.setattr(Workload, "build", lambda self, device="cpu": built.append(str(device)) or real(self, device))
    return built


API_CASES = [
    (lambda tmp: ckptlab.get_workload("gpt-tiny", n_embd=-128), "override n_embd=-128 is invalid"),
    (lambda tmp: ckptlab.get_workload("gpt-tiny", dropout=1.5), "override dropout=1.5 is invalid"),
    (lambda tmp: ckptlab.get_workload("gpt-tiny", bias="yes"), "override bias='yes' is invalid: allowed is true or false"),
    (lambda tmp: parse_bytes("1e400"), "memory_limit='1e400' is invalid"),
    (lambda tmp: parse_bytes(float("inf")), "memory_limit=inf is invalid"),
    (lambda tmp: parse_bytes("0.5B"), "memory_limit='0.5B' is invalid"),
    (lambda tmp: ckptlab.parse_policy("budget=1e400"), "budget=1e400 is invalid"),
    (lambda tmp: ckptlab.measure("gpt-tiny", 2, 16, "layers=99"), "layers=99 is invalid for a model with 4 blocks"),
    (lambda tmp: ckptlab.measure("gpt-tiny", 2, 16, "plan=kk"), "plan=kk is invalid for a model with 4 blocks"),
    (lambda tmp: ckptlab.measure("gpt-tiny", 2, 16, "hf"), "policy='hf' is invalid for model='gpt-tiny'"),
    (lambda tmp: ckptlab.measure("gpt-tiny", 2.0, 16), "batch_size=2.0 is invalid: allowed is an integer >= 1"),
    (lambda tmp: ckptlab.measure("gpt-tiny", 2, 16, dtype="fp8"), "dtype='fp8' is invalid: allowed are fp32, bf16"),
    (lambda tmp: ckptlab.sweep(model="mlp-chain", out=tmp / "afile"), "out="),
    (lambda tmp: ckptlab.sweep(model="mlp-chain", out=""), "out='' is invalid"),
    (lambda tmp: ckptlab.sweep(model="mlp-chain", policies=["hf"], out=tmp / "o"), "policy='hf' is invalid"),
    (lambda tmp: ckptlab.sweep(model="mlp-chain", policies=[], out=tmp / "o"), "policies=[] is invalid"),
    (lambda tmp: ckptlab.sweep(model="mlp-chain", batch_sizes=[1, "a"], out=tmp / "o"), "batch_sizes=[1, 'a'] is invalid"),
    (lambda tmp: ckptlab.sweep(model="mlp-chain", model_overrides={"n_embd": "x"}, out=tmp / "o"), "override n_embd='x'"),
    (lambda tmp: analysis.summary(load_run(tmp / "empty-run")), "df is invalid: the run holds no records yet"),
    (lambda tmp: plots.redraw_all(tmp / "empty-run"), "holds no records"),
    (lambda tmp: read_meta(tmp / "torn-run"), "torn-run/run.json is invalid: not readable as JSON"),
]


@pytest.mark.filterwarnings("ignore:run folder 'empty-run' has no run.json")
@pytest.mark.parametrize("call, message", API_CASES, ids=[m[:40] for _, m in API_CASES])
def test_api_bad_input_raises_value_error_before_work(workdir, monkeypatch, call, message):
    built = never_built_on_a_device(monkeypatch)
    before = snapshot(workdir)
    with pytest.raises(ValueError) as err:
        call(workdir)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert set(built) <= {"meta"}, f"a model was built on {built} for a usage error"
    assert snapshot(workdir) == before


RUNNER_CASES = [
    (dict(run_name="../keep"), "run_name='../keep' is invalid"),
    (dict(run_name="a/b"), "run_name='a/b' is invalid"),
    (dict(run_name=""), "run_name='' is invalid"),
    (dict(timeout_s=-5), "timeout_s=-5 is invalid"),
    (dict(timeout_s=float("nan")), "timeout_s=nan is invalid"),
    (dict(out=""), "out='' is invalid"),
    (dict(overrides={"batch_size": 0}), "notebook 01_quickstart: batch_size=0 is invalid"),
    (dict(overrides={"memory_limit": "0.1B"}), "is invalid for notebook 01_quickstart"),  # not a parameter of 01
    (dict(overrides={"seq_len": 100000}), "seq_len=100000 is invalid"),
    (dict(overrides={"policy": "density=1.5"}), "density=1.5 is invalid"),
    (dict(overrides={"model": f"gpt-tiny-{FAKE_TOKEN}"}), "looks like a credential"),
    (dict(param_set="malformed.yaml"), "malformed.yaml is not plain YAML"),
]


@pytest.mark.parametrize("options, message", RUNNER_CASES, ids=[m[:40] for _, m in RUNNER_CASES])
def test_notebook_runner_bad_input_before_any_kernel(workdir, options, message):
    options = {"out": workdir / "runs", **options}
    before = snapshot(workdir)
    with pytest.raises(ValueError, match="invalid|credential") as err:
        run_notebooks(["01"], **options)
    assert message in str(err.value)
    assert snapshot(workdir) == before


# ----------------------------------------------------------------------------- nothing lost

def test_run_name_that_is_a_path_deletes_nothing(tmp_path, capsys):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data.txt").write_text("x\n")
    runs = tmp_path / "runs"
    (runs / "02_density_sweep" / "default").mkdir(parents=True)
    (runs / "02_density_sweep" / "default" / "records.jsonl").write_text("{}\n")
    for name in (str(keep), "..", "../keep"):
        assert main(["notebooks", "run", "01", "--out", str(runs), "--name", name]) == 2
        assert "is invalid: allowed is a folder name" in capsys.readouterr().err
    assert (keep / "data.txt").read_text() == "x\n"
    assert (runs / "02_density_sweep" / "default" / "records.jsonl").exists()


def test_a_folder_ckptlab_did_not_make_is_never_replaced(tmp_path):
    mine = tmp_path / "runs" / "01_quickstart" / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match=f"was not made by ckptlab \\(no {RUN_MARKER} file in it\\)"):
        run_notebooks(["01"], out=tmp_path / "runs", run_name="mine")
    assert (mine / "notes.txt").read_text() == "mine\n"
    link = tmp_path / "runs" / "01_quickstart" / "link"
    link.symlink_to(mine)
    with pytest.raises(ValueError, match="was not made by ckptlab"):
        fresh_run_folder(link)
    assert (mine / "notes.txt").exists()


def test_a_run_folder_ckptlab_made_is_replaced(tmp_path):
    run = fresh_run_folder(tmp_path / "01_quickstart" / "default")
    assert (run / RUN_MARKER).is_file()
    (run / "old.png").write_bytes(b"png")
    assert fresh_run_folder(run) == run
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER]


# ----------------------------------------------------------------------------- values, one rule each

def test_equal_values_name_one_cell():
    assert ckptlab.parse_policy("density=-0") == ckptlab.parse_policy("density=0")
    assert str(ckptlab.parse_policy("density=-0")) == "density=0.0"
    assert str(ckptlab.parse_policy("compile:budget=-0")) == "compile:budget=0.0"


@pytest.mark.parametrize("text, label", [("budget=1e30", "budget=909494701772928256TiB"), ("budget=6GiB", "budget=6GiB"),
                                         ("budget=1e9", "budget=1GB"), ("budget=1500", "budget=1500B")])
def test_budget_labels_read_as_sizes_and_parse_back(text, label):
    policy = ckptlab.parse_policy(text)
    assert str(policy) == label and ckptlab.parse_policy(label) == policy


def test_size_label_round_trips():
    for n in (1, 1023, 1024, 1536, 10**6, 3 * 2**30, 5 * 10**12, 2**40 + 1):
        assert size_bytes("x", size_label(n)) == n


def test_load_run_skips_lines_that_are_not_objects_and_warns_without_run_json(tmp_path):
    (tmp_path / "records.jsonl").write_text('{"status": "ok", "peak_bytes": 1}\n5\n[1, 2]\n"text"\nnull\n')
    with pytest.warns(RuntimeWarning) as caught:
        df = load_run(tmp_path)
    messages = [str(w.message) for w in caught]
    assert any("has no run.json" in m for m in messages)
    assert sum("not a record (an object)" in m for m in messages) == 4
    assert list(df["peak_bytes"]) == [1]


def test_output_folder_refuses_an_unwritable_place(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        import os
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: every folder is writable")
        with pytest.raises(ValueError, match="is not writable"):
            output_folder("out", locked / "run")
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("value", ["hf_AbCdEfGhIjKlMnOpQrStUvWx", "sk-ant-api03-abcdefghijklmnopqrstuvwxyz",
                                   "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "AKIAABCDEFGHIJKLMNOP",
                                   "-----BEGIN RSA PRIVATE KEY-----", "q8Zr3Lx0Vb7Tn2Kw5Hy9Md4Pf6Gs1Jc0",
                                   ["none", "xoxb-1234567890-abcdefghij"], {"token": "hf_AbCdEfGhIjKlMnOpQrStUvWx"}])
def test_credentials_are_refused(value):
    with pytest.raises(ValueError, match="looks like a credential") as err:
        no_credential("parameter secret", value)
    assert "AbCd" not in str(err.value) and "abcdef" not in str(err.value)


@pytest.mark.parametrize("value", ["plan=kkssffkkssffkkssffkkssffkkssffkk", "results/sweep-20261130-000000",
                                   "density=0.5+offload", "hf-llama-tiny", "24GiB", "0123456789abcdef0123456789abcdef",
                                   "budget=909494701772928256TiB"])
def test_ordinary_values_are_not_credentials(value):
    no_credential("parameter p", value)


@pytest.mark.parametrize("value", ["a", "a.b", "run-1", "défaut"])
def test_run_names_that_are_one_component(value):
    assert run_name("run_name", value) == value


def test_format_summary_of_an_empty_run_says_zero_cells():
    empty = pd.DataFrame()
    assert analysis.format_summary(empty).startswith("0 cells")


def test_a_scalar_parameter_whose_name_is_a_list_elsewhere_is_checked_as_a_scalar():
    # 09's accum_steps is one int, 04's a list: both are checked by the same rule.
    check_parameters(find_notebook("09"), {"accum_steps": 4})
    with pytest.raises(ValueError, match="accum_steps"):
        check_parameters(find_notebook("09"), {"accum_steps": 0})


def test_a_notebooks_loop_parameter_is_checked_as_the_command_line_checks_it():
    check_parameters(find_notebook("11"), {"loop": "adamw-fused,accum=2,holds-output"})
    with pytest.raises(ValueError, match=r"^notebook 11_why_memory_did_not_drop: accum_steps=0 is invalid: allowed is an"):
        check_parameters(find_notebook("11"), {"loop": "adamw,accum=0"})


@pytest.mark.parametrize("budget", ["lots", "2.0", "-1GiB", "0"])
def test_a_bad_budget_is_refused_before_the_model_is_profiled(monkeypatch, budget):
    monkeypatch.setattr("ckptlab.plan.budget.profile_blocks", lambda *a, **k: pytest.fail("profiled"))
    with pytest.raises(ValueError, match=f"budget={budget} is invalid"):
        ckptlab.plan_budget("gpt-tiny", 2, 16, budget)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, a file system no folder can be made in")
@pytest.mark.parametrize("command", [["sweep", "--model", "mlp-chain"], ["compare", "--model", "mlp-chain"]])
def test_an_out_folder_the_system_refuses_is_refused_before_any_work(command, capsys, monkeypatch):
    # as root, permissions let everything through: the folder is made before any work, and its refusal named
    built = never_built_on_a_device(monkeypatch)
    assert main(command + ["--out", "/proc/ckptlab-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --out /proc/ckptlab-run is invalid: it cannot be made (No such file or directory); allowed "
                   "is a folder you can write to"]
    assert set(built) <= {"meta"}


class _Vectors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_loss_of_more_than_one_value_is_one_line_from_predict_and_measure():
    per_token = ckptlab.Workload.custom("per-token", build_model=_Vectors, loss=lambda m, b: m(b[0]).square().mean(-1),
                                        make_batch=lambda b, s, g: (torch.randn(b, s, 16, generator=g),))
    message = ("the loss of model='per-token' is invalid: it returned a tensor of shape (2, 8); allowed is a tensor of "
               "one value")
    with pytest.raises(ValueError, match=re.escape(message)):
        ckptlab.predict(per_token, 2, 8, "full")
    record = ckptlab.measure(per_token, 2, 8, "full", steps=1, warmup=0)
    assert record["status"] == "error" and message in record["message"]
