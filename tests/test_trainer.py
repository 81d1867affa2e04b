"""transformers' Trainer with CkptlabCallback: one record per optimizer step in a run folder,
tracker categories and phases under Trainer, training unchanged by either checkpointing
mechanism, and the two mechanisms never nested."""

import json
import re

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from ckptlab import analysis, apply_checkpointing, get_workload, load_run  # noqa: E402
from ckptlab.core.loop import LOOP_COLUMNS  # noqa: E402
from ckptlab.hf import CkptlabCallback, compare_trainer_runs  # noqa: E402
from ckptlab.probe.memory import CATEGORIES  # noqa: E402

from .conftest import requires_cuda  # noqa: E402

MODEL = "hf-llama-tiny"
SHAPE = dict(batch_size=2, seq_len=16, accum_steps=2, max_steps=2)
RUNS = ["none", "gradient_checkpointing", "full"]
# The columns a sweep record has that mean something for a Trainer step.
SWEEP_COLUMNS = ["model", "n_blocks", "batch_size", "seq_len", "accum_steps", "effective_batch_size", "tokens",
                 "policy", "effective_density", "checkpointed_blocks", "device", "device_name", "dtype", *LOOP_COLUMNS,
                 "peak_bytes", *[f"peak_{c}_bytes" for c in CATEGORIES], "peak_phase", "saved_activation_bytes",
                 "recompute_count", "loss", "step_ms", "tokens_per_s", "status"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    return out, compare_trainer_runs(out, RUNS, MODEL, track_steps=None, **SHAPE)


def tiny_trainer(out, callback, max_steps=1, **arguments):
    workload = get_workload(MODEL)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))]
    args = transformers.TrainingArguments(output_dir=str(out / "scratch"), per_device_train_batch_size=2,
                                          max_steps=max_steps, report_to="none", save_strategy="no",
                                          disable_tqdm=True, use_cpu=True, **arguments)
    return transformers.Trainer(model=workload.build(), args=args, train_dataset=data, callbacks=[callback])


def test_one_row_per_optimizer_step_in_a_run_folder_load_run_reads(runs):
    out, df = runs
    for run in RUNS:
        rows = load_run(out / run)
        assert len(rows) == SHAPE["max_steps"]
        assert set(SWEEP_COLUMNS) <= set(rows.columns), set(SWEEP_COLUMNS) - set(rows.columns)
        assert rows["step"].tolist() == [1, 2]
        assert (rows["accum_steps"] == 2).all() and (rows["effective_batch_size"] == 4).all()
        assert (rows["tokens"] == 4 * 16).all() and (rows["seq_len"] == 16).all()
        assert rows["memory_tracked"].all() and (rows["step_ms"] > 0).all()
        assert rows.attrs["run"]["kind"] == "trainer"
        assert rows.attrs["run"]["training_arguments"]["gradient_accumulation_steps"] == 2
    by_run = df.groupby("run").first()
    assert by_run.loc["none", ["policy", "mechanism", "effective_density"]].tolist() == ["none", "none", 0.0]
    assert by_run.loc["gradient_checkpointing", ["policy", "mechanism", "effective_density"]].tolist() == [
        "hf", "transformers", 1.0]
    assert by_run.loc["full", ["policy", "mechanism", "effective_density"]].tolist() == ["full", "ckptlab", 1.0]
    assert (df.loc[df.run == "full", "recompute_count"] == 2 * 4).all()  # 2 micro-batches x 4 layers


