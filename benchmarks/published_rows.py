"""The published single-GPU training-memory figures that benchmarks/published.py reproduces: each
row's source (repository, file, commit), card, the quantity published, every condition of its
training loop (those the source leaves unknown with the assumption made), and the model built
from the framework's own code on fake tensors (no weights are downloaded).

A row's loop is one dict (`loop`) of `ckptlab.core.loop.Loop`'s fields, the torch release whose
CUDA rules apply is `torch_version`. Conditions ckptlab has no option for are listed in
`not_modelled`: the page names them beside the residual.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

import ckptlab
from ckptlab.core.cards import (
    CONTEXT_BYTES_PER_SM,
    CUBLAS_WORKSPACE_BYTES,
    DEFAULT_MARGIN_BYTES,
    KERNEL_IMAGES_BYTES,
    Card,
)

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
GB = 10**9
QUANTITIES = {
    "allocated": "torch.cuda.max_memory_allocated()",
    "reserved": "torch.cuda.max_memory_reserved()",
    "nvidia-smi": "device memory in use as NVML / nvidia-smi reports it (allocator's reserved + CUDA context)",
    "pytorch-estimate": "PyTorch's own estimator (MemTracker + the SAC ILP's baseline peak), asserted by its test",
}


@dataclass(frozen=True)
class Source:
    project: str          # who publishes it (independent sources are different projects)
    repo: str             # owner/name on GitHub
    file: str
    commit: str           # the commit (or version) the figure is read from
    quote: str            # the published line, as written


@dataclass(frozen=True)
class Row:
    id: str
    source: Source
    card: str                     # the card the figure was measured on, as the source names it
    quantity: str                 # a key of QUANTITIES
    published_bytes: int
    published_text: str
    model: str                    # a key of MODELS
    batch_size: int
    seq_len: int
    policy: str
    dtype: str
    loop: dict                    # the row's training loop, in one place: ckptlab.Loop's fields
    conditions: tuple[str, ...]   # every condition of the loop, as the source sets it
    unknowns: tuple[tuple[str, str], ...] = ()    # (what the source leaves unknown, the assumption made)
    not_modelled: tuple[str, ...] = ()            # conditions ckptlab has no option for
    predict_card: Optional[str] = None            # a card of ckptlab.cards() or of EXTRA_CARDS; None: sm80, no context
    needs: str = ""                               # the benchmark-only package the model comes from
    residual: str = ""                            # what the residual comes from, as far as the sources tell
    source_context_bytes: Optional[int] = None    # the CUDA context the source itself measured on its card
    torch_version: Optional[str] = None           # the torch release whose CUDA rules apply (None: installed)


@dataclass(frozen=True)
class NotRun:
    """A published figure whose loop ckptlab cannot run: listed with the reason, never predicted."""
    id: str
    source: Source
    card: str
    quantity: str
    published_bytes: int
    published_text: str
    reason: str


# ---------------------------------------------------------------------------------------------- cards

def _extra_card(name: str, label: str, usable_bytes: int, arch: str, sm_count: int) -> Card:
    return Card(name, label, usable_bytes, CONTEXT_BYTES_PER_SM * sm_count + KERNEL_IMAGES_BYTES, arch, sm_count,
                CUBLAS_WORKSPACE_BYTES[int(arch[2:-1])], DEFAULT_MARGIN_BYTES)


# The V100 (sm70) is in neither ckptlab's card table nor its CUDA semantics (sm80 to sm90). The
# BERT rows run eager attention (no SDPA), so the architecture decides only the cuBLAS workspace,
# 8 MiB + 128 KiB on sm70 as on sm80 (CublasHandlePool.cpp); the V100's 80 SMs size the context
# by ckptlab's rule. Usable bytes: the page's own nvidia-smi, "2631MiB / 16160MiB".
EXTRA_CARDS = {"v100-16-as-sm80": _extra_card("v100-16-as-sm80", "V100-SXM2-16GB (as sm80)", 16160 * MiB, "sm80", 80)}


def card_for(row: Row):
    """What `predict` gets as its card for the row: a table card's name, an extra Card, or None."""
    return EXTRA_CARDS.get(row.predict_card, row.predict_card)


# ---------------------------------------------------------------------------------------------- models

