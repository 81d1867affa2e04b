"""Fine-tuning as people do it: a peft LoRA Llama and a model cast to bf16 (tests/lora_models.py),
through measure, predict, plan, every policy's gradients and the command line; the traps of
checkpointing a LoRA model caught with the cause and the fix."""

import re
import subprocess
import sys

import pytest
import torch

from ckptlab import apply_checkpointing, compare_gradients, get_workload, measure, plan_budget, predict
from ckptlab.estimate.fake_step import clear_prepared, parameter_count
from ckptlab.probe.step import with_dtype

LORA = "tests/lora_models.py:lora_llama"
NET = "tests/lora_models.py:bf16_net"


def _exact(workload, policy, dtype="fp32", batch=2, seq=16):
    predicted = predict(workload, batch, seq, policy, dtype=dtype)
    measured = measure(workload, batch, seq, policy, dtype=dtype, steps=1, warmup=0, max_seconds=0.1)
    assert measured["status"] == "ok", measured["message"]
    assert predicted.peak_bytes == measured["peak_bytes"], (policy, dtype)
    assert predicted.peak_by_category == {c: measured[f"peak_{c}_bytes"] for c in predicted.peak_by_category}
    return predicted, measured


@pytest.mark.parametrize("policy", ["none", "density=0.5", "full", "selective"])
def test_lora_llama_predicts_exactly(policy):
    _exact(get_workload(LORA), policy)


@pytest.mark.parametrize("cast", ["to", "bfloat16", "half"])
def test_a_model_cast_by_its_factory_predicts_exactly(cast):
    _exact(get_workload(NET, cast=cast), "full")


def test_lora_bf16_base_and_bf16_weights_dtype_predict_exactly():
    _exact(get_workload(LORA, dtype="bf16"), "selective")
    _exact(get_workload(NET, cast="none"), "density=0.5", dtype="bf16-weights")


def test_records_say_what_trains():
    predicted, measured = _exact(get_workload(LORA), "none")
    model = get_workload(LORA).build()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    assert (measured["trainable_param_bytes"], measured["frozen_param_bytes"]) == (trainable, frozen)
    assert (predicted.trainable_param_bytes, predicted.frozen_param_bytes) == (trainable, frozen)
    # frozen weights, adapter gradients and their optimizer state apart in the breakdown
    assert measured["peak_frozen_parameters_bytes"] == frozen
    assert measured["peak_parameters_bytes"] == trainable
    steps = 4 * sum(p.requires_grad for p in model.parameters())   # AdamW's step counters, fp32 scalars
    assert measured["peak_optimizer_state_bytes"] == 2 * trainable + steps


@pytest.mark.parametrize("policy", ["selective", "selective=alt", "full", "density=0.5", "plan=ksf", "hf"])
def test_every_policy_on_lora_keeps_the_gradients(policy):
    cmp = compare_gradients(get_workload(LORA), policy)   # dropout on in the adapters and attention
    assert cmp.exact, cmp


def test_plan_on_lora_holds_its_budget():
    workload = get_workload(LORA)
    plan = plan_budget(workload, 2, 16, 0.8)
    measured = measure(workload, 2, 16, plan.policy, steps=1, warmup=0, max_seconds=0.1)
    assert measured["peak_bytes"] == plan.predicted_peak_bytes <= plan.budget_bytes
    assert measure(workload, 2, 16, "budget=0.8", steps=1, warmup=0, max_seconds=0.1)["status"] == "ok"


def test_lora_spec_suffix():
    workload = get_workload("hf-llama-tiny+lora=4", lora_targets="q_proj,k_proj")
    model = workload.build()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ("q_proj" in n or "k_proj" in n) for n in trainable)
    assert model.peft_config["default"].r == 4
    again = get_workload(workload.spec, **workload.overrides)   # as isolated cells and jobs re-create it
    assert again.identity == workload.identity
    assert compare_gradients(workload, "selective").exact
    bf16 = with_dtype(get_workload("hf-llama-tiny+lora"), "bf16-weights").build()
    dtypes = {(p.requires_grad, p.dtype) for p in bf16.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}   # adapters stay fp32, as peft keeps them


