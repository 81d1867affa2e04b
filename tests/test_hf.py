"""Hugging Face transformers models: ckptlab's policies and transformers' own checkpointing
(hf, hf:every_n_layers=K, hf:offload) on GPT-2, Llama and BERT built from tiny configs."""

import warnings

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from ckptlab import apply_checkpointing, find_blocks, get_workload, measure, predict  # noqa: E402
from ckptlab.checkpoint.hf import hf_capabilities, hf_layers  # noqa: E402
from ckptlab.workloads.base import is_transformers_model  # noqa: E402
from ckptlab.workloads.hf import TINY_LLAMA  # noqa: E402

TINY = ["hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny"]
CKPTLAB_POLICIES = ["none", "full", "density=0.5", "every=2", "layers=0,3", "segments=2", "segments=sqrt"]
HAS_ACCELERATOR = torch.accelerator.is_available()
# hf:offload pins host memory, which PyTorch cannot do without an accelerator (see test below).
HF_POLICIES = ["hf", "hf:every_n_layers=2", "hf:every_n_layers=3"] + (["hf:offload"] if HAS_ACCELERATOR else [])
BLOCK_TYPES = {"hf-gpt2-tiny": "GPT2Block", "hf-llama-tiny": "LlamaDecoderLayer", "hf-bert-tiny": "BertLayer"}
# The projection in each block that the frozen-base tests give a low-rank adapter.
ADAPTED = {"GPT2Block": "attn.c_attn", "LlamaDecoderLayer": "self_attn.q_proj", "BertLayer": "attention.self.query"}


def step(workload, policy=None, prepare=None, batch_size=2, seq_len=16, seed=0, **apply_options):
    """One forward + backward in train mode (dropout on) from a fixed RNG seed. policy=None: the
    un-checkpointed reference. Returns (loss, {name: grad} of the trainable parameters)."""
    model = workload.build().train()
    if prepare is not None:
        prepare(model)
    handle = apply_checkpointing(model, policy, **apply_options) if policy is not None else None
    batch = workload.batch(batch_size, seq_len)
    torch.manual_seed(seed)
    loss = workload.loss(model, batch)
    loss.backward()
    if handle is not None:
        handle.remove()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same(reference, result):
    (loss_ref, grads_ref), (loss, grads) = reference, result
    # CPU fp32: the recompute replays the same kernels on the same inputs under the same
    # preserved RNG state (dropout masks included), so everything is bitwise equal.
    assert torch.equal(loss, loss_ref), (loss.item(), loss_ref.item())
    assert grads.keys() == grads_ref.keys()
    for name, g_ref in grads_ref.items():
        assert g_ref is not None and grads[name] is not None, name
        assert torch.equal(grads[name], g_ref), (name, (grads[name] - g_ref).abs().max().item())


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    """(workload, reference step) per architecture, computed once."""
    workload = get_workload(request.param)
    return workload, step(workload)


# ----------------------------------------------------------------------------- workloads

def test_tiny_presets_have_the_advertised_architecture():
    llama = get_workload("hf-llama-tiny").config
    assert llama.num_key_value_heads < llama.num_attention_heads          # grouped-query attention
    assert llama.hidden_act == "silu"                                      # SwiGLU: silu(gate) * up
    model = get_workload("hf-llama-tiny").build()
    assert hasattr(model.model.layers[0].mlp, "gate_proj") and hasattr(model.model, "rotary_emb")
    for name in TINY:
        config = get_workload(name).config
        assert config.use_cache is False
        dropouts = [v for k, v in config.to_dict().items() if "drop" in k and isinstance(v, float)]
        assert dropouts and all(p > 0 for p in dropouts), (name, dropouts)


@pytest.mark.parametrize("name", TINY)
def test_find_blocks_finds_the_transformer_layers(name):
    assert is_transformers_model(get_workload(name).build("meta"))
    assert not is_transformers_model(get_workload("gpt-tiny").build("meta"))
    workload = get_workload(name)
    model = workload.build()
    blocks = find_blocks(model)
    assert len(blocks) == 4 and {type(b).__name__ for b in blocks} == {BLOCK_TYPES[name]}
    assert blocks == hf_layers(model)  # the same layers transformers counts for every_n_layers


def test_real_shapes_build_on_meta_with_the_published_parameter_counts():
    assert get_workload("hf-gpt2").n_params == 124_439_808                 # GPT-2 small
    assert get_workload("hf-llama-1b").n_params == 1_235_814_400           # Llama-3.2-1B
    llama = get_workload("hf-llama-1b").config
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads,
            llama.num_key_value_heads) == (16, 2048, 32, 8)


def test_workload_errors_are_clear():
    with pytest.raises(ValueError, match="override not_a_field=1 is invalid for model='hf-llama-tiny'"):
        get_workload("hf-llama-tiny", not_a_field=1)
    with pytest.raises(ValueError, match="model='hf-nope' is invalid: allowed presets are .*hf-llama-tiny"):
        get_workload("hf-nope")
    assert get_workload("hf-llama-tiny", num_hidden_layers=2).build().config.num_hidden_layers == 2


# ----------------------------------------------------------------------------- gradient equality