def litgpt_pretrain(name: str) -> ckptlab.Workload:
    """litgpt's GPT, trained as extensions/thunder/pretrain.py's `forward_and_loss` does:
    `chunked_cross_entropy(model(input_ids), targets, chunk_size=0)` (the logits are local to it)."""
    from litgpt.config import Config  # noqa: PLC0415 - benchmark-only package (the `published` extra)
    from litgpt.model import GPT  # noqa: PLC0415
    from litgpt.utils import chunked_cross_entropy  # noqa: PLC0415

    config = Config.from_name(name)

    def loss(model, batch):
        input_ids, targets = batch
        return chunked_cross_entropy(model(input_ids), targets, chunk_size=0)

    return ckptlab.Workload.custom(f"litgpt:{name}", lambda: GPT(config), _token_batch(config.padded_vocab_size), loss,
                                  blocks="transformer.h", max_seq_len=config.block_size)


def litgpt_lora(name: str) -> ckptlab.Workload:
    """litgpt's LoRA GPT as finetune/lora.py (lit-gpt 8641822) trains it: r=8, alpha=16, dropout
    0.05 on the query and value projections, only the LoRA weights trainable, the head's logits in
    chunks of 128 positions (`lm_head_chunk_size=128`) and `chunked_cross_entropy` over them."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable  # noqa: PLC0415 - the `published` extra
    from litgpt.utils import chunked_cross_entropy  # noqa: PLC0415

    config = Config.from_name(name, lora_r=8, lora_alpha=16, lora_dropout=0.05, lora_query=True, lora_key=False,
                              lora_value=True, lora_projection=False, lora_mlp=False, lora_head=False)

    def build():
        model = GPT(config)
        mark_only_lora_as_trainable(model)
        return model

    def loss(model, batch):
        input_ids, targets = batch
        logits = model(input_ids, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]
        return chunked_cross_entropy(logits, targets[..., 1:])

    return ckptlab.Workload.custom(f"litgpt-lora:{name}", build, _token_batch(config.padded_vocab_size), loss,
                                  blocks="transformer.h", max_seq_len=config.block_size)


def hf_bert_large_classifier() -> ckptlab.Workload:
    """transformers' BertForSequenceClassification with bert-large-uncased's config (its
    config.json: 24 layers, width 1024, 16 heads, 4096 intermediate, vocabulary 30522, 512
    positions; 2 labels), eager attention as transformers ran BERT in 2022, and the model's own loss
    (`labels=`), as Trainer computes it."""
    from transformers import BertConfig, BertForSequenceClassification  # noqa: PLC0415 - the `hf` extra

    config = BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2, num_labels=2,
                        attn_implementation="eager")

    def batch(b, s, gen):   # the page's dummy data: token ids in [100, 30000), labels randint(0, 1)
        return torch.randint(100, 30000, (b, s), generator=gen), torch.zeros(b, dtype=torch.long)

    def loss(model, batch):
        input_ids, labels = batch
        return model(input_ids=input_ids, labels=labels).loss

    return ckptlab.Workload.custom("hf:bert-large-uncased-classifier", lambda: BertForSequenceClassification(config),
                                  batch, loss, blocks="bert.encoder.layer", max_seq_len=512)


def llms_from_scratch_gpt_124m() -> ckptlab.Workload:
    """The book's GPTModel (llms_from_scratch.ch04, the package of rasbt/LLMs-from-scratch: the
    classes 00_orig.py copies) with 00_orig.py's GPT_CONFIG_124M: vocabulary 50257, 1024 positions,
    width 768, 12 heads, 12 layers, dropout 0.1, no qkv bias; its attention by hand (a stored
    causal mask, fp32 scores, softmax, dropout); loss `calc_loss_batch`'s cross entropy over the
    flattened logits (local to the function)."""
    from llms_from_scratch.ch04 import GPTModel  # noqa: PLC0415 - the `published` extra

    config = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
              "drop_rate": 0.1, "qkv_bias": False}

    def loss(model, batch):
        input_ids, targets = batch
        return torch.nn.functional.cross_entropy(model(input_ids).flatten(0, 1), targets.flatten())

    return ckptlab.Workload.custom("llms-from-scratch:gpt-124m", lambda: GPTModel(config),
                                  _token_batch(config["vocab_size"]), loss, blocks="trf_blocks", max_seq_len=1024)


def pytorch_sac_ilp_transformer() -> ckptlab.Workload:
    """The Transformer of PyTorch's test_sac_ilp.py, rebuilt layer for layer in tests/reference_models.py."""
    spec = importlib.util.spec_from_file_location("ckptlab_reference_models", ROOT / "tests" / "reference_models.py")
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module.sac_ilp_transformer()


