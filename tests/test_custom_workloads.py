"""A model ckptlab has never seen — a file of your own, or any transformers architecture — through
every entry point (API, CLI, sweep cells in their own process, a notebook parameter), with the
same guarantees as the presets: memory measured, gradients unchanged, bad specs refused first."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptlab
from ckptlab import Workload, compare_gradients, get_workload, measure, predict
from ckptlab.apps.cli import main as cli_main
from ckptlab.workloads.specs import file_hash
from ckptlab.workloads.stacks import find_stacks

pytest.importorskip("transformers")

SPEC = "tests/custom_model.py:factory"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)   # file specs are relative to the working directory, as for a user


def test_a_file_spec_through_the_api():
    workload = get_workload(SPEC, depth=3)
    assert (workload.name, workload.label, workload.overrides) == ("tiny-net", SPEC, {"depth": 3})
    assert workload.spec_hash == file_hash(ROOT / "tests/custom_model.py")
    none, full = (measure(workload, 2, 8, p, steps=1, warmup=0, max_seconds=0.1) for p in ("none", "full"))
    assert none["status"] == full["status"] == "ok", (none["message"], full["message"])
    assert (full["model"], full["model_hash"], full["block_stacks"]) == (SPEC, workload.spec_hash, "layers[3]")
    assert full["loss_fn"].endswith("classification_loss")
    assert full["effective_density"] == 1.0 and full["recompute_count"] == 3
    assert full["saved_activation_bytes"] < none["saved_activation_bytes"]
    assert compare_gradients(SPEC, "full", seq_len=8).exact
    # The prediction traces the same step, the user's loss included: it equals the measurement.
    assert predict(workload, 2, 8, "full").peak_bytes == full["peak_bytes"]


def test_the_documented_example_runs():
    workload = get_workload("docs/examples/my_model.py:factory", width=16, depth=2)
    none, full = (measure(workload, 2, 8, p, steps=1, warmup=0, max_seconds=0.1) for p in ("none", "full"))
    assert (full["status"], full["block_stacks"]) == ("ok", "layers[2]")
    assert full["saved_activation_bytes"] < none["saved_activation_bytes"]


def test_the_module_form_names_the_same_file():
    workload = get_workload("tests.custom_model:factory", width=8)
    assert workload.spec_hash == file_hash(ROOT / "tests/custom_model.py")
    assert workload.build().embed.out_features == 8


def test_workload_custom_in_process_and_blocks_by_path():
    workload = get_workload("tests/custom_model.py:two_towers")
    stacks = find_stacks(workload.build())
    assert [str(s) for s in stacks] == ["left.layers[2]", "right.layers[3]"]
    with ckptlab.apply_checkpointing(workload.build(), "density=0.4") as handle:
        assert (handle.n_blocks, handle.checkpointed_blocks, handle.stacks_found) == \
            (5, [1, 3], "left.layers[2] + right.layers[3]")
    from tests.custom_model import Net, _batch, classification_loss
    bad = Workload.custom("net", lambda: Net(8, 2), _batch, classification_loss, blocks="layer")
    with pytest.raises(ValueError, match=r"blocks='layer' is invalid: Net has no submodule 'layer'; it holds .*layers"):
        find_stacks(bad.build())
    with pytest.raises(ValueError, match="max_seq_len=0 is invalid"):
        Workload.custom("net", lambda: Net(8, 2), _batch, classification_loss, max_seq_len=0)


def test_a_model_that_reads_tensor_data_while_built_is_predicted_with_a_warning():
    with pytest.warns(RuntimeWarning, match=r"reads tensor data while it is built .*converting it to fake tensors"):
        predicted = predict("tests/custom_model.py:scheduled", 2, 8, "full")
    workload = get_workload("tests/custom_model.py:scheduled")
    assert workload.n_params == sum(p.numel() for p in workload.build().parameters())
    assert ckptlab.SweepConfig("tests/custom_model.py:scheduled", policies=["layers=2"]).model_hash == workload.spec_hash
    measured = measure("tests/custom_model.py:scheduled", 2, 8, "full", steps=1, warmup=0, max_seconds=0.1)
    assert predicted.peak_bytes == measured["peak_bytes"]


def test_a_plan_for_a_custom_loss_holds_under_pytorchs_own_tracker():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    workload = get_workload(SPEC)
    plan = ckptlab.plan_budget(workload, 4, 64, 0.8, cost="roofline")
    assert plan.loss_fn == "tests/custom_model.py:classification_loss"
    assert "made for the training step with loss tests/custom_model.py:classification_loss" in str(plan)
    # The user's own training step, measured by an independent tracker (PyTorch's MemTracker).
    model = workload.build().train()
    ckptlab.apply_checkpointing(model, plan.policy)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = workload.batch(4, 64)

    def step():
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model, batch).backward()
        optimizer.step()

    step()   # optimizer state exists, as in the step the plan predicts
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak <= plan.budget_bytes
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes


def test_the_cli_takes_a_spec_and_its_keyword_arguments(capsys):
    code = cli_main(["measure", "--model", SPEC, "--set", "depth=2", "--batch", "2", "--seq", "8",
                     "--policy", "none,full", "--steps", "1", "--warmup", "0", "--max-seconds", "0.2"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.startswith(f"{SPEC} on ")
    assert cli_main(["measure", "--model", SPEC, "--set", "heads=2"]) == 2
    assert "override heads=2 is invalid for --model tests/custom_model.py:factory: allowed overrides are " \
           "the factory's keyword arguments: width, depth" in capsys.readouterr().err


def test_isolated_cells_recreate_the_spec_and_a_changed_file_is_refused_on_resume(tmp_path):
    model_file = tmp_path / "my_model.py"
    shutil.copy(ROOT / "tests/custom_model.py", model_file)
    spec = f"{model_file}:factory"
    options = dict(model=spec, batch_sizes=[2], seq_lens=[8], policies=["full"], steps=1, warmup=0, max_seconds=0.2,
                   out=tmp_path / "run", progress=False, model_overrides={"depth": 2})
    df = ckptlab.sweep(isolate=True, **options)
    assert df.status.tolist() == ["ok"], df.message.tolist()
    assert df.isolated.tolist() == [True] and df.block_stacks.tolist() == ["layers[2]"]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["model_hash"] == file_hash(model_file)
    model_file.write_text(model_file.read_text() + "\n# edited\n")
    with pytest.raises(ValueError, match=r"is invalid for resuming run 'run': its file changed"):
        ckptlab.sweep(isolate=False, **options)


def test_fsdp_ranks_recreate_the_spec():
    from ckptlab.probe.distributed import measure_sharded

    record = measure_sharded(SPEC, 2, 8, "full", nproc=2, steps=1, warmup=0, model_overrides={"depth": 2})
    assert record["status"] == "ok", record["message"]
    assert (record["model"], record["model_hash"], record["effective_density"], record["block_stacks"]) == \
        (SPEC, file_hash(ROOT / "tests/custom_model.py"), 1.0, "layers[2]")


def test_a_submitit_job_recreates_the_spec(tmp_path):
    pytest.importorskip("submitit")
    df = ckptlab.sweep(model=SPEC, batch_sizes=[2], seq_lens=[8], policies=["full"], steps=1, warmup=0, max_seconds=0.2,
                       progress=False, out=tmp_path / "run", executor="submitit", cluster="local")
    assert df.status.tolist() == ["ok"], df.message.tolist()
    assert (df.executor.tolist(), df.block_stacks.tolist()) == (["submitit"], ["layers[4]"])


# A spec as a notebook's model parameter, through papermill: tests/test_notebooks.py
# (test_papermill_run_reads_back_the_parameters_it_was_given).


def test_the_explorer_takes_a_spec_a_workload_and_shows_a_bad_one(capsys):
    from ckptlab.apps.explorer import Explorer

    explorer = Explorer(model=get_workload(SPEC, depth=2), batch_size=2, seq_len=16, policy="full", steps=1, warmup=0,
                        max_seconds=0.2)
    assert explorer.config["model"] == SPEC
    assert explorer.run().block_stacks.tolist() == ["layers[2]", "layers[2]"]
    explorer.set(model="hf-llama-tiny")
    assert explorer.workload.name == "hf-llama-tiny"
    with pytest.raises(ValueError, match="model='nope.py:f' is invalid: file 'nope.py' does not exist"):
        explorer.set(model="nope.py:f")
    assert explorer.workload.name == "hf-llama-tiny"
    explorer.widgets()
    explorer._widgets["model"].value = "nope.py:f"      # typed into the box: shown, nothing changes
    assert "error: model='nope.py:f' is invalid" in capsys.readouterr().out
    assert explorer.config["model"] == "hf-llama-tiny"


# ----------------------------------------------------------------------------- Hugging Face, offline

@pytest.mark.parametrize("spec, seq_len, stacks", [
    ("hf:qwen2", 16, "model.layers[2]"),
    ("hf:t5", 16, "encoder.block[2] + decoder.block[2]"),
    ("hf:vit", 32, "vit.layers[2]"),   # seq_len: the image side in pixels (16 patches of 8x8)
])
def test_transformers_architectures_none_vs_full(spec, seq_len, stacks):
    none, full = (measure(spec, 2, seq_len, p, steps=1, warmup=0, max_seconds=0.1) for p in ("none", "full"))
    assert none["status"] == full["status"] == "ok", (none["message"], full["message"])
    assert full["block_stacks"] == stacks and full["effective_density"] == 1.0
    assert full["recompute_count"] == full["n_blocks"] == none["n_blocks"]
    assert full["saved_activation_bytes"] < none["saved_activation_bytes"]
    assert compare_gradients(spec, "full", seq_len=seq_len).exact


def test_t5_density_counts_encoder_and_decoder_and_segments_never_change_gradients():
    with ckptlab.apply_checkpointing(get_workload("hf:t5", num_layers=3).build("meta"), "density=0.5") as handle:
        assert (handle.n_blocks, handle.effective_density) == (6, 0.5)
    # T5 hands layer 0's position bias to the later layers: a segment cannot run them from the
    # first layer's arguments, so it is refused instead of computing something else.
    with pytest.raises(RuntimeError, match="called with other arguments than the first"):
        compare_gradients("hf:t5", "segments=2", seq_len=8)


@pytest.mark.parametrize("spec, stacks", [
    ("hf:swin", [1, 1, 2, 1]),
    ("hf:convnext", [1, 1, 2, 1]),
    ("hf:resnet", [2, 2, 2, 2]),
])
def test_every_stage_of_a_multi_stage_model_is_found(spec, stacks):
    model = get_workload(spec).build("meta")
    found = find_stacks(model)
    assert [len(s.blocks) for s in found] == stacks
    with ckptlab.apply_checkpointing(model, "full") as handle:
        assert handle.n_blocks == sum(stacks) and handle.effective_density == 1.0


def test_a_local_config_json_and_the_local_cache(tmp_path, monkeypatch):
    config = get_workload("hf:qwen2", num_hidden_layers=3).config
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    workload = get_workload(f"hf:{path}")
    assert (workload.config.num_hidden_layers, workload.spec_hash) == (3, file_hash(path))
    assert [str(s) for s in find_stacks(workload.build("meta"))] == ["model.layers[3]"]

    from huggingface_hub import constants
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(ValueError, match=rf"no config.json for 'org/tiny' in the local Hugging Face cache \({cache}\)"):
        get_workload("hf:org/tiny")
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(path, snapshot / "config.json")
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("abc123")
    assert get_workload("hf:org/tiny", hidden_size=64).config.hidden_size == 64


def test_hf_presets_are_short_names_for_configs():
    preset = get_workload("hf-llama-tiny")
    assert type(preset.build("meta")).__name__ == "LlamaForCausalLM"
    assert preset.config.num_hidden_layers == 4 and preset.label == "hf-llama-tiny"


# ----------------------------------------------------------------------------- bad specs

@pytest.mark.parametrize("spec, overrides, message", [
    ("missing.py:factory", {}, r"model='missing.py:factory' is invalid: file 'missing.py' does not exist"),
    ("no_such_package.models:factory", {}, r"module 'no_such_package.models' cannot be imported"),
    ("tests/custom_model.py:nope", {}, r"custom_model.py has no callable 'nope'; it defines .*factory"),
    ("tests/custom_model.py:not_a_workload", {}, r"not_a_workload\(...\) returned Net, allowed is a ckptlab.Workload"),
    ("tests/custom_model.py:without_blocks", {},
     r"has no repeated blocks: .* it holds 0 \(Flatten\), 1 \(Linear\)\. Name them with blocks='path.to.container'"),
    ("tests/custom_model.py:factory", {"heads": 2}, r"override heads=2 is invalid .* width, depth"),
    ("tests/custom_model.py:", {}, r"allowed specs are a preset, hf:<model_type>"),
    ("hf:no_such_type", {}, r"'no_such_type' is not a model type of transformers"),
    ("hf:qwen2", {"no_such_field": 1}, r"override no_such_field=1 is invalid for model='hf:qwen2'"),
    ("hf:missing/config.json", {}, r"config file 'missing/config.json' does not exist"),
    ("gpt-9", {}, r"model='gpt-9' is invalid: allowed presets are gpt-tiny.*; or a spec: hf:<model_type>"),
])
def test_bad_specs_are_refused_before_any_work(spec, overrides, message):
    with pytest.raises(ValueError, match=message):
        get_workload(spec, **overrides)


def test_a_workload_without_a_spec_cannot_go_to_rank_processes():
    from ckptlab.probe.distributed import measure_sharded
    from tests.custom_model import Net, _batch, classification_loss

    in_process = Workload.custom("net", lambda: Net(8, 2), _batch, classification_loss)
    with pytest.raises(ValueError, match="re-creates the workload from its spec; define it in a file"):
        measure_sharded(in_process, 2, 8, "full", nproc=2)


@pytest.mark.parametrize("spec, seq_len", [
    ("hf:deit", 32),   # its image-classification mapping names two classes: the plain one is built
    ("hf:gptj", 16),   # tiny heads (8 wide) rotate 4 dimensions, not the full-size default 64
])
def test_architectures_whose_defaults_needed_tiny_care_are_predicted_as_measured(spec, seq_len):
    workload = get_workload(spec, num_hidden_layers=3)
    measured = measure(workload, 2, seq_len, "full", steps=1, warmup=1, max_seconds=0.1)
    assert measured["status"] == "ok", measured["message"]
    assert ckptlab.predict(workload, 2, seq_len, "full").peak_bytes == measured["peak_bytes"]


def test_a_mixture_of_experts_in_fp32_is_refused_clearly_and_predicted_in_bf16_weights(caplog):
    """transformers runs MoE experts through torch's grouped_mm, whose fake kernel takes bf16
    only (the CPU kernel takes fp32 too): an fp32 prediction names the dtype that steps, and
    torch's fake-kernel traceback is not logged."""
    moe = get_workload("hf:mixtral", num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"dtype='fp32' cannot be predicted for model='hf:mixtral': its experts run "
                                         r"torch's grouped_mm.*predict it with dtype='bf16-weights'"):
        ckptlab.predict(moe, 2, 16, "none")
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    assert ckptlab.predict(moe, 2, 16, "none", dtype="bf16-weights").peak_bytes > 0
