"""Installing ckptlab into your own environment: the package's files, one clear line for a
missing optional extra, notebooks only from a clone, and a wheel with only the core
dependencies that imports and measures (slow: `pytest -m slow tests/test_install.py`)."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import tomllib

import ckptlab
from ckptlab.apps import notebooks
from ckptlab.apps.cli import main
from ckptlab.core.extras import EXTRA_OF, MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TINY = ["--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2", "--batch", "2", "--seq", "16",
        "--steps", "1", "--warmup", "0", "--max-seconds", "1"]


def test_license_changelog_and_typing_marker():
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert f"## {ckptlab.__version__}" in (ROOT / "CHANGELOG.md").read_text()
    assert PROJECT["version"] == ckptlab.__version__
    assert (ROOT / "ckptlab" / "py.typed").exists()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["ckptlab"]


def test_every_extra_named_in_errors_exists_and_installs_its_module():
    extras = PROJECT["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert any(dep.split("[")[0].split("=")[0].split(">")[0] == module for dep in extras[extra]), (module, extra)


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "papermill", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"running notebooks needs papermill, which is not installed: "
                                                r"pip install 'ckptlab\[notebooks\]'"):
        require("papermill", "running notebooks")


def test_missing_nbformat_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "nbformat", None)
    assert main(["notebooks", "params", "01"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'ckptlab[notebooks]'" in err


def test_missing_transformers_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "ckptlab.workloads.hf", raising=False)
    monkeypatch.delattr(ckptlab.workloads, "hf", raising=False)  # as if never imported
    assert main(["measure", "--model", "hf-gpt2-tiny", *TINY[6:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'ckptlab[hf]'" in err


def test_missing_submitit_names_the_extra(monkeypatch, tmp_path):
    from ckptlab.run.config import job_options

    monkeypatch.setitem(sys.modules, "submitit", None)
    with pytest.raises(ValueError, match=r"^executor='submitit' needs submitit: pip install 'ckptlab\[cluster\]'$"):
        job_options(tmp_path / "run")


def test_notebooks_outside_a_clone_say_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(notebooks, "IN_CLONE", False)
    for argv in (["notebooks", "params", "01"], ["notebooks", "run", "01"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "clone the repository" in err


@pytest.mark.slow
def test_wheel_with_only_core_dependencies_measures(tmp_path):
    """Build the wheel, install it into a fresh venv (no system site-packages) with only the core
    dependencies at the lock's versions, and use it from an unrelated folder. Minutes: the venv
    installs torch."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True)
    (wheel,) = dist.glob("ckptlab-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    bin_dir = env_dir / "bin"
    subprocess.run([bin_dir / "pip", "install", "-q", "-c", ROOT / "requirements.txt", wheel], check=True)
    installed = subprocess.run([bin_dir / "pip", "list", "--format", "json"], capture_output=True, text=True, check=True)
    names = {p["name"].lower() for p in json.loads(installed.stdout)}
    assert not names & {"nbformat", "papermill", "transformers", "submitit", "jupyterlab"}  # core only
    work = tmp_path / "work"
    work.mkdir()

    def ckptlab_cli(*args):
        return subprocess.run([bin_dir / "ckptlab", *args], capture_output=True, text=True, cwd=work)

    measured = ckptlab_cli("measure", *TINY, "--policy", "none,full", "--format", "json")
    assert measured.returncode == 0, measured.stderr
    rows = json.loads(measured.stdout)
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[1]["peak_bytes"] < rows[0]["peak_bytes"]
    for args, words in [(("notebooks", "params", "01"), "clone the repository"),
                        (("measure", "--model", "hf-gpt2-tiny"), "pip install 'ckptlab[hf]'")]:
        result = ckptlab_cli(*args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
    where = subprocess.run([bin_dir / "python", "-c", "from ckptlab.apps import notebooks; print(notebooks.RESULTS.resolve())"],
                           capture_output=True, text=True, cwd=work, check=True)
    assert where.stdout.strip() == str((work / "results").resolve())  # not inside site-packages
    assert list(env_dir.glob("lib/python*/site-packages/ckptlab/py.typed"))


def test_import_ckptlab_loads_no_pandas_plotting_or_notebook_stack():
    # explain's report, imported too, draws only when asked: no plotting library either.
    code = ("import sys, ckptlab; heavy = [m for m in ('pandas', 'matplotlib', 'ipywidgets', 'papermill', "
            "'torch.distributed.fsdp') if m in sys.modules]; assert not heavy, heavy; "
            "import ckptlab.report.explain; assert 'matplotlib' not in sys.modules; "
            "assert ckptlab.sweep.__module__ == 'ckptlab.run.sweep' and 'pandas' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
