"""The pencil-and-paper model of a GPT training step's memory, after Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models"), re-derived for ckptlab's GPT
op by op; reported beside measurement with its error."""

from __future__ import annotations

from typing import Optional

from ..core.policy import Policy, as_policy
from ..workloads.base import Workload
from ..workloads.models import GPTConfig
from ..workloads.registry import as_workload

AUTOCAST_16 = ("bf16", "fp16")   # autocast to a 16-bit type: the same ops cast, the same sizes


def _elem_bytes(dtype: str) -> tuple[int, int, int]:
    """(E, R, W): bytes of a matmul-region activation; of the residual stream and what runs
    outside the matmuls (norm inputs and statistics, the loss's log-softmax); of one weight, its
    gradient and each element of its optimizer state. bf16 / fp16 autocast halves E only: the weights
    stay fp32, and autocast runs norms and the loss in fp32. bf16-weights and fp16-weights cast the
    model and the batch, so every tensor is 2 bytes, the optimizer state too (AdamW allocates it
    like its parameter)."""
    if dtype in ("bf16-weights", "fp16-weights"):
        return 2, 2, 2
    return (2, 4, 4) if dtype in AUTOCAST_16 else (4, 4, 4)


def gpt_block_bytes(cfg: GPTConfig, batch_size: int, seq_len: int, dtype: str = "fp32",
                    fused_attention: Optional[bool] = None) -> dict[str, int]:
    """Bytes one ckptlab GPT block keeps for backward, by option, counted op by op.

    With T = b*s tokens, h = width, a = heads, E = activation element bytes (4 fp32, 2 bf16
    autocast or 16-bit weights), R = residual stream and LayerNorm bytes (4, except 2 with 16-bit
    weights), p = dropout:

      keep   R*T*h (ln_1 input = block input)  + E*T*h (qkv input) + 3E*T*h (qkv output = q,k,v)
             + attention: fused  E*T*h (output) + 4*b*a*s (logsumexp)
                          math   E*T*h (scaled q) + E*T*h (output) + 3E*b*a*s^2 (softmax output,
                                 dropout mask, dropped probabilities; Korthikanti's 5as/h term)
             + E*T*h (proj input) + R*T*h (ln_2 input) + E*T*h (fc input) + 4E*T*h (gelu input)
             + 4E*T*h (mlp proj input) + 2*T*h if p > 0 (two bool dropout masks)
             + 4R*T (two LayerNorms' mean and rstd)
             fp32 fused: 70*T*h (Korthikanti's 34*s*b*h in 16-bit; ours is 36*T*h in 16-bit)
      full   R*T*h: only the block input (Korthikanti's 2*s*b*h)
      selective (mm): R*T*h + the outputs of the matmuls and attention: 3E+E(attn)+E+4E+E
                      (+ on the math path the two bmm outputs instead of the attention output).
    `fused_attention` defaults to what PyTorch picks on CPU: fused when dropout is 0.
    """
    E, R, _ = _elem_bytes(dtype)
    T, h, a, s, b = batch_size * seq_len, cfg.n_embd, cfg.n_head, seq_len, batch_size
    fused = cfg.dropout == 0 if fused_attention is None else fused_attention
    masks = 2 * E * T * h if cfg.dropout > 0 else 0     # CPU dropout multiplies by a same-dtype mask
    casts = 2 * 12 * h * h if dtype in AUTOCAST_16 else 0     # autocast's 16-bit weight copies, saved by the matmuls
    if fused:
        attn_keep = attn_sel = E * T * h + 4 * b * a * s
    else:  # the math path runs in fp32 under autocast (q, k, v become fp32 copies)
        qkv_copies = 3 * R * T * h if dtype in AUTOCAST_16 else R * T * h  # fp32: only the scaled q is new
        attn_keep = qkv_copies + R * T * h + 3 * R * b * a * s * s
        attn_sel = R * T * h + R * b * a * s * s       # q@k^T scores and probs@v output
    keep = (R + E + 3 * E) * T * h + attn_keep + (E + R + E + 4 * E + 4 * E) * T * h + masks + 4 * R * T + casts
    full = R * T * h
    selective = R * T * h + (3 * E + E + 4 * E + E) * T * h + attn_sel
    # torchtitan-style: attention + every other matmul (math path: the bmm's count as matmuls)
    alt = R * T * h + (E + E) * T * h + (4 * b * a * s if fused else R * b * a * s * s)
    attn = R * T * h + (E * T * h + 4 * b * a * s if fused else 0)
    return {"keep": keep, "full": full, "selective": selective, "selective=alt": alt, "selective=attn": attn}


def closed_form(workload: Workload | str, batch_size: int, seq_len: int, policy: str | Policy = "none",
                dtype: str = "fp32", optimizer: str = "adamw") -> dict[str, int]:
    """Closed-form saved-activation and peak bytes for the GPT workloads (per-block policies).

    saved = sum over blocks of their option's bytes (`gpt_block_bytes`) + the head: the last
    block's output (ln_f input, R*T*h), lm_head input (E*T*h), log-softmax output (R*T*V) and
    the embedding dropout mask (T*h if p > 0).
    peak  = parameters + optimizer state (AdamW: two more tensors like the parameters), W bytes
            each + saved + the loss backward's two (T x V) buffers (R bytes each) + the largest
            recompute (keep - kept bytes of one recomputed block, materialised again during its
            backward). Element sizes E, R, W by dtype: `_elem_bytes`.
    """
    workload = as_workload(workload)
    policy = as_policy(policy)
    cfg = workload.config
    if not isinstance(cfg, GPTConfig):
        raise ValueError(f"model={workload.name!r} is invalid for closed_form: allowed are the GPT workloads")
    n = cfg.n_layer
    per = gpt_block_bytes(cfg, batch_size, seq_len, dtype)
    E, R, W = _elem_bytes(dtype)
    T, h, V = batch_size * seq_len, cfg.n_embd, cfg.vocab_size
    if policy.kind == "budget" or policy.compiles:
        raise ValueError(f"policy={policy} is invalid for closed_form: resolve a budget to a plan first")
    if policy.kind == "segments":  # a segment keeps only its input and recomputes all its blocks
        kept = [per["keep"]] * n
        recompute = 0
        for start, stop in policy.regions(n):
            kept[start:stop] = [per["full"]] + [0] * (stop - start - 1)
            recompute = max(recompute, (stop - start) * per["keep"] - per["full"])
    else:
        modes = policy.modes(n)
        kept = [per[m] for m in modes]
        recompute = max((per["keep"] - k for m, k in zip(modes, kept) if m != "keep"), default=0)
    head = R * T * h + E * T * h + R * T * V + (T * h if cfg.dropout > 0 else 0)
    saved = sum(kept) + head
    n_params = workload.n_params
    static = W * n_params * (1 + (2 if optimizer == "adamw" else 0))
    peak = static + saved + 2 * R * T * V + recompute
    return {"closed_form_saved_activation_bytes": saved, "closed_form_peak_bytes": peak,
            "closed_form_block_keep_bytes": per["keep"], "closed_form_block_full_bytes": per["full"],
            "closed_form_block_selective_bytes": per["selective"]}


__all__ = ["closed_form", "gpt_block_bytes"]
