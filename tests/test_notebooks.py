"""Notebooks: clean in git, parameters checked, executed by papermill with values read back
(the scikit-hep/pyhf pattern). nbval executes every notebook separately (`make test`)."""

import ast
import json
import re
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest

from ckptlab.apps.cli import main as cli_main
from ckptlab.apps.notebooks import (
    ROOT,
    check_parameters,
    find_notebook,
    list_notebooks,
    load_param_set,
    notebook_parameters,
    run_notebooks,
    write_results_index,
)

NOTEBOOKS = list_notebooks()


def test_the_numbered_notebooks_exist():
    numbers = [p.stem[:2] for p in NOTEBOOKS]
    assert len(set(numbers)) == len(numbers)
    assert numbers == ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_in_git_are_clean(path):
    book = nbformat.read(str(path), as_version=4)
    assert book.metadata["kernelspec"]["name"] == "python3"
    tagged = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    for cell in book.cells:
        if cell.cell_type != "code":
            continue
        if "# NBVAL_CHECK_OUTPUT" in cell.source:
            # deterministic output that nbval compares: bytes only, no times
            text = "".join(o.get("text", "") for o in cell.outputs)
            assert text and " ms" not in text
        else:
            assert cell.outputs == [], f"volatile output committed in {path.stem}: {cell.source[:60]!r}"
            assert cell.execution_count is None, "executed notebook committed"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_opens_with_the_question_it_answers(path):
    first = nbformat.read(str(path), as_version=4).cells[0]
    title, _, rest = first.source.partition("\n\n")
    assert first.cell_type == "markdown" and title.startswith(f"# {path.stem[:2]} · ")
    sentence = re.split(r"(?<=[.?!])\s", rest.strip(), maxsplit=1)[0]
    assert sentence.endswith("?"), f"{path.stem}: the first sentence is not a question: {sentence!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_cell_is_literal_typed_and_documented(path):
    params = notebook_parameters(path)
    assert "run_dir" in params and params["run_dir"].type == "Optional[str]"
    for p in params.values():
        ast.literal_eval(p.default)          # literal values only
        assert "|" not in p.type, "use Optional[X], not X | None (papermill)"
        assert p.help, f"{p.name} has no '# help' comment"