@pytest.mark.parametrize("policy", CKPTLAB_POLICIES + HF_POLICIES)
def test_gradients_equal_with_dropout(tiny, policy):
    workload, reference = tiny
    assert_same(reference, step(workload, policy))


def test_dropout_really_randomizes_so_the_equality_test_can_fail(tiny):
    workload, reference = tiny
    # Without preserved RNG state the recompute draws other dropout masks: gradients differ.
    _, grads = step(workload, "full", preserve_rng_state=False)
    assert any(not torch.equal(grads[n], g) for n, g in reference[1].items())


def test_reentrant_matches_when_the_whole_model_trains(tiny):
    workload, reference = tiny
    assert_same(reference, step(workload, "full", use_reentrant=True))
    assert_same(reference, step(workload, "hf", use_reentrant=True))


# ----------------------------------------------------------------------------- frozen base + adapter

class LowRankAdapter(nn.Module):
    """base(x) + up(down(x)): a LoRA-like trainable path beside a frozen projection. `up` starts
    non-zero so that both adapter matrices get a gradient on the first step."""

    def __init__(self, base: nn.Module, in_features: int, rank: int = 4):
        super().__init__()
        self.base = base
        out_features = base(torch.zeros(1, in_features)).shape[-1]
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, attr, new)


def freeze_and_adapt(model: nn.Module) -> None:
    """Freeze every base weight; give each block's attention projection and the output head a
    trainable adapter. The inputs (token ids) never require grad."""
    torch.manual_seed(1)
    model.requires_grad_(False)
    hidden = model.config.get_text_config().hidden_size
    for block in find_blocks(model):
        path = ADAPTED[type(block).__name__]
        _replace(block, path, LowRankAdapter(block.get_submodule(path), hidden))
    head = model.get_output_embeddings()
    head_path = next(n for n, m in model.named_modules() if m is head)
    _replace(model, head_path, LowRankAdapter(head, hidden))


@pytest.fixture(scope="module", params=TINY)
def frozen(request):
    workload = get_workload(request.param)
    reference = step(workload, prepare=freeze_and_adapt)
    names = list(reference[1])
    assert names and all(".down." in n or ".up." in n for n in names)   # only adapters train
    assert all(g is not None and g.abs().sum() > 0 for g in reference[1].values())
    return workload, reference


@pytest.mark.parametrize("policy", CKPTLAB_POLICIES + HF_POLICIES)
def test_frozen_base_adapter_trains_under_every_policy(frozen, policy):
    workload, reference = frozen
    assert_same(reference, step(workload, policy, prepare=freeze_and_adapt))


def _block_adapter(name: str) -> bool:
    return any(f".{i}." in name for i in range(4)) and "lm_head" not in name and "decoder" not in name


def test_reentrant_checkpointing_of_a_frozen_base_is_refused(frozen):
    """Why ckptlab defaults to non-reentrant. A reentrant checkpoint is an autograd Function of
    its tensor inputs only; with a frozen base nothing entering a block requires grad, so the
    Function's output does not either and autograd never calls its backward: the adapter
    weights inside the block (parameters, not inputs) would get no gradient, silently. ckptlab
    refuses it in the forward pass, naming the fixes."""
    workload, _ = frozen
    with pytest.raises(ValueError, match="enable_input_require_grads.*use_reentrant=False"):
        step(workload, "full", prepare=freeze_and_adapt, use_reentrant=True)


def test_transformers_reentrant_trains_adapters_by_making_embeddings_require_grad(frozen):
    """transformers' enable hooks the input embeddings so their output requires grad — its
    workaround for the same problem — so `hf` with use_reentrant=True matches; remove() takes
    the hook out again."""
    workload, reference = frozen
    assert_same(reference, step(workload, "hf", prepare=freeze_and_adapt, use_reentrant=True))


# ----------------------------------------------------------------------------- the hf policies

def test_hf_policies_report_the_layers_transformers_marks():
    workload = get_workload("hf-llama-tiny", num_hidden_layers=5)
    model = workload.build()
    for policy, blocks in [("hf", [0, 1, 2, 3, 4]), ("hf:every_n_layers=2", [0, 2, 4]),
                           ("hf:every_n_layers=3", [0, 3]), ("hf:every_n_layers=9", [0])]:
        with apply_checkpointing(model, policy) as handle:
            assert handle.checkpointed_blocks == blocks, policy
            assert handle.effective_density == len(blocks) / 5
            workload.loss(model, workload.batch(1, 8)).backward()
            assert handle.recompute_count == len(blocks)
            assert [layer.gradient_checkpointing for layer in model.model.layers] == [
                i in blocks for i in range(5)]


def test_remove_disables_transformers_checkpointing_and_policies_never_nest():
    workload = get_workload("hf-gpt2-tiny")
    model = workload.build()
    hf = apply_checkpointing(model, "hf")
    assert model.is_activation_checkpointing and model._require_grads_hooks
    ours = apply_checkpointing(model, "density=0.5")   # replaces the hf policy: no nesting
    assert hf.removed and not model.is_activation_checkpointing
    assert not model._require_grads_hooks
    back = apply_checkpointing(model, "hf:every_n_layers=2")  # and the other way round
    assert ours.removed
    back.remove()
    assert not model.is_activation_checkpointing and not model._require_grads_hooks
    assert all("forward" not in block.__dict__ for block in find_blocks(model))


