"""benchmarks/published.py, cheaply: the table of published rows and their sources, one tiny
stand-in row through every estimator into the report's schema and the page, the committed page
against the committed report, and bad arguments refused with one line (the full run takes minutes
and the benchmark-only packages: `python benchmarks/published.py`)."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ckptlab
from ckptlab.core.loop import Loop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("benchmark_published", ROOT / "benchmarks" / "published.py")
published = importlib.util.module_from_spec(spec)
spec.loader.exec_module(published)
rows = published.rows_module
LOOP_OPTIONS = {f.name for f in dataclasses.fields(Loop)}


def test_every_row_names_its_source_card_quantity_and_loop():
    ids = [r.id for r in rows.ROWS] + [n.id for n in rows.NOT_RUN]
    assert len(ids) == len(set(ids))
    assert len(rows.ROWS) >= 10
    assert len({r.source.project for r in rows.ROWS}) >= 4
    table_cards = {c.name for c in ckptlab.cards()}
    for row in rows.ROWS:
        assert all(dataclasses.astuple(row.source)), row.id
        assert row.quantity in rows.QUANTITIES and row.published_bytes > 0 and row.published_text
        assert row.model in rows.MODELS and row.model in rows.MODEL_PACKAGES
        assert set(row.loop) == LOOP_OPTIONS, row.id   # every field of the loop said, in one place
        Loop(**row.loop).check_dtype(row.dtype)
        assert row.conditions and all(len(u) == 2 for u in row.unknowns)
        assert row.predict_card is None or row.predict_card in table_cards | set(rows.EXTRA_CARDS)
        ckptlab.parse_policy(row.policy)
    sources = rows.source_table()
    assert sum(len(s["rows"]) for s in sources) == len(ids)


def tiny_reference_model():
    from tests.reference_models import sac_ilp_transformer
    return sac_ilp_transformer(n_layers=2, n_heads=2, vocab_size=128, max_seq_len=64, dim=64)


def stand_in(quantity):
    return rows.Row(f"stand-in-{quantity}", rows.PYTORCH_SAC_ILP, "A100-SXM4-40GB", quantity, 10**7, "0.01 GB",
                    "pytorch:sac-ilp-transformer", 2, 32, "full", "fp32",
                    rows.loop_of("adamw-foreach", holds_output=True),
                    ("a tiny stand-in",), (("nothing", "nothing"),), ("nothing",), "a100-40", "torch")


@pytest.fixture(scope="module")
def stand_in_report():
    records = [published.run_row(stand_in(q), tiny_reference_model) for q in ("allocated", "nvidia-smi")]
    return published.build_report(records)


def test_a_stand_in_row_gets_every_estimator_and_its_ratio(stand_in_report):
    allocated, on_card = stand_in_report["rows"]
    for record in (allocated, on_card):
        assert record["status"] == "ok" and set(record["estimators"]) == set(published.ESTIMATORS)
        assert record["ratio"] == record["predicted_bytes"] / record["published_bytes"]
        for name, value in record["estimators"].items():
            ratio = record["estimator_ratios"][name]
            assert (ratio is None) == (value is None) and (ratio is None or ratio == value / 10**7)
    assert allocated["predicted_bytes"] == allocated["allocated_bytes"]
    assert on_card["predicted_bytes"] == on_card["device_bytes"] > on_card["reserved_bytes"]
    # MemTracker counts tensors: it answers an allocated figure, not what nvidia-smi shows
    assert allocated["estimators"]["pytorch-memtracker"] > 0 and on_card["estimators"]["pytorch-memtracker"] is None
    trainable = sum(p.numel() for p in tiny_reference_model().build("meta").parameters())
    assert allocated["estimators"]["16-bytes-per-parameter"] == 16 * trainable
    assert allocated["estimators"]["accelerate-estimate-memory"] == 16 * trainable   # float32: 4x the fp32 size


def test_the_report_summarises_each_estimator_and_renders_a_page(stand_in_report):
    json.dumps(stand_in_report)
    summary = stand_in_report["summary"]
    assert list(summary) == ["ckptlab", *published.ESTIMATORS]
    errors = [abs(r["ratio"] - 1) for r in stand_in_report["rows"]]
    assert summary["ckptlab"]["worst_abs_error"] == max(errors) and summary["ckptlab"]["rows"] == 2
    assert summary["pytorch-memtracker"]["rows"] == 1
    page = published.render_page(stand_in_report)
    assert "stand-in-allocated" in page and f"{stand_in_report['rows'][0]['ratio']:.3f}" in page


def test_a_package_that_is_missing_makes_the_row_not_run():
    row = dataclasses.replace(stand_in("allocated"), needs="no_such_package_for_ckptlab")
    record = published.run_row(row)
    assert record["status"] == "not run" and "no_such_package_for_ckptlab" in record["reason"]
    assert record["predicted_bytes"] is None and published.summary([record])["ckptlab"]["rows"] == 0


def test_the_committed_page_is_the_committed_report_rendered():
    report = json.loads((ROOT / "results" / "published" / "report.json").read_text())
    assert (ROOT / "docs" / "published.md").read_text() == published.render_page(report)
    assert {r["id"] for r in report["rows"]} == {r.id for r in rows.ROWS}
    for record in report["rows"]:
        assert {"source", "quantity", "published_bytes", "predicted_bytes", "estimators"} <= set(record)


@pytest.mark.parametrize("args, named", [
    (["--rows", "no-such-row"], "--rows"),
    (["--rows", ""], "--rows"),
    (["--docs", "page.txt"], "--docs"),
    (["--out", str(ROOT / "README.md")], "--out"),   # a file, not a folder
])
def test_bad_arguments_get_one_line_and_exit_2(tmp_path, capsys, args, named):
    with pytest.raises(SystemExit) as exit_:
        published.parse_args(["--out", str(tmp_path / "out"), *args])   # the last --out given wins
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {named}=")


def test_the_command_line_refuses_before_any_work(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published.py"), "--out", str(out),
                           "--rows", "no-such-row"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists() and not (tmp_path / "docs").exists()


def test_an_accumulation_peaks_the_same_from_two_micro_steps_on():
    # why the benchmark predicts an accumulation of k >= 2 micro-batches as 2 (`predicted_loop`)
    workload = tiny_reference_model()
    two, three = (ckptlab.predict(workload, 2, 32, "none", loop=Loop(accum_steps=k, holds_output=True, clip_grad_norm=1.0,
                                                                      optimizer="adamw-foreach"), device="cuda")
                  for k in (2, 3))
    assert (two.peak_bytes, two.reserved_bytes) == (three.peak_bytes, three.reserved_bytes)
    row = dataclasses.replace(stand_in("allocated"), loop=rows.loop_of("sgd", accum_steps=32))
    assert published.predicted_loop(row) == Loop(optimizer="sgd", accum_steps=2)


def test_the_readme_quotes_this_benchmark_for_accuracy_on_gpus():
    report = json.loads((ROOT / "results" / "published" / "report.json").read_text())
    s = report["summary"]
    quote = (f"ckptlab's predictions are off by a median of {published.pct(s['ckptlab']['median_abs_error'])} "
             f"and at worst {published.pct(s['ckptlab']['worst_abs_error'])}")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert quote in readme and f"the {s['ckptlab']['rows']} training-memory figures" in readme
    assert f"by a median of {published.pct(s['16-bytes-per-parameter']['median_abs_error'])}" in readme
