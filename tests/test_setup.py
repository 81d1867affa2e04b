"""The two commands and the environment files stay consistent with each other."""

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"requirements.txt must pin exact versions: {line!r}"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_requirements_pin_the_design_card_packages():
    pins = _requirements()
    for package in ["torch", "jupyterlab", "matplotlib", "ipywidgets", "nbval", "papermill", "pandas", "tqdm", "pytest"]:
        assert package in pins, package
    assert pins["torch"] == "2.13.0"  # no local label: resolves to CPU or CUDA build per machine


def test_environment_yml_installs_the_same_lock():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "conda-forge" in env["channels"]
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict))
    assert "-r requirements.txt" in pip_section and "-e ." in pip_section


def test_pyproject_dependencies_are_all_locked():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _requirements()
    extras = project["optional-dependencies"]
    declared = project["dependencies"] + [d for name, deps in extras.items() if name != "published" for d in deps]
    for requirement in declared:
        name = re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if name != "ckptlab":
            assert name in pins, f"{name} is declared in pyproject.toml but not pinned in requirements.txt"
    # The benchmark-only extra has its own lock, outside what `make test` installs.
    published = (ROOT / "benchmarks" / "requirements-published.txt").read_text().split()
    assert sorted(d for d in extras["published"] if not d.startswith("ckptlab")) == sorted(published)
    assert not {re.split(r"[=\[]", d)[0] for d in published} & set(pins)


def test_ci_runs_exactly_make_test():
    lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith("#")]
    assert lines[-1] == "make test"

