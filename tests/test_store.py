"""Run store: durable appends, torn lines, the lock, atomic metadata."""

import json

import pytest

from ckptlab.run.store import RunLockedError, RunWriter, load_run, read_meta, read_records


def test_append_and_load(tmp_path):
    with RunWriter(tmp_path / "r") as w:
        w.append({"cell_id": "a", "status": "ok", "peak_bytes": 10})
        w.append({"cell_id": "b", "status": "oom", "peak_bytes": None})
        w.write_meta({"run": "r", "grid": {"steps": 1}})
    df = load_run(tmp_path / "r")
    assert list(df["cell_id"]) == ["a", "b"] and df.attrs["run"]["grid"] == {"steps": 1}
    assert (tmp_path / "r" / "records.jsonl").read_text().count("\n") == 2
    assert not (tmp_path / "r" / "run.json.tmp").exists()


def test_torn_last_line_is_skipped_with_a_warning_then_cut_by_the_next_writer(tmp_path):
    path = tmp_path / "r" / "records.jsonl"
    path.parent.mkdir()
    path.write_text('{"cell_id": "a"}\n{"cell_id": "b"}\n{"cell_id": "c", "pe')
    with pytest.warns(RuntimeWarning, match="torn"):
        assert [r["cell_id"] for r in read_records(path.parent)] == ["a", "b"]
    with pytest.warns(RuntimeWarning, match="dropping a torn last line"):
        with RunWriter(path.parent) as w:
            w.append({"cell_id": "c"})
    assert [json.loads(x)["cell_id"] for x in path.read_text().splitlines()] == ["a", "b", "c"]


def test_corrupt_middle_line_does_not_stop_loading(tmp_path):
    (tmp_path / "records.jsonl").write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.warns(RuntimeWarning, match="line 2"):
        assert [r["a"] for r in read_records(tmp_path)] == [1, 2]


def test_lock_refuses_a_second_writer_and_is_released(tmp_path):
    with RunWriter(tmp_path / "r"):
        with pytest.raises(RunLockedError, match="in use by another sweep"):
            RunWriter(tmp_path / "r").__enter__()
    with RunWriter(tmp_path / "r") as w:  # released on exit
        w.append({"x": 1})


def test_missing_run_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such run folder"):
        load_run(tmp_path / "nope")
    assert read_meta(tmp_path) == {} and read_records(tmp_path) == []