@pytest.mark.parametrize("spec, overrides, says", [
    ("gpt-tiny+lora", {}, "+lora applies to transformers workloads"),
    ("hf:llama+lora=0", {}, "rank R an integer >= 1"),
    ("hf:vit+lora", {}, "no default LoRA target modules"),
    ("hf:gpt2+lora", {"lora_targets": "q_proj"}, "its linear layers are c_attn"),
    ("hf:gpt2+lora", {"lora_dropout": 1.5}, "lora_dropout=1.5 is invalid"),
])
def test_bad_lora_specs_are_one_line(spec, overrides, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        get_workload(spec, **overrides)


# ----------------------------------------------------------------------------- traps

def test_use_cache_under_checkpointing_is_refused():
    # transformers' configs default to use_cache=True: the blocks get a cache that the recompute
    # writes again (what made selective fail on a PEFT Llama)
    workload = get_workload(LORA, use_cache=True)
    with pytest.raises(ValueError, match="use_cache=True is invalid under checkpointing"):
        compare_gradients(workload, "selective")
    record = measure(workload, 2, 16, "full", steps=1, warmup=0, max_seconds=0.1)
    assert record["status"] == "error" and "model.config.use_cache = False" in record["message"]


@pytest.mark.parametrize("policy", ["density=0.5", "full"])   # 3 blocks: density=0.5 checkpoints 0 and 2
def test_reentrant_with_a_frozen_embedding_is_refused(policy):
    workload = get_workload(LORA)
    with pytest.raises(ValueError, match="enable_input_require_grads"):
        compare_gradients(workload, policy, use_reentrant=True)


def test_reentrant_with_inputs_that_require_grad_is_exact():
    workload = get_workload(LORA)
    model = workload.build().train()
    model.enable_input_require_grads()
    reference = compare_gradients(workload, "none")
    assert reference.exact
    with apply_checkpointing(model, "full", use_reentrant=True):
        loss = workload.loss(model, workload.batch(2, 16))
        loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_checkpointing_twice_is_refused():
    model = get_workload(LORA, hf_checkpointing=True).build()
    with pytest.raises(ValueError, match="transformers' own checkpointing is already on"):
        apply_checkpointing(model, "full")
    record = measure(get_workload(LORA, hf_checkpointing=True), 2, 16, "none", steps=1, warmup=0, max_seconds=0.1)
    assert record["status"] == "error" and "gradient_checkpointing_disable" in record["message"]


def test_cli_predicts_a_lora_model_and_a_cast_model(capsys):
    # Both through the command's own entry in this process (no second import of torch, transformers
    # and peft); the cast model also as `python -m ckptlab.apps.cli` in a fresh interpreter.
    from ckptlab.apps.cli import main

    argv = ["--batch", "2", "--seq", "16", "--policy", "none,selective", "--dtype", "bf16-weights"]
    for spec in (LORA, NET):
        code = main(["predict", "--model", spec, *argv])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "Traceback" not in err and "selective" in out
    fresh = subprocess.run([sys.executable, "-m", "ckptlab.apps.cli", "predict", "--model", NET, *argv],
                           capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr
    assert "Traceback" not in fresh.stderr


# ----------------------------------------------------------------------------- bad specs

@pytest.mark.parametrize("argv, says", [
    (["--model", "hf:llama", "--set", "hidden_size=63"], "not a multiple of the number of attention heads"),
    (["--model", "/etc/passwd:f"], "is not a Python file"),
    (["--model", "tests/lora_models.py:bf16_net", "--set", "cast=nope"], "KeyError"),
])
def test_bad_specs_are_one_line_exit_2(argv, says, capsys):
    from ckptlab.apps.cli import main

    code = main(["measure", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_a_relative_model_file_reaches_the_notebook_kernel_as_the_same_file(tmp_path, monkeypatch):
    from ckptlab.apps.notebook_exec import ROOT
    from ckptlab.workloads.specs import project_relative

    (tmp_path / "unet.py").write_text((ROOT / "tests/custom_model.py").read_text())
    monkeypatch.chdir(tmp_path)
    spec = project_relative("unet.py:factory", ROOT)
    assert not spec.startswith("/") and spec.endswith("unet.py:factory")
    monkeypatch.chdir(ROOT)
    assert get_workload(spec).build() is not None
    assert project_relative("hf-llama-tiny+lora", ROOT) == "hf-llama-tiny+lora"


def test_korthikanti_table_2_measured_op_by_op():
    # the numbers docs/guide/lora.md shows: ckptlab's GPT, h=1024, a=16, s=512, b=2
    from ckptlab.estimate.saved import held_by_block, korthikanti

    ratios = {(r["dtype"], r["policy"]): round(r["ratio"], 2) for r in korthikanti()}
    assert ratios == {("fp32", "none"): 2.27, ("fp32", "selective"): 2.24, ("fp32", "full"): 2.0,
                      ("bf16-weights", "none"): 1.86, ("bf16-weights", "selective"): 1.65,
                      ("bf16-weights", "full"): 1.0}
    rows = held_by_block("gpt-tiny", 2, 64, "none", "bf16-weights")
    ops = {(r["op"], r["dtype"]) for r in rows}
    # CPU attention with dropout takes the math path: probabilities, the dropout mask and the
    # dropped probabilities in fp32, q/k/v upcast copies; dropout masks as bf16, not 1 byte
    assert {("_safe_softmax", "float32"), ("empty_like", "float32"), ("mul", "float32"), ("clone", "float32"),
            ("empty_like", "bfloat16"), ("gelu", "bfloat16")} <= ops


def test_trainer_on_a_lora_model_logs_the_same_losses_with_and_without_checkpointing(tmp_path):
    from ckptlab.hf import compare_trainer_runs

    df = compare_trainer_runs(tmp_path, ["none", "full", "selective", "gradient_checkpointing"], "hf-llama-tiny+lora",
                              batch_size=2, seq_len=16, accum_steps=1, max_steps=2, track_steps=None)
    losses = df.pivot(index="step", columns="run", values="trainer_loss")
    assert (losses.nunique(axis=1) == 1).all(), losses
    assert set(df[df["run"] == "gradient_checkpointing"]["mechanism"]) == {"transformers"}


def test_a_model_that_cannot_be_built_on_fake_tensors_is_one_line():
    workload = get_workload("tests/lora_models.py:reads_numpy")
    assert measure(workload, 2, 8, "full", steps=1, warmup=0, max_seconds=0.1)["status"] == "ok"
    with pytest.raises(ValueError, match=r"cannot be predicted: building it on fake tensors failed .*measure it instead"):
        predict(workload, 2, 8, "full")


@pytest.mark.parametrize("spec", ["gpt-tiny", "hf-llama-tiny+lora=4"])
def test_the_parameter_count_is_the_same_from_a_predictions_build_as_from_a_meta_build(spec):
    clear_prepared()
    workload = get_workload(spec)
    on_meta = parameter_count(workload)   # nothing built yet: the meta build's count
    predict(workload, 2, 16, "none")
    assert parameter_count(workload) == on_meta == workload.n_params > 0
