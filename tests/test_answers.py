"""Predictions kept on disk (`estimate.answers`): a question asked again is answered from the
first answer, in this process or another; any change in what a prediction depends on asks again."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import ckptlab
from ckptlab.apps.cli import main as cli_main
from ckptlab.core.cards import parse_capacity
from ckptlab.estimate import answers
from ckptlab.estimate.batch_line import on_line
from ckptlab.estimate.fake_step import clear_prepared
from ckptlab.workloads.base import Workload
from ckptlab.workloads.models import chunked_gpt_loss, with_chunked_loss

TINY = dict(n_layer=2)


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTLAB_CACHE", str(tmp_path))
    return tmp_path


def fields(prediction) -> dict:
    return {k: v for k, v in dataclasses.asdict(prediction).items() if k not in ("predict_s", "answered_from_cache")}


def kept_files(folder) -> list:
    return sorted(p.name for p in folder.iterdir())


def test_a_question_asked_again_is_answered_from_the_first_answer(kept_in):
    workload = ckptlab.get_workload("gpt-tiny", **TINY)
    first = ckptlab.predict(workload, 2, 32, "full", device="cuda", card="rtx4090")
    assert not first.answered_from_cache and len(kept_files(kept_in)) == 1
    clear_prepared()
    again = ckptlab.predict(ckptlab.get_workload("gpt-tiny", **TINY), 2, 32, "full", device="cuda", card="rtx4090")
    assert again.answered_from_cache and fields(again) == fields(first)
    assert again.predict_s < first.predict_s


@pytest.mark.parametrize("change", [
    dict(batch_size=3), dict(seq_len=16), dict(policy="none"), dict(dtype="bf16"), dict(loop="adamw,clip=1.0"),
    dict(card="a100-40"), dict(card=parse_capacity("rtx4090", context_bytes=0)),
    dict(attention="math"), dict(torch_version="2.8"), dict(alloc_conf="expandable_segments:True"),
    dict(trace="full"), dict(model=dict(n_layer=3)), dict(model=dict(seed=1))])
def test_any_change_in_what_a_prediction_depends_on_asks_again(kept_in, change):
    question = dict(batch_size=2, seq_len=32, policy="full", dtype="fp32", loop="adamw", device="cuda",
                    card="rtx4090", attention=None, torch_version=None, alloc_conf=None, trace="fast")
    changed = {**question, **{k: v for k, v in change.items() if k != "model"}}
    model = {**TINY, **change.get("model", {})}
    seed = model.pop("seed", 0)
    ckptlab.predict(ckptlab.get_workload("gpt-tiny", **TINY), **question)
    other = ckptlab.predict(ckptlab.get_workload("gpt-tiny", seed=seed, **model), **changed)
    assert not other.answered_from_cache and len(kept_files(kept_in)) == 2


@pytest.mark.parametrize("cache", ["on disk", "off"])
def test_a_workload_given_another_loss_is_predicted_for_its_own_loss(cache, kept_in, monkeypatch):
    # the same spec trained on a chunked loss holds other bytes: neither the steps kept in this
    # process nor the answers kept on disk are taken for the other loss, in either order
    if cache == "off":
        monkeypatch.setenv("CKPTLAB_CACHE", "off")
    plain = ckptlab.get_workload("gpt-tiny", **TINY, vocab_size=4096)
    chunked = with_chunked_loss(plain, 8)
    first = [ckptlab.predict(w, 8, 128, "none") for w in (chunked, plain)]
    assert first[0].peak_bytes < first[1].peak_bytes and not any(p.answered_from_cache for p in first)
    assert chunked.loss_name == "ckptlab.workloads.models.chunked_gpt_loss(chunks=8)"
    clear_prepared()
    again = [ckptlab.predict(w, 8, 128, "none") for w in (plain, with_chunked_loss(plain, 8))]
    assert [p.peak_bytes for p in again] == [first[1].peak_bytes, first[0].peak_bytes]
    assert all(p.answered_from_cache for p in again) is (cache == "on disk")
    assert ckptlab.predict(with_chunked_loss(plain, 4), 8, 128, "none").peak_bytes != first[0].peak_bytes


def _three_chunk_loss(model, batch):   # a loss of this module, not ckptlab's: its code can change under its name
    return chunked_gpt_loss(model, batch, chunks=3)


SPEC_WITH_A_LAMBDA_LOSS = """
import ckptlab
from ckptlab.workloads.models import chunked_gpt_loss

def make():
    base = ckptlab.get_workload("gpt-tiny", n_layer=2)
    return ckptlab.Workload.custom("lambda-loss", build_model=base.new_model,
                                   make_batch=lambda b, s, g: base.make_batch(base.config, b, s, g),
                                   loss=lambda model, batch: chunked_gpt_loss(model, batch, chunks=2))