def test_categories_and_phases_hold_under_trainer(runs):
    _, df = runs
    model = get_workload(MODEL).build()
    params = list(model.parameters())
    # AdamW: exp_avg and exp_avg_sq (fp32, one per parameter element) and a 0-d fp32 step per tensor.
    adamw_state = 2 * 4 * sum(p.numel() for p in params) + 4 * len(params)
    assert (df["peak_parameters_bytes"] == 4 * sum(p.numel() for p in params)).all()
    parts = df[[f"peak_{c}_bytes" for c in CATEGORIES]].sum(axis=1)
    assert (parts == df["peak_bytes"]).all()
    assert (df.loc[df.step > 1, "peak_optimizer_state_bytes"] == adamw_state).all()
    # The first step creates the state in its optimizer phase; where the peak falls there, it is
    # counted as optimizer state, not as temporaries.
    first = df[df.step == 1]
    assert set(df["peak_phase"]) <= {"forward", "backward", "optimizer"}
    in_optimizer = first[first.peak_phase == "optimizer"]
    assert len(in_optimizer) and (in_optimizer["peak_optimizer_state_bytes"] == adamw_state).all()
    # Every step went through all three phases, and the peak is the highest of them.
    phases = df[["peak_in_forward_bytes", "peak_in_backward_bytes", "peak_in_optimizer_bytes"]]
    assert (phases > 0).all().all() and (phases.max(axis=1) == df["peak_bytes"]).all()
    # Forward -> backward was seen: the bytes held for backward, fewer under checkpointing.
    saved = df.groupby("run")["saved_activation_bytes"].first()
    assert saved["none"] > saved["full"] > 0
    # transformers' mechanism and ckptlab's full keep the same layer inputs.
    assert saved["gradient_checkpointing"] == saved["full"]


def test_checkpointing_does_not_change_training(runs):
    """Gradient accumulation and dropout (the preset's attention dropout) on: every logged loss of
    every run is bitwise the un-checkpointed run's, both the callback's and Trainer's own."""
    _, df = runs
    assert get_workload(MODEL).config.attention_dropout > 0
    losses = df.groupby("run")["trainer_loss"].apply(list)
    assert losses["gradient_checkpointing"] == losses["none"]
    assert losses["full"] == losses["none"]
    assert len(set(losses["none"])) == SHAPE["max_steps"]  # the model trains: losses move
    assert df["loss"].tolist() == pytest.approx(df["trainer_loss"].tolist(), rel=1e-6)
    summary = analysis.trainer_summary(df)
    assert summary["same_losses_as_none"].all()
    assert (summary.set_index("run").loc[["gradient_checkpointing", "full"], "memory_saved_frac"] > 0).all()
    answer = analysis.slowdown_answer(summary)
    assert "gradient_checkpointing:" in answer and "full:" in answer and f"over {SHAPE['max_steps']} steps" in answer
    assert "every step ran under the memory tracker" in answer  # track_steps=None: said, not hidden


def test_the_callback_records_the_loop_its_training_arguments_run(tmp_path):
    # Trainer's loop: gradient_accumulation_steps, max_grad_norm (clip_grad_norm_), optim -> the
    # loop's optimizer; it sets gradients to None and keeps no output.
    callback = CkptlabCallback(tmp_path / "run", "none")
    tiny_trainer(tmp_path, callback, gradient_accumulation_steps=2, max_grad_norm=0.5, optim="sgd").train()
    (row,) = load_run(tmp_path / "run").to_dict("records")
    assert (row["loop"], row["optimizer"], row["accum_steps"], row["clip_grad_norm"]) == ("sgd,accum=2,clip=0.5",
                                                                                           "sgd", 2, 0.5)
    with pytest.raises(ValueError, match="optim='adafactor' is invalid for CkptlabCallback"):
        tiny_trainer(tmp_path, CkptlabCallback(tmp_path / "other", "none"), optim="adafactor").train()
    assert not (tmp_path / "other").exists()


def test_ckptlab_policy_and_transformers_checkpointing_together_are_refused(tmp_path):
    trainer = tiny_trainer(tmp_path, CkptlabCallback(tmp_path / "run", "full"), activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"policy='full' is invalid for this Trainer: transformers' own "
                                         r"checkpointing is already on \(hf, layers \[0, 1, 2, 3\]\).*nest"):
        trainer.train()
    # Refused before the model was touched and before any record.
    assert all("forward" not in layer.__dict__ for layer in trainer.model.model.layers)
    assert not (tmp_path / "run" / "records.jsonl").exists()
    # A ckptlab policy applied by hand on top of transformers' checkpointing is refused at once.
    with pytest.raises(ValueError, match=r"policy=every=2 is invalid for this model: transformers' own "
                                         r"checkpointing is already on"):
        apply_checkpointing(trainer.model, "every=2")