def test_parameters_are_checked_before_running(tmp_path):
    path = find_notebook("01")
    check_parameters(path, {"batch_size": 2, "policy": "full", "run_dir": None})
    with pytest.raises(ValueError, match="parameter 'batchsize' is invalid for notebook 01_quickstart: allowed are model: str"):
        check_parameters(path, {"batchsize": 2})
    with pytest.raises(ValueError, match=r"parameter batch_size='2' is invalid .* allowed is a value of type int"):
        check_parameters(path, {"batch_size": "2"})
    with pytest.raises(ValueError, match="densities=\\['a'\\] is invalid .* List\\[float\\]"):
        check_parameters(find_notebook("02"), {"densities": ["a"]})
    with pytest.raises(ValueError, match=r"notebook='99' is invalid: allowed are a number 1-11, a name \(01_quickstart"):
        find_notebook("99")
    # A notebook by its number with or without its zero, or by its name without the number.
    assert find_notebook("7") == find_notebook("07") == find_notebook("predict_and_plan") == find_notebook("07_predict_and_plan")
    with pytest.raises(ValueError, match=r"notebook='lorra' is invalid \(did you mean lora\?\)"):
        find_notebook("lorra")
    # Unknown names are refused before any notebook runs: nothing is written.
    with pytest.raises(ValueError, match="parameter 'nope' is invalid"):
        run_notebooks(["01"], overrides={"nope": 1}, out=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_papermill_run_reads_back_the_parameters_it_was_given(tmp_path, monkeypatch):
    # The model is a file of the user's own (a spec, relative to where they stand): the kernel,
    # which runs in the project, loads the same file.
    monkeypatch.chdir(ROOT)
    spec = "tests/custom_model.py:factory"
    runs = run_notebooks(["01"], overrides={"model": spec, "batch_size": 2, "seq_len": 16, "policy": "density=0.5",
                                            "steps": 1, "warmup": 0},
                         out=tmp_path, run_name="small")
    assert [r.status for r in runs] == ["ok"], runs[0].error
    run_dir = tmp_path / "01_quickstart" / "small"
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["parameters"]["batch_size"] == 2 and meta["status"] == "ok"
    assert meta["environment"]["torch"].startswith("2.13.0")
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert [(r["model"], r["policy"], r["batch_size"], r["seq_len"], r["block_stacks"]) for r in records] == [
        (spec, "none", 2, 16, "layers[4]"), (spec, "density=0.5", 2, 16, "layers[4]")]
    assert records[1]["effective_density"] == 0.5
    assert records[1]["saved_activation_bytes"] < records[0]["saved_activation_bytes"]
    headline = json.loads((run_dir / "headline.json").read_text())
    assert headline["policy"] == "density=0.5"
    executed = nbformat.read(str(run_dir / "01_quickstart.ipynb"), as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert "batch_size = 2" in injected[0].source
    assert (run_dir / "peak_breakdown.png").stat().st_size > 1000
    index = (tmp_path / "README.md").read_text()
    assert "| [01_quickstart](01_quickstart/small/01_quickstart.ipynb) | small |" in index
    assert "policy: density=0.5" in index


def test_runner_continues_past_failures_and_reports_them(tmp_path, capsys):
    dead = nbformat.v4.new_notebook()
    imports = nbformat.v4.new_code_cell("from typing import Optional")
    params = nbformat.v4.new_code_cell("run_dir: Optional[str] = None  # output folder")
    params.metadata["tags"] = ["parameters"]
    dead.cells = [imports, params, nbformat.v4.new_code_cell("import os\nos._exit(1)")]
    dead.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    dead_path = tmp_path / "98_dead_kernel.ipynb"
    nbformat.write(dead, str(dead_path))
    raising = nbformat.v4.new_notebook()
    # Raised from inside an installed package, so the stored traceback passes through site-packages.
    raising.cells = [imports, params, nbformat.v4.new_code_cell(
        "import yaml\ntry:\n    yaml.safe_load('[1, 2')\nexcept yaml.YAMLError as exc:\n"
        "    raise ValueError('policy=density=2 is invalid') from exc")]
    raising.metadata["kernelspec"] = dead.metadata["kernelspec"]
    raising_path = tmp_path / "97_raises.ipynb"
    nbformat.write(raising, str(raising_path))

    out = tmp_path / "results"
    runs = run_notebooks([str(raising_path), str(dead_path)], out=out, timeout_s=120)
    assert [(r.notebook, r.status) for r in runs] == [("97_raises", "failed"), ("98_dead_kernel", "failed")]
    assert "policy=density=2 is invalid" in runs[0].error
    assert "dead" in runs[1].error.lower() or "died" in runs[1].error.lower(), runs[1].error
    meta = json.loads((out / "98_dead_kernel" / "default" / "run.json").read_text())
    assert meta["status"] == "failed"

    code = cli_main(["notebooks", "run", str(raising_path), "--out", str(out)])
    assert code == 1
    assert "FAILED 97_raises (failed)" in capsys.readouterr().err
    # Nothing written names this machine's folders: the output folder (absolute here), the
    # repository, the Python installation, the home folder.
    executed = json.loads((out / "97_raises" / "default" / "97_raises.ipynb").read_text())
    assert executed["metadata"]["papermill"]["output_path"] == "97_raises/default/97_raises.ipynb"
    assert executed["metadata"]["papermill"]["parameters"]["run_dir"] == "97_raises/default"
    assert "<site-packages>/yaml/" in json.dumps(executed["cells"][-1]["outputs"])
    assert json.loads((out / "97_raises" / "default" / "run.json").read_text())["parameters"]["run_dir"] == \
        "97_raises/default"
    machine_paths = {str(tmp_path), str(ROOT), sys.prefix, sysconfig.get_paths()["purelib"], str(Path.home()) + "/"}
    for p in out.rglob("*"):
        if p.is_file():
            text = p.read_text(errors="replace")
            assert not [m for m in machine_paths if m in text], p.relative_to(out)


def test_results_index_lists_each_run(tmp_path):
    run_dir = tmp_path / "02_density_sweep" / "default"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"notebook": "02_density_sweep", "status": "ok",
                                                  "finished_at": "2026-11-29T12:00:00+00:00",
                                                  "environment": {"device_name": "AMD EPYC"}}))
    (run_dir / "headline.json").write_text(json.dumps({"overhead_full": "+31%"}))
    (run_dir / "pareto.png").write_bytes(b"png")
    (run_dir / "sweep" / "figures").mkdir(parents=True)
    (run_dir / "sweep" / "figures" / "heatmaps.png").write_bytes(b"png")  # a sub-sweep's: not listed
    text = write_results_index(tmp_path).read_text()
    assert ("| [02_density_sweep](02_density_sweep/default/02_density_sweep.ipynb) | default | 2026-11-29 | "
            "AMD EPYC | ok | overhead_full: +31% | [pareto](02_density_sweep/default/pareto.png) |") in text


def test_cli_lists_a_notebooks_parameters(capsys):
    assert cli_main(["notebooks", "params", "02"]) == 0
    out = capsys.readouterr().out
    assert "densities" in out and "List[float]" in out and "checkpoint densities to measure" in out


def test_the_default_parameter_set_passes_every_check():
    """`make run` executes the default set: its values must pass the checks the runner applies
    before any kernel starts (a value of another notebook's shape, such as a list, included)."""
    for name, values in load_param_set("default").items():
        check_parameters(find_notebook(name), values or {})