def _token_batch(vocab_size: int):
    def batch(b, s, gen):
        tokens = torch.randint(0, vocab_size, (b, s + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return batch


MODELS: dict[str, Callable[[], ckptlab.Workload]] = {
    "litgpt:tiny-llama-1.1b": lambda: litgpt_pretrain("tiny-llama-1.1b"),
    "litgpt-lora:phi-1_5": lambda: litgpt_lora("phi-1_5"),
    "litgpt-lora:Llama-2-7b-hf": lambda: litgpt_lora("Llama-2-7b-hf"),
    "hf:bert-large-uncased-classifier": hf_bert_large_classifier,
    "pytorch:sac-ilp-transformer": pytorch_sac_ilp_transformer,
    "llms-from-scratch:gpt-124m": llms_from_scratch_gpt_124m,
}
MODEL_PACKAGES = {"litgpt:tiny-llama-1.1b": "litgpt", "litgpt-lora:phi-1_5": "litgpt",
                  "litgpt-lora:Llama-2-7b-hf": "litgpt", "hf:bert-large-uncased-classifier": "transformers",
                  "pytorch:sac-ilp-transformer": "torch", "llms-from-scratch:gpt-124m": "llms_from_scratch"}


# ---------------------------------------------------------------------------------------------- sources

LITGPT_THUNDER = Source(
    "litgpt", "Lightning-AI/litgpt", "extensions/thunder/README.md", "101e31d2e4d430b818e7e69974de6139800a36b9",
    "| -                    | Eager    | -                                      | 1       | 447.65            | 29.84         |")
LITGPT_RESOURCES = Source(
    "litgpt", "Lightning-AI/litgpt", "tutorials/resource-tables.md (LitGPT commit 8641822, 10/20/2023)",
    "4839345a97a0a90bc5f2361664b04d665c9a0e89", "Finetuning with LoRA on 1 GPU: Max GPU RAM")
HF_ONE_GPU = Source(
    "transformers", "huggingface/transformers", "docs/source/en/perf_train_gpu_one.mdx",
    "0016acf7ef421c7fe8eff7945de52c71896c3b01", "GPU memory occupied: {} MB.  (pynvml: info.used//1024**2)")
PYTORCH_SAC_ILP = Source(
    "pytorch", "pytorch/pytorch", "test/distributed/_tools/test_sac_ilp.py::test_sac_ilp_case1",
    "7b88d734eac10b68d75a126d70ae4c925ed8d05e",
    "self.assertAlmostEqual(peak_mem / 2583888896, 1, delta=0.05)")
LLMS_FROM_SCRATCH = Source(
    "LLMs-from-scratch", "rasbt/LLMs-from-scratch", "ch05/10_llm-training-speed/README.md (00_orig.py)",
    "06361583d01a650412400ce01cf2be9efaec3b99", "Reserved memory: 26.2617 GB")

_LITGPT_THUNDER_CONDITIONS = (
    "pretrain.py --compiler null --devices 1 --train.global_batch_size 32: micro-batch 4, so 8 accumulation steps",
    "max_seq_length = block_size 2048; Fabric precision bf16-true (weights, gradients and AdamW state in bf16)",
    "torch.optim.AdamW(fused=True), weight decay 0.1; no gradient clipping (commented out at this commit)",
    "forward_and_loss: logits local to the function, chunked_cross_entropy(chunk_size=0)",
    "optimizer.zero_grad() (set_to_none=True, torch's default since 2.0)",
    "litgpt 0.4.0.dev0 (this commit) on torch 2.4.0.dev20240427, one A100-SXM4-40GB; the benchmark's litgpt "
    "0.4.0 has this commit's litgpt/model.py byte for byte",
)
_LORA_CONDITIONS = (
    "finetune/lora.py (lit-gpt 8641822): r=8, alpha=16, dropout 0.05 on query and value, only LoRA weights trainable",
    "--precision bf16-true; torch.optim.AdamW over the LoRA weights (foreach on CUDA), weight decay 0.01",
    "global batch 128 in micro-batches (128 / micro-batch accumulation steps); no gradient clipping",
    "logits = model(input_ids, lm_head_chunk_size=128) assigned at loop scope: held into the next forward",
    "optimizer.zero_grad() after each optimizer step (set_to_none=True, torch's default since 2.0)",
    "Alpaca, padded to the longest sequence of each batch; torch 2.1.0+cu121, one A100-SXM4-40GB",
    "Max GPU RAM is torch.cuda.max_memory_allocated() / 1e9 at the end of the run",
)
_LORA_UNKNOWNS = (
    ("which step peaks: iteration 0 is given the longest example (get_batch's longest_seq_ix) with no logits "
     "held yet; later steps hold the previous logits but are shorter",
     "the longest example's length, with the previous logits of that length held: an upper bound by one output"),
    ("the model code of lit-gpt 8641822", "litgpt 0.4.0's lora.GPT (the same layers; kept caches may differ)"),
    ("torch 2.1's CUDA rules", "torch 2.4's, the earliest ckptlab models"),
    ("the validation's generation (KV cache) during the run", "below the training step's peak"),
)
_HF_CONDITIONS = (
    "Trainer, BertForSequenceClassification, bert-large-uncased (the page's nvidia-smi is of January 2022)",
    "dummy data: 512 sequences of 512 random token ids, no attention mask; labels from randint(0, 1)",
    "optim adamw_hf (transformers.AdamW: one parameter at a time), max_grad_norm 1.0",
    "model.zero_grad() between steps (set_to_none=False on torch 1.10: gradients stay allocated)",
    "loss from the model (`labels=`), computed inside Trainer.compute_loss (the output is not held)",
    "one Tesla V100-SXM2-16GB, driver 460.91.03, CUDA 11.2; nvidia-smi read after training",
)
_HF_UNKNOWNS = (
    ("torch version", "1.10 (January 2022): no lazy kernel loading, cuBLAS workspace outside the allocator; "
                      "predicted with torch 2.4's CUDA rules, the earliest ckptlab models"),
    ("transformers version", "4.15-4.17 (January-March 2022): eager BERT attention, optim adamw_hf by default"),
)
_HF_NOT_MODELLED = (
    "the CUDA context: the page measures 1343 MiB (torch.ones on the V100, all kernels loaded); ckptlab's "
    "card rule gives 3 MiB per SM + lazily loaded kernel images",
    "V100 (sm70) itself: predicted as an sm80 card with 80 SMs",
)


def loop_of(optimizer: str, **fields) -> dict:
    """A row's loop: ckptlab.Loop's fields, every one said."""
    return {"optimizer": optimizer, "accum_steps": 1, "holds_output": False, "zero_grad": "set_to_none",
            "clip_grad_norm": None, "grad_scaler": False, **fields}


def _lora_row(id_, name, size, seq, micro, published, text):
    return Row(id_, LITGPT_RESOURCES, "A100-SXM4-40GB", "allocated", published, text, f"litgpt-lora:{name}", micro,
               seq, "none", "bf16-weights",
               loop_of("adamw-foreach", accum_steps=128 // micro, holds_output=True),
               _LORA_CONDITIONS + (f"{size}, micro-batch {micro}; longest Alpaca example {seq} tokens",),
               _LORA_UNKNOWNS, ("the validation's generation", "lit-gpt 8641822's model code (litgpt 0.4.0 used)"),
               "a100-40", "litgpt",
               "The Llama 2 rows land close to their figures. The phi-1.5 rows fall short by an amount that grows "
               "with the micro-batch, so it is per-sequence activation memory that lit-gpt 8641822's code on torch "
               "2.1 kept and litgpt 0.4.0 on ckptlab's torch 2.11 rules does not (the two versions' lora.py differ). "
               "Holding a previous output of the longest length is an upper bound, so the shortfall is not from the "
               "assumed loop.", torch_version="2.4")


def _hf_row(id_, batch, accum, policy, published_mib, what, dtype="fp32"):
    return Row(id_, HF_ONE_GPU, "Tesla V100-SXM2-16GB", "nvidia-smi", published_mib * MiB,
               f"{published_mib} MB (MiB: //1024**2)", "hf:bert-large-uncased-classifier", batch, 512, policy, dtype,
               loop_of("adamw-forloop", accum_steps=accum, zero_grad="zeros", clip_grad_norm=1.0,
                     grad_scaler=dtype == "fp16"),
               _HF_CONDITIONS + (what,), _HF_UNKNOWNS, _HF_NOT_MODELLED, "v100-16-as-sm80", "transformers",
               "Part explained: the page's own measurement of the context (1343 MiB) against ckptlab's rule for a "
               "V100 with lazy kernel loading (the ratio with it is above). What remains "
               "grows with the batch (batch 4 against 1), so it is per-sample memory that transformers of 2022 on "
               "torch 1.10 held beyond ckptlab's model of transformers 5 on torch 2.11 (the page names neither "
               "torch version nor allocator statistics), and possibly cuBLAS's own kernel images, loaded at its "
               "first matmul (after the page's context measurement) and whole on CUDA 11.2.", 1343 * MiB, "2.4")


ROWS: tuple[Row, ...] = (
    Row("litgpt-thunder-tinyllama-eager", LITGPT_THUNDER, "A100-SXM4-40GB", "allocated", 29_840_000_000, "29.84 GB",
        "litgpt:tiny-llama-1.1b", 4, 2048, "none", "bf16-weights",
        loop_of("adamw-fused", accum_steps=8), _LITGPT_THUNDER_CONDITIONS,
        (("the nightly's kernels (torch 2.4.0.dev20240427)", "torch 2.4's CUDA rules, as ckptlab models them"),),
        ("the validation pass (no_grad, 2 sanity batches and every 1000 steps): below the training peak",),
        "a100-40", "litgpt",
        "Not explained. PyTorch's MemTracker run on the same fake step agrees with ckptlab's allocated peak (their "
        "ratio is above), so the shortfall is in what both fake steps leave out of the real run "
        "(torch 2.4.0.dev20240427's kernels and allocator, Fabric's bf16-true wrapper), not in ckptlab's "
        "accounting of the tensors they see; the source publishes no per-phase or reserved figure to split it.",
        torch_version="2.4"),
    _lora_row("litgpt-lora-phi1.5-mb1", "phi-1_5", "phi-1.5 (1.3 B)", 1044, 1, 4_820_000_000, "4.82 GB"),
    _lora_row("litgpt-lora-phi1.5-mb2", "phi-1_5", "phi-1.5 (1.3 B)", 1044, 2, 6_760_000_000, "6.76 GB"),
    _lora_row("litgpt-lora-phi1.5-mb4", "phi-1_5", "phi-1.5 (1.3 B)", 1044, 4, 10_680_000_000, "10.68 GB"),
    _lora_row("litgpt-lora-llama2-7b-mb1", "Llama-2-7b-hf", "Llama 2 7B", 1304, 1, 21_300_000_000, "21.30 GB"),
    _lora_row("litgpt-lora-llama2-7b-mb2", "Llama-2-7b-hf", "Llama 2 7B", 1304, 2, 29_070_000_000, "29.07 GB"),
    _hf_row("hf-bert-large-vanilla", 4, 1, "none", 14949, "per_device_train_batch_size=4"),
    _hf_row("hf-bert-large-accum", 1, 4, "none", 8681, "per_device_train_batch_size=1, gradient_accumulation_steps=4"),
    _hf_row("hf-bert-large-accum-checkpointing", 1, 4, "full", 6775,
            "per_device_train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True "
            "(transformers' own, every layer; predicted as ckptlab's full: each layer's input kept)"),
    _hf_row("hf-bert-large-fp16", 4, 1, "none", 13939, "per_device_train_batch_size=4, fp16=True (autocast, "
            "GradScaler)", "fp16"),
    _hf_row("hf-bert-large-accum-checkpointing-fp16", 1, 4, "full", 7275, "per_device_train_batch_size=1, "
            "gradient_accumulation_steps=4, gradient_checkpointing=True, fp16=True (autocast, GradScaler)", "fp16"),
    Row("llms-from-scratch-gpt124m-baseline", LLMS_FROM_SCRATCH, "A100", "reserved", round(26.2617 * 2**30),
        "26.2617 GB (GiB: / 1024**3)", "llms-from-scratch:gpt-124m", 8, 1024, "none", "fp32",
        loop_of("adamw-foreach"),
        ("00_orig.py on PyTorch 2.6.0+cu124: GPT_CONFIG_124M with context 1024, batch 8 (drop_last), fp32",
         "torch.optim.AdamW(lr=5e-4, weight_decay=0.1): foreach on CUDA; no gradient clipping",
         "optimizer.zero_grad() before each forward (set_to_none=True); loss from calc_loss_batch (logits local)",
         "torch.cuda.memory_reserved() / 1024**3 printed after the epoch: the allocator keeps every segment, so "
         "it is the reserved peak of the epoch",
         "evaluation every 15 steps under no_grad (batch 8, one batch each of train and validation)"),
        (("A100 40 GB or 80 GB", "either: the same sm80 and 108 SMs, and a reserved figure holds no context"),
         ("whether the no_grad evaluation's forwards need segments the training step did not",
          "they do not: a forward without graph holds less than the training step")),
        ("the evaluation and the sample generation between steps (no_grad)",), "a100-80", "llms_from_scratch",
        "The figure is read after an epoch, so it also covers the no_grad evaluations between steps, which hold "
        "less than a training step; ckptlab replays one training step from the warm state through the allocator.",
        torch_version="2.6"),
    Row("pytorch-sac-ilp-case1", PYTORCH_SAC_ILP, "none (fake CUDA tensors)", "pytorch-estimate", 2_583_888_896,
        "2583888896 B", "pytorch:sac-ilp-transformer", 8, 1024, "none", "fp32",
        loop_of("adamw-foreach", holds_output=True),
        ("4-layer Transformer of common_dtensor: width 768, 12 heads, vocabulary 8192, dropout 0.1, tied head",
         "batch 8, seq 1024, fp32, Adam(lr=1e-2, foreach=True), loss model(inp).sum()",
         "`output = model(inp)` at loop scope: held into the next forward; two iterations, the second's stats"),
        (), ("the estimator's own terms: it adds the root's activation gradients and leaves out the optimizer "
             "state (docs/measurements.md, PyTorch's own estimator)",), None, "torch",
        "Explained term by term in docs/measurements.md (PyTorch's own estimator) and asserted to the byte by "
        "tests/test_reference.py: the figure is an estimate with other terms, not a measurement."),
)

NOT_RUN: tuple[NotRun, ...] = tuple(
    NotRun(id_, HF_ONE_GPU, "Tesla V100-SXM2-16GB", "nvidia-smi", mib * MiB, f"{mib} MB (MiB)", reason)
    for id_, mib, reason in (
        ("hf-bert-large-adafactor", 12295, "optim=adafactor: ckptlab's optimizers are AdamW's and SGD"),
        ("hf-bert-large-accum-checkpointing-fp16-adafactor", 4847, "Adafactor (as above)"),
        ("hf-bert-large-adam8bit", 13085, "bitsandbytes' Adam8bit is not one of ckptlab's optimizers"),
        ("hf-bert-large-accum-checkpointing-fp16-adam8bit", 5363, "Adam8bit (as above)"),
    ))


def package_missing(row: Row) -> Optional[str]:
    """The reason a row cannot run here (its package is not installed), else None."""
    if importlib.util.find_spec(row.needs) is None:
        return f"{row.needs} is not installed: pip install -e '.[published]' (the benchmark's extra)"
    return None


def source_table() -> list[dict]:
    """Every source once: project, repository, file, commit, and the rows it gives."""
    by_key: dict = {}
    for entry in (*ROWS, *NOT_RUN):
        key = dataclasses.astuple(entry.source)
        by_key.setdefault(key, {**dataclasses.asdict(entry.source), "rows": []})["rows"].append(entry.id)
    return list(by_key.values())


__all__ = ["EXTRA_CARDS", "GB", "MODELS", "MODEL_PACKAGES", "NOT_RUN", "QUANTITIES", "ROWS", "NotRun", "Row", "Source",
           "card_for", "loop_of", "package_missing", "source_table"]