def test_policy_none_records_a_policy_applied_before_train(tmp_path):
    trainer = tiny_trainer(tmp_path, CkptlabCallback(tmp_path / "run", track_steps=0))
    with apply_checkpointing(trainer.model, "layers=0,2"):
        trainer.train()
    rows = load_run(tmp_path / "run")
    assert rows[["policy", "mechanism", "checkpointed_blocks", "effective_density"]].values.tolist() == [
        ["layers=0,2", "ckptlab", "0,2", 0.5]]
    assert rows["recompute_count"].tolist() == [2]


def test_policy_applied_for_training_and_removed_after(tmp_path):
    callback = CkptlabCallback(tmp_path / "run", "every=2", track_steps=0)
    trainer = tiny_trainer(tmp_path, callback, max_steps=2)
    trainer.train()
    rows = load_run(tmp_path / "run")
    assert rows["checkpointed_blocks"].tolist() == ["1,3", "1,3"] and (rows["recompute_count"] == 2).all()
    assert not rows["memory_tracked"].any() and rows["peak_bytes"].isna().all()
    assert all("forward" not in layer.__dict__ for layer in trainer.model.model.layers)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["steps"] == 2
    # A second train() into the same folder would mix two runs' rows.
    trainer.pop_callback(CkptlabCallback)
    trainer.add_callback(CkptlabCallback(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"already holds 2 records of an earlier run; choose another folder"):
        trainer.train()


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="policy"):
        CkptlabCallback(tmp_path, "densty=0.5")
    with pytest.raises(ValueError, match=r"track_steps=-1 is invalid: allowed is None or an integer >= 0"):
        CkptlabCallback(tmp_path, track_steps=-1)
    with pytest.raises(ValueError, match=r"model='hf-bert-tiny' is invalid here: allowed are transformers causal"):
        compare_trainer_runs(tmp_path, ["none"], "hf-bert-tiny")
    with pytest.raises(ValueError, match=r"runs=\['none', 'none'\] is invalid"):
        compare_trainer_runs(tmp_path, ["none", "none"])
    with pytest.raises(ValueError, match=r"runs=\['full'\] is invalid: allowed is a list of distinct labels that "
                                         r"includes 'none'"):
        compare_trainer_runs(tmp_path, ["full"])
    with pytest.raises(ValueError, match="policy"):
        compare_trainer_runs(tmp_path, ["none", "fulll"])
    with pytest.raises(ValueError, match=r"seq_len=65 is invalid for model='hf-llama-tiny': allowed is 2..64"):
        compare_trainer_runs(tmp_path, ["none"], seq_len=65)
    with pytest.raises(ValueError, match=r"device='cuda:1' is invalid here: allowed are cpu, cuda"):
        compare_trainer_runs(tmp_path, ["none"], device="cuda:1")
    assert list(tmp_path.iterdir()) == []


@requires_cuda
def test_allocator_peaks_on_cuda(tmp_path):
    df = compare_trainer_runs(tmp_path, ["none", "full"], MODEL, device="cuda", **SHAPE)
    assert (df["peak_bytes"] == df["cuda_max_allocated_bytes"]).all() and (df["peak_bytes"] > 0).all()
    assert df["device"].str.startswith("cuda").all() and not df["memory_tracked"].any()
    peaks = df.groupby("run")["peak_bytes"].max()
    assert peaks["full"] < peaks["none"]


def synthetic_runs(times: dict, other_losses=()):
    """A `compare_trainer_runs` frame with the given step times per run; the first step of each run
    is tracked (slow, with a peak), the rest timed; the runs in `other_losses` end on another loss."""
    import pandas as pd

    peaks = {"none": 1000, "full": 600}
    rows = []
    for name, steps in times.items():
        rows += [dict(run=name, policy=name, mechanism="none", effective_density=0.0, step=i + 1, step_ms=t,
                      memory_tracked=i == 0, peak_bytes=peaks.get(name, 800) if i == 0 else None,
                      peak_activations_bytes=1, saved_activation_bytes=1,
                      loss=(0.25 if name in other_losses and i == len(steps) - 1 else 3.0 - i)) for i, t in enumerate(steps)]
    return pd.DataFrame(rows)