"""


def test_a_loss_its_name_does_not_pin_is_kept_in_this_process_only(kept_in, tmp_path):
    # a loss of the spec's file, a lambda too, is pinned by the file's hash: kept on disk, and the
    # workload made again (a worker process's) has the same identity
    spec = tmp_path / "lambda_loss.py"
    spec.write_text(SPEC_WITH_A_LAMBDA_LOSS)
    made = ckptlab.get_workload(f"{spec}:make")
    assert made.loss_pinned and made.identity == ckptlab.get_workload(f"{spec}:make").identity
    first = ckptlab.predict(made, 2, 16, "none")
    clear_prepared()
    assert ckptlab.predict(ckptlab.get_workload(f"{spec}:make"), 2, 16, "none").peak_bytes == first.peak_bytes
    assert ckptlab.predict(ckptlab.get_workload(f"{spec}:make"), 2, 16, "none").answered_from_cache
    # a loss of another module (a notebook's, __main__'s) may change under its name: never kept on disk
    kept = kept_files(kept_in)
    other = dataclasses.replace(ckptlab.get_workload("gpt-tiny", **TINY), loss_fn=_three_chunk_loss)
    assert not other.loss_pinned and other.identity != ckptlab.get_workload("gpt-tiny", **TINY).identity
    assert not ckptlab.predict(other, 2, 16, "none").answered_from_cache
    clear_prepared()
    assert not ckptlab.predict(other, 2, 16, "none").answered_from_cache and kept_files(kept_in) == kept
    # ckptlab's own losses, a partial of one with literal arguments too, are pinned
    assert with_chunked_loss(ckptlab.get_workload("gpt-tiny"), 4).loss_pinned


def test_other_code_asks_again(kept_in, monkeypatch):
    workload = ckptlab.get_workload("gpt-tiny", **TINY)
    ckptlab.predict(workload, 2, 32, "none")
    assert ckptlab.predict(workload, 2, 32, "none").answered_from_cache
    monkeypatch.setattr(answers, "_code", "another version of ckptlab, torch, transformers or peft")
    assert not ckptlab.predict(workload, 2, 32, "none").answered_from_cache


def test_the_code_version_covers_ckptlabs_sources_and_the_libraries_that_build_models():
    answers._code = None
    version = answers.code_version()
    assert len(version) == 64 and version == answers.code_version()


def test_a_model_made_in_python_is_never_kept(kept_in):
    class Mine(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    workload = Workload.custom("mine", Mine, lambda n, s, g: (torch.randn(n, s, 16, generator=g),),
                               lambda m, batch: m(batch[0]).pow(2).mean())
    ckptlab.predict(workload, 2, 8, "none")
    assert kept_files(kept_in) == [] and not ckptlab.predict(workload, 2, 8, "none").answered_from_cache


def test_an_unreadable_answer_is_asked_again_and_written_anew(kept_in):
    workload = ckptlab.get_workload("gpt-tiny", **TINY)
    first = ckptlab.predict(workload, 2, 32, "none")
    (kept,) = kept_in.iterdir()
    kept.write_bytes(b"half a file")
    again = ckptlab.predict(workload, 2, 32, "none")
    assert not again.answered_from_cache and fields(again) == fields(first)
    assert ckptlab.predict(workload, 2, 32, "none").answered_from_cache


def test_a_folder_that_cannot_be_written_keeps_nothing_and_the_prediction_stands(tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("mine")
    monkeypatch.setenv("CKPTLAB_CACHE", str(blocked))
    workload = ckptlab.get_workload("gpt-tiny", **TINY)
    assert ckptlab.predict(workload, 2, 32, "none").peak_bytes > 0
    assert blocked.read_text() == "mine" and kept_files(tmp_path) == [blocked.name]


def test_off_makes_every_prediction(kept_in, monkeypatch):
    workload = ckptlab.get_workload("gpt-tiny", **TINY)
    with answers.off():
        ckptlab.predict(workload, 2, 32, "none")
    assert kept_files(kept_in) == []
    ckptlab.predict(workload, 2, 32, "none")
    with answers.off():
        assert not ckptlab.predict(workload, 2, 32, "none").answered_from_cache
    monkeypatch.setenv("CKPTLAB_CACHE", "off")
    assert answers.folder() is None and not ckptlab.predict(workload, 2, 32, "none").answered_from_cache


def test_a_table_from_kept_answers_is_the_same_and_keeps_no_batch_lines_answer(kept_in):
    workload = ckptlab.get_workload("gpt-tiny", n_layer=8)
    cap = parse_capacity("rtx4090", usable_bytes="64MiB", context_bytes=0, required_margin_bytes=0)
    with answers.off():
        made = ckptlab.predict_fits(workload, ["full"], [cap], seq_len=64, seq_lens=[64, 128, 256])
    first = ckptlab.predict_fits(workload, ["full"], [cap], seq_len=64, seq_lens=[64, 128, 256])
    clear_prepared()
    again = ckptlab.predict_fits(workload, ["full"], [cap], seq_len=64, seq_lens=[64, 128, 256])
    assert made == first == again
    kept = [answers.fetch(p.stem) for p in kept_in.iterdir()]
    assert kept and not any(on_line(p.trace) for p in kept)


def test_a_later_process_is_answered_from_the_kept_answer(kept_in):
    ask = textwrap.dedent("""
        import json, ckptlab
        p = ckptlab.predict(ckptlab.get_workload("gpt-tiny", n_layer=2), 2, 32, "full")
        print(json.dumps([p.answered_from_cache, p.peak_bytes]))
    """)
    env = {**os.environ, "CKPTLAB_CACHE": str(kept_in)}
    first, again = (json.loads(subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True,
                                              check=True).stdout) for _ in range(2))
    assert first[0] is False and again == [True, first[1]]


def test_the_command_line_says_which_rows_were_answered_from_kept_answers(kept_in, capsys):
    argv = ["predict", "--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "2", "--seq", "32", "--policy", "none,full"]
    assert cli_main(argv) == 0
    assert "answered from" not in capsys.readouterr().out
    clear_prepared()
    assert cli_main(argv + ["--policy", "none"]) == 0
    out = capsys.readouterr().out
    assert f"1 of 1 rows answered from the predictions kept in {kept_in}" in out


def test_a_command_asked_again_is_answered_without_building_its_model(kept_in, capsys, monkeypatch):
    argv = ["predict", "--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "2", "--seq", "16,32", "--policy",
            "none,full", "--format", "json"]
    assert cli_main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    clear_prepared()
    monkeypatch.setattr("ckptlab.apps.cli.get_workload", lambda *a, **k: pytest.fail("the model was built"))
    assert cli_main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert [r["answered_from_cache"] for r in first] == [False] * 4 and [r["answered_from_cache"] for r in again] == [True] * 4
    assert [{k: v for k, v in r.items() if k not in ("predict_s", "answered_from_cache")} for r in again] == \
        [{k: v for k, v in r.items() if k not in ("predict_s", "answered_from_cache")} for r in first]
    assert cli_main(argv[:-2]) == 0   # another format, the same rows
    assert "4 of 4 rows answered from the predictions kept" in capsys.readouterr().out
    for changed in (["--set", "n_layer=3"], ["--seq", "16"], ["--policy", "none"], ["--dtype", "bf16"],
                    ["--card", "rtx4090"], ["--optimizer", "sgd"], ["--zero-grad", "zeros"], ["--trace", "full"]):
        with pytest.raises(pytest.fail.Exception, match="the model was built"):
            cli_main(argv + changed)


def test_a_spec_names_its_model_for_a_command_asked_again_where_nothing_else_makes_it(kept_in, tmp_path):
    def spec_key(spec, overrides=None, seed=0):
        return answers.spec_key(spec, overrides or {}, seed, ("asked",))

    factory = tmp_path / "mine.py"
    factory.write_text("def make(): ...\n")
    keys = [spec_key("gpt-tiny"), spec_key("gpt-tiny", dict(n_layer=3)), spec_key("gpt-tiny", seed=1),
            spec_key("hf-llama-tiny+lora=4"), spec_key("hf-llama-tiny+lora=8"), spec_key("hf:llama"),
            spec_key(f"{factory}:make")]
    assert None not in keys and len(set(keys)) == len(keys)
    factory.write_text("def make(): return None\n")
    assert spec_key(f"{factory}:make") not in keys   # the file changed
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    assert spec_key(f"hf:{config}") != spec_key(f"hf:{config}+lora=4") != None   # noqa: E711
    for read_elsewhere in ("hf:org/name", "hf:org/name+lora=4", "package.module:factory",
                           f"{tmp_path / 'missing.py'}:make", f"hf:{tmp_path / 'missing.json'}"):
        assert spec_key(read_elsewhere) is None
    with answers.off():
        assert spec_key("gpt-tiny") is None


def test_an_explanation_asked_again_is_answered_from_the_first_unless_it_measures(kept_in, monkeypatch):
    workload = ckptlab.get_workload("gpt-tiny", **TINY)
    first = ckptlab.explain(workload, 2, 16, "full", capacity="64MiB", progress=False)
    assert not first.answered_from_cache
    monkeypatch.setattr("ckptlab.report.explain.policy_levers", lambda *a, **k: pytest.fail("explained again"))
    again = ckptlab.explain(workload, 2, 16, "full", capacity="64MiB", progress=False)
    assert again.answered_from_cache and "answered from the explanations kept in" in str(again)
    assert {k: v for k, v in dataclasses.asdict(again).items() if k not in ("explain_s", "answered_from_cache")} == \
        {k: v for k, v in dataclasses.asdict(first).items() if k not in ("explain_s", "answered_from_cache")}
    for other in (dict(capacity="32MiB"), dict(capacity="64MiB", ranks=4), dict(capacity="64MiB", measure=True)):
        with pytest.raises(pytest.fail.Exception, match="explained again"):
            ckptlab.explain(workload, 2, 16, "full", progress=False, **other)