def test_installed_transformers_capabilities():
    caps = hf_capabilities()
    assert caps == {"hf": True, "every_n_layers": True, "offload": True}, transformers.__version__


def test_an_unsupported_hf_option_says_so(monkeypatch):
    import ckptlab.checkpoint.hf as hf
    monkeypatch.setattr(hf, "hf_capabilities", lambda model: {"hf": True, "every_n_layers": False, "offload": False})
    model = get_workload("hf-llama-tiny").build()
    with pytest.raises(ValueError, match=r"hf:every_n_layers=2.* not supported by transformers .* no every_n_layers"):
        apply_checkpointing(model, "hf:every_n_layers=2")
    with pytest.raises(ValueError, match=r"hf:offload.* not supported by transformers .* no offload"):
        apply_checkpointing(model, "hf:offload")
    assert not model.is_activation_checkpointing


def test_hf_policy_errors_are_clear():
    from ckptlab import parse_policy
    with pytest.raises(ValueError, match="need a transformers PreTrainedModel"):
        apply_checkpointing(get_workload("gpt-tiny").build(), "hf")
    with pytest.raises(ValueError, match="do not compose with \\+offload"):
        apply_checkpointing(get_workload("hf-llama-tiny").build(), "hf+offload")
    with pytest.raises(ValueError, match="unknown Hugging Face policy 'hf:every'"):
        parse_policy("hf:every=2")
    with pytest.raises(ValueError, match="hf:every_n_layers=0 is invalid: allowed is an integer >= 1"):
        parse_policy("hf:every_n_layers=0")
    assert str(parse_policy("hf:every_n_layers=2")) == "hf:every_n_layers=2"


@pytest.mark.skipif(HAS_ACCELERATOR, reason="on an accelerator hf:offload runs (it is in HF_POLICIES)")
def test_hf_offload_on_a_cpu_only_machine_is_refused_before_any_work():
    model = get_workload("hf-llama-tiny").build()
    with pytest.raises(ValueError, match=r"hf:offload.*pin_memory=True.*no pinned-memory allocator"):
        apply_checkpointing(model, "hf:offload")
    assert not model.is_activation_checkpointing


# ----------------------------------------------------------------------------- measure

@pytest.mark.parametrize("policy, density", [("none", 0.0), ("full", 1.0), ("hf", 1.0),
                                             ("hf:every_n_layers=2", 0.5), ("hf:offload", 1.0)])
def test_measure_runs_on_hf_llama_tiny(policy, density):
    record = measure("hf-llama-tiny", batch_size=2, seq_len=32, policy=policy, steps=1, warmup=0, max_seconds=0.1)
    if policy == "hf:offload" and not HAS_ACCELERATOR:
        assert record["status"] == "error" and "no pinned-memory allocator" in record["message"]
        return
    assert record["status"] == "ok", record["message"]
    assert record["effective_density"] == density and record["n_blocks"] == 4
    assert record["recompute_count"] == round(4 * density)
    assert record["peak_bytes"] > 0 and record["step_ms"] > 0


def test_a_training_step_logs_and_warns_nothing(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in TINY:
            workload = get_workload(name)
            for policy in ["full", "hf"]:
                step(workload, policy)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


class _OldStyleLlama(transformers.LlamaForCausalLM):
    """A model class written before transformers 5.x: it overrides the old method names, which the
    new ones then call (and transformers warns that they are deprecated)."""

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        if getattr(self, "other_warning", False):
            warnings.warn("a warning of the model's own", FutureWarning, stacklevel=2)
        super().gradient_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self):
        super().gradient_checkpointing_disable()


def test_transformers_rename_warning_does_not_reach_the_user_and_nothing_else_is_hidden(capfd):
    model = _OldStyleLlama(transformers.LlamaConfig(**TINY_LLAMA))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = apply_checkpointing(model, "hf")
        assert model.is_activation_checkpointing
        handle.remove()
    assert not model.is_activation_checkpointing
    assert capfd.readouterr() == ("", "")
    model.other_warning = True
    with pytest.warns(FutureWarning, match="a warning of the model's own"):
        apply_checkpointing(model, "hf").remove()


def test_prediction_of_a_checkpointed_llama_is_exact_to_the_byte():
    # transformers reads position_ids to detect packed sequences; a fake step cannot, and would
    # build a (batch, 1, seq, seq) mask that the real step never builds, held by every checkpoint.
    workload = get_workload("hf-llama-tiny", num_hidden_layers=2, hidden_size=128, intermediate_size=344,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    for policy in ("full", "plan=fk"):
        predicted = predict(workload, 2, 256, policy)
        measured = measure(workload, 2, 256, policy, steps=1, warmup=0, max_seconds=0.1)
        assert (predicted.peak_bytes, predicted.saved_activation_bytes) == (
            measured["peak_bytes"], measured["saved_activation_bytes"]), policy