def test_summary_gives_each_run_an_interval_and_the_overhead_an_unpaired_one():
    df = synthetic_runs({"none": [900, 100, 102, 98, 101, 99, 100], "full": [990, 140, 142, 138, 141, 139, 140],
                         "every=2": [950, 99, 103, 97, 102, 100, 101], "selective": [960, 110, 111, 109, 110, 109, 111],
                         "borderline": [970, 112, 128, 118, 122, 115, 125]}, other_losses=["every=2"])
    table = analysis.trainer_summary(df).set_index("run")
    # The tracked first step is left out of the time: six timed steps per run.
    assert (table["timed_steps"] == 6).all() and not table["timed_with_tracker"].any()
    assert table.loc["none", "step_ms"] == 100
    assert (table["step_ms_low"] <= table["step_ms"]).all() and (table["step_ms"] <= table["step_ms_high"]).all()
    assert table.loc["none", "step_ms_low"] >= 98 and table.loc["none", "step_ms_high"] <= 102
    # Overhead: the ratio of medians - 1, inside its own interval; none against itself is exactly 0.
    assert table.loc["full", "overhead"] == pytest.approx(0.4)
    assert 0.2 < table.loc["full", "overhead_low"] < 0.4 < table.loc["full", "overhead_high"] < 0.5
    assert table.loc["none", ["overhead", "overhead_low", "overhead_high"]].tolist() == [0, 0, 0]
    assert table.loc["every=2", "overhead_low"] < 0 < table.loc["every=2", "overhead_high"]
    assert table["significant"].tolist() == [False, True, False, True, True]
    assert "overlaps_none" not in table and "step_ms_min" not in table
    assert table.loc["full", "memory_saved_frac"] == pytest.approx(0.4)
    assert table["same_losses_as_none"].tolist() == [True, True, False, True, True]

    answer = analysis.slowdown_answer(table.reset_index())
    assert "unpaired bootstrap" in answer and "not interleaved" in answer
    assert re.search(r"full: \+40% step time \[95% CI \+3\d%, \+4\d%\] \(median 140 ms \[1\d\d, 1\d\d\]\), "
                     r"40% less peak memory — more than the guide's ~20%", answer), answer
    assert re.search(r"every=2: \+0% step time \[95% CI -\d%, \+\d%\] .* — no difference from no checkpointing", answer)
    assert re.search(r"selective: \+10% step time .* — less than the guide's ~20%", answer)
    assert re.search(r"borderline: \+20% step time .* — consistent with the guide's ~20%", answer), answer
    assert "memory tracker" not in answer


def test_a_run_with_one_timed_step_has_no_interval_and_claims_no_difference():
    table = analysis.trainer_summary(synthetic_runs({"none": [900, 100, 101], "full": [990, 150]}))
    full = table.set_index("run").loc["full"]
    assert full["timed_steps"] == 1 and full["overhead"] == pytest.approx(150 / 100.5 - 1)
    assert pd_isna(full["step_ms_low"]) and pd_isna(full["overhead_low"]) and not full["significant"]
    assert "full: +49% step time (median 150 ms), 40% less peak memory — too few timed steps for an interval" in \
        analysis.slowdown_answer(table)


def pd_isna(value) -> bool:
    return value != value


def test_trainer_trains_on_one_device_where_several_gpus_are_visible(tmp_path, monkeypatch):
    """transformers' Trainer wraps the model in DataParallel when it counts more than one GPU:
    here it is told there are two (on CPU), and DataParallel refuses to be built."""
    class Refused(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError("Trainer wrapped the model in DataParallel")

    monkeypatch.setattr(transformers.TrainingArguments, "n_gpu", property(lambda self: 2))
    monkeypatch.setattr(torch.nn, "DataParallel", Refused)
    df = compare_trainer_runs(tmp_path, ["none"], MODEL, batch_size=2, seq_len=16, accum_steps=1, max_steps=1,
                              track_steps=0)
    assert len(df) == 1 and df["effective_batch_size"].iloc[0] == 2
