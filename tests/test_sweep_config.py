"""SweepConfig: one dataclass behind sweep(**fields), YAML files and the command line's flags."""

import dataclasses
import json
from pathlib import Path

import pytest

from ckptlab import SweepConfig, sweep
from ckptlab.apps.cli import build_parser, config_from_arguments, main
from ckptlab.core.parsing import attribute_docs

TINY = dict(model="mlp-chain", batch_sizes=[1], seq_lens=[8], policies=["none"], steps=1, warmup=0, max_seconds=0.2)


def test_creation_validates_and_normalizes(tmp_path):
    config = SweepConfig(batch_sizes=[4, 1, 4], policies=["density=1", "none", "density=1.0"], memory_limit="1KiB",
                         out=tmp_path / "run")
    assert config.batch_sizes == [1, 4]
    assert config.policies == ["density=1.0", "none"]      # canonical spelling, first seen first, no repeats
    assert config.memory_limit == 1024 and config.isolate is False and config.device == "cpu"
    assert len(config.cells()) == 2 * 1 * 2
    with pytest.raises(ValueError, match=r"cells_per_job=0 is invalid: allowed is an integer >= 1"):
        SweepConfig(executor="submitit", cluster="local", cells_per_job=0, out=tmp_path)
    with pytest.raises(ValueError, match=r"progress='no' is invalid: allowed are True, False"):
        SweepConfig(progress="no", out=tmp_path)
    with pytest.raises(ValueError, match=r"cell_timeout_s=0 is invalid"):
        SweepConfig(cell_timeout_s=0, out=tmp_path)


def test_every_field_is_documented_and_every_flagged_field_has_its_own_flag():
    fields = dataclasses.fields(SweepConfig)
    docs = attribute_docs(SweepConfig)
    assert set(docs) == {f.name for f in fields} and all(len(text) > 10 for text in docs.values())
    flags = [f.metadata["flag"] for f in fields if "flag" in f.metadata]
    # all but the computed model_hash and the loop, whose flags are the loop's on every command
    assert len(flags) == len(set(flags)) and len(flags) == len(fields) - 2
    help_text = build_parser()._subparsers._group_actions[0].choices["sweep"].format_help()
    assert all(flag in help_text for flag in flags) and docs["cells_per_job"] in " ".join(help_text.split())
    assert all(flag in help_text for flag in ("--optimizer", "--holds-output", "--zero-grad", "--clip-grad-norm",
                                              "--grad-scaler"))


def test_a_sweeps_loop_comes_from_its_flags_or_its_file_and_its_accumulation_from_the_grid(tmp_path):
    args = build_parser().parse_args(["sweep", "--model", "mlp-chain", "--accum", "1,2", "--optimizer", "sgd",
                                      "--zero-grad", "zeros", "--out", str(tmp_path / "run")])
    config = config_from_arguments(SweepConfig, args)
    assert str(config.loop) == "sgd,zero-grad=zeros" and config.accum_steps == [1, 2]
    assert [str(config.cell_loop(c)) for c in config.cells()][-1] == "sgd,accum=2,zero-grad=zeros"
    assert SweepConfig.from_dict(config.to_dict()).loop == config.loop
    with pytest.raises(ValueError, match=r"loop='adamw,accum=2' is invalid in a sweep: its accumulation is the grid"):
        SweepConfig(model="mlp-chain", loop="adamw,accum=2", out=tmp_path / "other")


def test_yaml_file_and_flags_make_the_same_config(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("model: mlp-chain\nbatch_sizes: [2, 1]\nseq_lens: [8]\npolicies: [none, full]\nsteps: 2\n")
    from_file = SweepConfig.from_yaml(path)
    assert from_file.batch_sizes == [1, 2] and from_file.policies == ["none", "full"] and from_file.steps == 2

    seen = {}

    def fake_sweep(config):
        seen["config"] = config
        raise ValueError("stop here")

    import ckptlab.apps.cli as cli
    original, cli.sweep = cli.sweep, fake_sweep
    try:
        assert main(["sweep", "--config", str(path), "--batch", "4", "--out", str(tmp_path / "o")]) == 2
    finally:
        cli.sweep = original
    config = seen["config"]
    assert config.batch_sizes == [4] and config.policies == ["none", "full"] and config.steps == 2   # flag wins
    assert config.resume is False   # the command line refuses a folder with records unless --resume


@pytest.mark.parametrize("text, message", [
    ("batch: [1]\n", "'batch' is invalid: allowed are model, model_overrides, batch_sizes"),
    ("batch_sizes: [1, 2\n", "is not plain YAML"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("policy: !!python/object/apply:os.system ['echo hi']\n", "is not plain YAML"),
    ("batch_sizes: [0]\n", "batch_sizes=[0] is invalid"),
    ("policies: [bogus]\n", "policy='bogus' is invalid"),     # the file's key, not the flag, which was not typed
    ("loop: sgd,scaler\n", "grad_scaler=True is invalid with --dtype fp32"),
])
def test_a_bad_config_file_is_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(text)
    assert main(["sweep", "--config", "bad.yaml", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_sweep_takes_a_config_or_fields_not_both(tmp_path):
    with pytest.raises(ValueError, match=r"'batch' is invalid: allowed are model"):
        sweep(batch=[1], out=tmp_path / "run")
    config = SweepConfig(**TINY, out=tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=r"steps=\.\.\. is invalid together with config="):
        sweep(config, steps=2)
    df = sweep(config)
    assert list(df["status"]) == ["ok"]
    saved = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert saved["batch_sizes"] == [1] and "out" not in saved    # no paths in run.json


def test_a_run_folder_from_before_the_config_resumes(tmp_path):
    # run.json once held the grid under "grid", the limit as memory_limit_bytes.
    out = tmp_path / "run"
    sweep(**TINY, out=out, progress=False)
    meta = json.loads((out / "run.json").read_text())
    saved = meta.pop("config")
    saved["memory_limit_bytes"] = saved.pop("memory_limit")
    (out / "run.json").write_text(json.dumps({**meta, "grid": saved}))
    df = sweep(**{**TINY, "policies": ["none", "full"]}, out=out, progress=False)
    assert len(df) == 2
    with pytest.raises(ValueError, match=r"memory_limit=1024 is invalid for resuming"):
        sweep(**TINY, memory_limit=1024, out=out, progress=False)


def test_a_restored_config_refuses_a_model_file_that_changed(tmp_path):
    model_file = tmp_path / "model.py"
    model_file.write_text((Path(__file__).parent / "custom_model.py").read_text())
    config = SweepConfig(model=f"{model_file}:scheduled", policies=["none"], out=tmp_path / "run")
    saved = config.to_dict()
    assert SweepConfig.from_dict(saved).model_hash == config.model_hash
    model_file.write_text(model_file.read_text() + "\n# edited\n")
    with pytest.raises(ValueError, match=r"its file changed"):
        SweepConfig.from_dict(saved)
