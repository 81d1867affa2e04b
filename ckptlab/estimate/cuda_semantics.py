"""What a CUDA training step allocates and keeps, on CPU fake tensors.

A CPU-only torch cannot run backward on fake CUDA tensors, so `predict(device="cuda")` runs the
step on CPU fake tensors inside `cuda_semantics()`, which makes the ops whose CUDA kernels keep
other tensors than the CPU's allocate and save what the CUDA kernels would:

- `scaled_dot_product_attention`: the backend PyTorch's CUDA dispatcher would choose, in the
  priority order of the torch version modelled (`estimate.torch_versions`: cuDNN first on sm90
  where that torch prefers it; `cudnn_refusal`, `flash_refusal`, `efficient_refusal`), then
  cuDNN, flash and memory-efficient attention as custom autograd Functions whose forward and
  backward allocate the kernels' outputs, saved tensors and scratch buffers (`torch.empty` of the
  right shape and dtype, nothing computed), and the math backend as the composite ops CUDA runs
  (fp32 upcast, a bool dropout mask).
- `dropout`: CUDA's fused `native_dropout` keeps a 1-byte bool mask where the CPU keeps one in
  the input's dtype.
- Autocast: CPU autocast, wherever it is entered (the step, or torch.utils.checkpoint
  recomputing a region), follows CUDA autocast's op lists (`estimate.cuda_autocast`).

The two ops get kernels for the AutogradCPU dispatch key (a torch.library registration, removed
on exit), not a TorchFunctionMode: a mode is off while it handles `loss.backward()`, so it would
miss the recomputations that checkpointing runs inside backward. The fused kernels' outputs come
from the aten ops CUDA runs (`_scaled_dot_product_flash_attention`, `..._efficient_attention`,
`..._cudnn_attention`), whose fake (Meta) kernels are replaced by ones with the CUDA layouts and
RNG tensors: selective checkpointing, which saves those ops by name, sees them as on a GPU. Every
rule names the PyTorch source it follows as `path:line (function) at tag`, paths under
aten/src/ATen/native/transformers/ (attention.cpp, cuda/sdp_utils.cpp, cuda/attention.cu,
cuda/attention_backward.cu, cuda/flash_attn/flash_api.cpp) unless named whole; where torch
versions differ, `estimate.torch_versions` says how. The model, its sources at tags and what it
leaves out: docs/design.md, note "What a fake step cannot know".
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from ..core.validate import choice
from .cuda_autocast import cuda_autocast_policies
from .torch_versions import TorchRules, torch_rules

# In PyTorch's default priority order (sdp_utils.cpp:77 priority_order -> ATen/Context.h:391
# sdp_priority_order at v2.6.0); a torch that prefers cuDNN on the card puts "cudnn" first (`priority`).
ATTENTION_BACKENDS = ("flash", "efficient", "math", "cudnn")

# Architectures by compute capability (sm86: 8.6), and the streaming multiprocessors of the card
# each name usually means (NVIDIA's data sheets: A100 108, RTX 3090 82, RTX 4090 128, H100 SXM
# and H200 132): flash attention's forward splits the keys when a batch leaves SMs idle.
ARCHS = ("sm80", "sm86", "sm89", "sm90")
SM_COUNTS = {"sm80": 108, "sm86": 82, "sm89": 128, "sm90": 132}


@dataclass
class CudaSemantics:
    """Yielded by `cuda_semantics`: what the step's attention calls chose."""

    arch: str
    attention: Optional[str]           # the user's override; None: PyTorch's choice
    sm_count: int
    rules: TorchRules = field(default_factory=torch_rules)      # the torch version modelled
    backend_calls: dict[str, int] = field(default_factory=dict)  # per backend, recomputations included
    answers: dict = field(default_factory=dict)   # (question, its arguments) -> its answer on this card (`ask`)
    efficient_settled: int = 1                   # `_efficient_settled_batch` of the efficient calls
    flash_unsplit: set = field(default_factory=set)   # (heads, queries) of each flash call without dropout

    def ask(self, question, *args):
        """question(arch, sm_count, *args) on this card, recorded. The step reads the card only
        through questions: a step traced on one card is the step of another card that gives every
        recorded question the same answer (`same_answers`)."""
        answer = question(self.arch, self.sm_count, *args)
        self.answers[(question, args)] = answer
        return answer

    def settled_from_batch(self, sm_count: Optional[int] = None) -> int:
        """A batch size from which the choices that read the batch size (flash's split of the keys,
        the memory-efficient backward's) are those of every larger batch: a line in the batch
        size holds from there. On this card, or on a card of `sm_count` SMs that answers alike."""
        return max([self.efficient_settled, *(_flash_unsplit_batch(heads, queries, sm_count or self.sm_count)
                                              for heads, queries in self.flash_unsplit)])

    @property
    def attention_backend(self) -> str:
        """"flash", "flash+math", ... in ATTENTION_BACKENDS order; "none" without an SDPA call."""
        used = [b for b in ATTENTION_BACKENDS if self.backend_calls.get(b)]
        return "+".join(used) if used else "none"


def same_answers(answers: dict, arch: str, sm_count: int) -> bool:
    """Whether a card of `arch` and `sm_count` answers every question of `answers` (a step's
    `CudaSemantics.answers`) as the card that traced the step did: then it runs the same kernels
    with the same buffers, and the step's events are its own too."""
    return all(question(arch, sm_count, *args) == answer for (question, args), answer in answers.items())


@contextlib.contextmanager
def cuda_semantics(arch: str = "sm80", attention: Optional[str] = None,
                   sm_count: Optional[int] = None, *, torch_version: Optional[str] = None) -> Iterator[CudaSemantics]:
    """Inside a FakeTensorMode, around the whole step (forward, backward with its recomputations,
    optimizer): attention, dropout and autocast allocate and keep what their CUDA kernels would
    on a GPU of architecture `arch`, under the rules of `torch_version` (default: the installed
    torch's, `estimate.torch_versions`). `attention` forces a backend (ValueError at the first call
    it cannot serve, naming why; before any work for cuDNN on a torch or card that lacks it);
    `sm_count` defaults to the SMs of the arch's usual card."""
    choice("arch", arch, ARCHS)
    rules = torch_rules(torch_version)
    if attention is not None:
        choice("attention", attention, ATTENTION_BACKENDS)
        check_backend_available(attention, rules)
    if sm_count is not None and (isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1):
        raise ValueError(f"sm_count={sm_count!r} is invalid: allowed is an integer >= 1")
    semantics = CudaSemantics(arch, attention, sm_count or SM_COUNTS[arch], rules)
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel", on purpose
        lib.impl("scaled_dot_product_attention", lambda *a, **k: _attention(semantics, *a, **k), "AutogradCPU")
        lib.impl("dropout", dropout, "AutogradCPU")
        lib.impl("_scaled_dot_product_flash_attention", lambda *a, **k: _flash_outputs(rules, *a, **k), "Meta")
        lib.impl("_scaled_dot_product_efficient_attention", _efficient_outputs, "Meta")
        lib.impl("_scaled_dot_product_cudnn_attention", _cudnn_outputs, "Meta")
    _forget_fused_outputs()
    try:
        with cuda_autocast_policies(rules.version):
            yield semantics
    finally:
        lib._destroy()
        _forget_fused_outputs()


_FUSED_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention")


def _forget_fused_outputs() -> None:
    """FakeTensorMode caches an op's fake outputs by the op and its inputs' metadata, for every mode
    (FakeTensorMode.cache): the fused kernels registered here give other outputs than torch's own,
    and flash attention's depend on the torch version modelled, so none of theirs may outlive the
    registration or be reused by the next. (A cache key is a list whose first item is the op in
    torch 2.4, an object whose tuple `key` starts with it from 2.5.)"""
    ops = {getattr(torch.ops.aten, name).default for name in _FUSED_OPS}
    cache = FakeTensorMode.cache
    for key in [k for k in cache if getattr(k, "key", k)[0] in ops]:
        del cache[key]


def check_backend_available(attention: str, rules: TorchRules) -> None:
    """ValueError when the forced backend does not exist for this torch and card, whatever the
    inputs: cuDNN attention before torch 2.5 (opt-in there). Every backend exists on every card of
    ARCHS (sdp_utils.cpp:482 check_cudnn_hardware_support at v2.6.0: [sm80, sm90])."""
    if attention == "cudnn" and not rules.cudnn_attention:
        raise ValueError(f"attention='cudnn' is invalid with torch_version={rules.version!r}: torch {rules.version} "
                         "runs cuDNN attention only with TORCH_CUDNN_SDPA_ENABLED=1, which ckptlab does not model; "
                         "allowed are flash, efficient, math, or torch_version 2.5 and later")


def priority(rules: TorchRules, arch: str) -> tuple[str, ...]:
    """sdp_utils.cpp:77 priority_order (at v2.6.0): cuDNN first where check_prefer_cudnn_attention
    holds for this torch and card (2.9 on: no tag source, `torch_versions.CUDNN_FIRST`), else flash,
    efficient, math, cuDNN (which math, always possible, precedes)."""
    if rules.cudnn_first(arch):
        return ("cudnn", "flash", "efficient", "math")
    return ATTENTION_BACKENDS


def _chosen_backend(arch: str, sm_count: int, rules: TorchRules, possible: tuple[str, ...]) -> str:
    """The first of `priority` among the backends possible for a call: a question (`CudaSemantics.ask`)."""
    return next(b for b in priority(rules, arch) if b in possible)


def _attention(semantics: CudaSemantics, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
               scale=None, enable_gqa=False):
    """attention.cpp:696 (scaled_dot_product_attention) with CUDA's choice (sdp_utils.cpp:726
    select_sdp_backend, at v2.6.0: the first of `priority` whose checks pass). Under autocast the
    inputs arrive cast: SDPA is on CUDA autocast's lower-precision list."""
    if not is_fake(query):
        raise ValueError("cuda_semantics models what CUDA kernels keep, on fake tensors: scaled_dot_product_attention "
                         "got a real tensor; run the step under a FakeTensorMode")
    rules = semantics.rules
    if enable_gqa and not rules.has_gqa and key.dim() == 4 and key.size(-3) != query.size(-3):
        # torch 2.4 has no enable_gqa: its callers repeat keys and values first, as transformers'
        # repeat_kv does for torch < 2.5 (expand, then reshape: a copy of each).
        key, value = (_repeat_heads(t, query.size(-3) // t.size(-3)) for t in (key, value))
        enable_gqa = False
    why_not = {"cudnn": cudnn_refusal(query, key, value, dropout_p, enable_gqa, semantics),
               "flash": flash_refusal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, semantics),
               "efficient": efficient_refusal(query, key, value, enable_gqa, rules),
               "math": None}
    possible = tuple(b for b in ATTENTION_BACKENDS if why_not[b] is None)
    backend = semantics.attention or semantics.ask(_chosen_backend, rules, possible)
    if why_not[backend] is not None:
        allowed = [b for b in priority(rules, semantics.arch) if b in possible]
        raise ValueError(f"attention={backend!r} is impossible for this attention call: {why_not[backend]}; "
                         f"allowed here: {', '.join(allowed)}")
    semantics.backend_calls[backend] = semantics.backend_calls.get(backend, 0) + 1
    if backend == "cudnn":
        return cudnn_attention(query, key, value, attn_mask, dropout_p, is_causal, rules)
    if backend == "flash":
        if not dropout_p:
            semantics.flash_unsplit.add((query.size(1), query.size(2)))
        return flash_attention(query, key, value, dropout_p, semantics)
    if backend == "efficient":
        kernel = semantics.ask(_efficient_backward_kernel, query.element_size() == 2, bool(dropout_p),
                               max(query.size(-1), value.size(-1)))
        semantics.efficient_settled = max(semantics.efficient_settled, _efficient_settled_batch(
            query.size(1), key.size(2), query.element_size() == 2, kernel))
        return efficient_attention(query, key, value, attn_mask, dropout_p, kernel)
    return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _repeat_heads(t, n: int):
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


# ---------------------------------------------------------------------------- the backend choice
# aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:726 (select_sdp_backend), :550, :595, :647
# (can_use_cudnn_attention, can_use_flash_attention, can_use_mem_efficient_attention) at v2.6.0,
# and sdp_utils_cpp.h:323 (check_tensor_shapes), :398 (check_batch_size_and_num_heads_dense), :496
# (check_nonzero_sequence_lengths_dense), :512 (check_last_dim_stride_equals_1_dense) at v2.13.0:
# the first backend of `priority` whose checks all pass. Each check returns why it fails, or None.

def _common_refusal(query, key, value) -> Optional[str]:
    if not (query.dim() == key.dim() == value.dim() == 4):
        return "the fused kernels need 4-D query, key and value"
    if query.size(0) != key.size(0) or query.size(0) != value.size(0):
        return "the fused kernels need one batch size for query, key and value"
    if query.size(-2) == 0 or key.size(-2) == 0:
        return "the fused kernels refuse an empty sequence"
    return None


def _heads_refusal(query, key, value, enable_gqa: bool, supports_gqa: bool,
                   same_kv_heads: bool = True) -> Optional[str]:
    """check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads> (sdp_utils_cpp.h:398
    at v2.13.0) and its check_grouped_query_attention (:358): with enable_gqa, key and value heads
    dividing the query's (and equal, unless `same_kv_heads` is off); without, all three equal."""
    hq, hk, hv = query.size(-3), key.size(-3), value.size(-3)
    if enable_gqa and supports_gqa:
        if (same_kv_heads and hk != hv) or hq % hk or hq % hv:
            return (f"grouped-query attention needs key and value heads ({hk}, {hv})"
                    f"{' equal and' if same_kv_heads else ''} dividing {hq}")
        return None
    if not hq == hk == hv:
        return (f"query, key and value have {hq}, {hk}, {hv} heads"
                + (" and this kernel has no grouped-query attention" if enable_gqa else ""))
    return None


def cudnn_refusal(query, key, value, dropout_p, enable_gqa, semantics: CudaSemantics) -> Optional[str]:
    """can_use_cudnn_attention, check by check, for the torch of `rules` and the cuDNN its wheel
    ships (`rules.wheel_cudnn`): fp16 / bf16; masks of any broadcastable shape are taken
    (check_attn_mask_shape); dense inputs need a contiguous last dim, from 2.8 head counts
    (`rules.cudnn_checks_heads`: with enable_gqa, key and value heads each dividing the query's;
    without, all equal), and check_cudnn_tensor_shapes' head dims (multiples of 8, at most 128, or
    256 on sm90 with a cuDNN of 9.10 or later: `cudnn_version >= 91000 && major == 9 && !minor`,
    the wheels of 2.8 on), s_k > 1 and s_q > 1 (to 2.7; later only with dropout:
    `rules.cudnn_refuses_any_query_length_1`); from 2.12 a dropout in sixteenths
    (check_cudnn_dropout). At v2.6.0: sdp_utils.cpp:550-589 (can_use_cudnn_attention: no head
    check), :354 (check_cudnn_tensor_shapes, a limit of 128; :406 `s_q == 1 || s_k == 1`); the
    limit of 256, the later s_q rule and check_cudnn_dropout are of later releases: no tag source."""
    rules = semantics.rules
    if not rules.cudnn_attention:
        return f"torch {rules.version} runs cuDNN attention only with TORCH_CUDNN_SDPA_ENABLED=1"
    common = _common_refusal(query, key, value)
    if common:
        return common
    if query.dtype not in (torch.float16, torch.bfloat16) or not query.dtype == key.dtype == value.dtype:
        return f"cuDNN attention needs fp16 or bf16 (got {query.dtype})"
    if rules.cudnn_dropout_in_sixteenths and dropout_p * 16 != math.floor(dropout_p * 16):
        return f"cuDNN attention needs a dropout probability in sixteenths (got {dropout_p})"
    if not all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (query, key, value)):
        return "the fused kernels need the last dimension contiguous"
    if rules.cudnn_checks_heads:
        heads = _heads_refusal(query, key, value, enable_gqa, supports_gqa=True, same_kv_heads=False)
        if heads:
            return heads
    head_dims = semantics.ask(_cudnn_head_dims_refusal, query.size(-1), value.size(-1), rules.wheel_cudnn)
    if head_dims:
        return head_dims
    if key.size(-2) == 1:
        return "cuDNN attention refuses a key sequence of length 1"
    if query.size(-2) == 1 and rules.cudnn_refuses_any_query_length_1:
        return f"cuDNN attention refuses a query sequence of length 1 with torch {rules.version}"
    if query.size(-2) == 1 and dropout_p:
        return "cuDNN attention refuses dropout with a query sequence of length 1"
    return None


def _cudnn_head_dims_refusal(arch: str, sm_count: int, d_qk: int, d_v: int, wheel_cudnn: int) -> Optional[str]:
    """check_cudnn_tensor_shapes' head dims: a question (`CudaSemantics.ask`)."""
    limit = 256 if arch == "sm90" and wheel_cudnn >= 91000 else 128
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return f"cuDNN attention needs head dims that are multiples of 8, at most {limit} (got {d_qk}, {d_v})"
    return None


def flash_refusal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                  semantics: CudaSemantics) -> Optional[str]:
    """can_use_flash_attention, check by check, in its order: sdp_utils.cpp:595, with :110
    (check_head_dim_size_flash), :286 (..._head_dim_gt192_constraints_on_sm86_89), :317
    (check_flash_causal_non_square_seqlens) at v2.6.0."""
    common = _common_refusal(query, key, value)
    if common:
        return common
    if attn_mask is not None:
        return "flash attention takes no attn_mask"
    d = query.size(-1)
    if not (d == key.size(-1) == value.size(-1) and d <= 256):
        return f"flash attention needs one head dim <= 256 for q, k, v (got {d}, {key.size(-1)}, {value.size(-1)})"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        if semantics.ask(_flash_backward_refuses_head_dim, d, bool(dropout_p)):
            return (f"flash attention's backward on {semantics.arch} refuses head dim {d}"
                    + (" with dropout" if dropout_p else ""))
    if is_causal and query.size(-2) != key.size(-2):
        return "flash attention's is_causal needs seq_len_q == seq_len_k"
    if query.dtype not in (torch.float16, torch.bfloat16) or not query.dtype == key.dtype == value.dtype:
        return f"flash attention needs fp16 or bf16 (got {query.dtype})"
    heads = _heads_refusal(query, key, value, enable_gqa, supports_gqa=True)
    if heads:
        return heads
    if not all(t.stride(-1) == 1 or d == 1 for t in (query, key, value)):
        return "the fused kernels need the last dimension contiguous"
    return None


def _flash_backward_refuses_head_dim(arch: str, sm_count: int, d: int, dropout: bool) -> bool:
    """The backward's head dims on sm86 / sm89: a question (`CudaSemantics.ask`)."""
    return arch in ("sm86", "sm89") and not (d <= 192 or (not dropout and d > 224))


def efficient_refusal(query, key, value, enable_gqa, rules: TorchRules) -> Optional[str]:
    """can_use_mem_efficient_attention on sm80+ (masks and dropout are supported): sdp_utils.cpp:647,
    :165 (check_head_dim_size_mem_efficient) at v2.6.0; from 2.13 the storage offsets' alignment
    (`rules.efficient_checks_storage_offsets`)."""
    common = _common_refusal(query, key, value)
    if common:
        return common
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not query.dtype == key.dtype == value.dtype:
        return f"memory-efficient attention needs fp16, bf16 or fp32 (got {query.dtype})"
    # minimum_gemm_alignment (sdp_utils.cpp:90 at v2.6.0) on sm80+: 8 elements in fp16/bf16, 4 in
    # fp32, for head dims and, from 2.13, for the tensors' storage offsets
    # (check_data_ptr_alignment_mem_efficient: not in v2.6.0's list, :647-724; #184258, no tag source).
    align = 8 if query.element_size() == 2 else 4
    dq, dv = query.size(-1), value.size(-1)
    if dq != key.size(-1) or dq % align or dv % align:
        return f"memory-efficient attention needs head dims divisible by {align} (got {dq}, {key.size(-1)}, {dv})"
    if rules.efficient_checks_storage_offsets and any(t.storage_offset() % align for t in (query, key, value)):
        return f"memory-efficient attention needs storage offsets aligned to {align} elements"
    if not all(t.stride(-1) == 1 for t in (query, key, value)):
        return "the fused kernels need the last dimension contiguous"
    return _heads_refusal(query, key, value, enable_gqa, supports_gqa=False)


# ---------------------------------------------------------------------------- flash attention

def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_attention(query, key, value, dropout_p, semantics: CudaSemantics):
    """attention.cpp:726-728 (pad_last_dim<8>) at v2.6.0: the head dim is padded to a multiple of 8
    (copies, which the kernel saves) and the output sliced back."""
    d = query.size(-1)
    if d % 8:
        query, key, value = (F.pad(t, (0, 8 - d % 8)) for t in (query, key, value))
    out = _Flash.apply(query, key, value, dropout_p, semantics)
    return out[..., :d] if d % 8 else out


class _Flash(torch.autograd.Function):
    """_scaled_dot_product_flash_attention_cuda -> flash_api.cpp:350 mha_fwd / :807 mha_bwd (at
    v2.6.0), whose tensors are [b, s, h, d] views of the [b, h, s, d] inputs. derivatives.yaml:2923
    at v2.13.0: the backward keeps query, key, value, output, logsumexp and the rng_state / unused
    pair (philox_seed / philox_offset to 2.6: `TorchRules.flash_rng_on_device`). The fp32 buffers'
    head dim is rounded as the torch of `rules` rounds it (`TorchRules.flash_head_rounding`)."""

    @staticmethod
    def forward(ctx, query, key, value, dropout_p, semantics):
        b, hq, sq, d = query.shape
        # flash_api.cpp:297-326 (set_params_splitkv) at v2.6.0: without dropout, a batch that leaves
        # SMs idle splits the keys and accumulates in fp32 buffers for the length of the kernel.
        key_blocks = math.ceil(key.size(-2) / (256 if d <= 64 else 128 if d <= 128 else 64))
        splits = 1 if dropout_p else semantics.ask(_flash_splits, b * hq * math.ceil(sq / 64), key_blocks)
        ctx.head_rounding = semantics.rules.flash_head_rounding(d)
        accumulators = () if splits == 1 else (  # alive while the kernel runs
            torch.empty(splits, b, hq, sq, dtype=torch.float32),
            torch.empty(splits, b, hq, sq, _round_up(d, ctx.head_rounding), dtype=torch.float32))
        out, lse, _, _, _, _, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p)
        del accumulators
        ctx.save_for_backward(query, key, value, out, lse, rng_state, unused)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out = ctx.saved_tensors[:4]
        b, hq, sq, d = query.shape
        hk, sk = key.size(1), key.size(2)
        # attention_backward.cu:82-83 (_flash_attention_backward) at v2.6.0: `grad_out.contiguous()`
        # and `out.contiguous()` of their [b, s, h, d] views: copies unless they are [b, s, h, d]
        # memory already (out is when the query was, flash_outputs), alive to the end. Then
        # flash_api.cpp:934 (softmax_d), :939 (dq_accum), :950-951 (dk, dv expanded) at v2.6.0.
        dout = grad.transpose(1, 2).contiguous()
        out_t = out.transpose(1, 2).contiguous()
        dq, dk, dv = (torch.empty_like(t.transpose(1, 2)) for t in (query, key, value))
        softmax_d = torch.empty(b, hq, _round_up(sq, 128), dtype=torch.float32)
        dq_accum = torch.empty(b, _round_up(sq, 128), hq, _round_up(d, ctx.head_rounding), dtype=torch.float32)
        if hk != hq:  # MQA / GQA: dk, dv per query head, summed over the groups afterwards
            dk_expanded = torch.empty(b, sk, hq, d, dtype=query.dtype)
            dv_expanded = torch.empty(b, sk, hq, d, dtype=query.dtype)
            torch.sum(dk_expanded.view(b, sk, hk, hq // hk, d), 3, out=dk)
            torch.sum(dv_expanded.view(b, sk, hk, hq // hk, d), 3, out=dv)
        del dout, out_t, softmax_d, dq_accum
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None


def _flash_outputs(rules: TorchRules, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                   scale=None):
    """_scaled_dot_product_flash_attention's outputs as CUDA allocates them: the output in the
    layout of the query (flash_api.cpp:439 mha_fwd at v2.6.0: `out = at::empty_like(q_padded)`, q being the
    [b, s, h, d] view of the [b, h, s, d] query: [b, s, h, d] memory for a query projected and
    viewed, [b, h, s, d] memory for one made contiguous), logsumexp fp32 [b, h, s_q], and the
    Philox state: from 2.7 rng_state uint64[2] and the unused uint64 on the device; to 2.6 the
    philox_seed and philox_offset int64 host scalars (flash_api.cpp:491-521 at v2.6.0), as empty
    tensors: no device bytes (`TorchRules.flash_rng_on_device`)."""
    b, h, sq, d = query.shape
    device = query.device
    if rules.flash_rng_on_device:
        seed, offset = (torch.empty(2, dtype=torch.uint64, device=device),
                        torch.empty((), dtype=torch.uint64, device=device))
    else:
        seed, offset = (torch.empty(0, dtype=torch.long, device=device) for _ in range(2))
    return (torch.empty_like(query.transpose(1, 2)).transpose(1, 2),
            torch.empty(b, h, sq, dtype=torch.float32, device=device), None, None, sq, key.size(2),
            seed, offset, torch.empty(0, dtype=query.dtype, device=device))


def _flash_unsplit_batch(heads: int, seq_q: int, sm_count: int) -> int:
    """The smallest batch size from which `_flash_splits` is 1 for these heads and queries:
    b x heads x ceil(seq_q / 64) blocks >= 0.8 x (2 x sm_count) slots."""
    blocks_per_sample = heads * math.ceil(seq_q / 64)
    return max(1, -(-8 * sm_count // (5 * blocks_per_sample)))


def _flash_splits(arch: str, sm_count: int, blocks: int, key_blocks: int, max_splits: int = 128) -> int:
    """flash_api.cpp:262 (num_splits_heuristic) at v2.6.0: the fewest splits within 85% of the best
    occupancy of the card's 2 x sm_count slots. A question (`CudaSemantics.ask`)."""
    sm_slots = 2 * sm_count
    if blocks >= 0.8 * sm_slots:
        return 1
    max_splits = min(max_splits, sm_slots, key_blocks)
    efficiency = []
    for n in range(1, max_splits + 1):
        eligible = n == 1 or math.ceil(key_blocks / n) != math.ceil(key_blocks / (n - 1))
        waves = blocks * n / sm_slots
        efficiency.append(waves / math.ceil(waves) if eligible else 0.0)
    best = max(efficiency, default=0.0)
    return next((n for n, e in enumerate(efficiency, 1) if e and e >= 0.85 * best), 1)


# ---------------------------------------------------------------------------- memory-efficient attention

def efficient_attention(query, key, value, attn_mask, dropout_p, kernel: tuple[int, int, int]):
    """attention.cpp at v2.6.0: a bool mask becomes an additive one in the query's dtype, of the
    mask's own shape (:539 convert_boolean_attn_mask); :742 preprocess_mask (:574-589) then aligns
    the mask as given (:567 pad_bias:
    the last dim padded to the next multiple of mem_eff_alignment = 8 and sliced back, unless
    every stride but the last is a multiple of 8 and the last is 1) and expands it, a view, to
    [b, h, s_q, s_k]. Dropout and the card pick the backward's `kernel`, hence its workspace."""
    if attn_mask is not None:
        attn_mask = _additive_mask(attn_mask, query.dtype)
        if not _aligned(attn_mask, 8):
            last = attn_mask.size(-1)
            attn_mask = F.pad(attn_mask, (0, 8 - last % 8))[..., :last]
        attn_mask = attn_mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    keep_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return _Efficient.apply(query, key, value, attn_mask, keep_lse, kernel)


def _aligned(t, alignment: int) -> bool:
    """attention.cpp:557 (aligned_tensor) at v2.6.0."""
    return all(s % alignment == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1


class _Efficient(torch.autograd.Function):
    """attention.cu:1005 (_efficient_attention_forward) and attention_backward.cu:248
    (_efficient_attention_backward) at v2.6.0. Causality changes no allocation, dropout only the
    backward's kernel; the seed and offset are CPU scalars outside CUDA-graph capture
    (attention.cu:1087-1126, Note [Seed and Offset Device])."""

    @staticmethod
    def forward(ctx, query, key, value, bias, keep_lse, kernel):
        b, h, sq, _ = query.shape
        dv = value.size(-1)
        # Kernels for head dims > 128 keep the output in global memory: an fp32 accumulator
        # (kNeedsOutputAccumulatorBuffer, attention.cu:1282-1288 at v2.6.0) when the output is
        # fp16 / bf16, alive while they run.
        accumulator = (torch.empty(b, sq, h, dv, dtype=torch.float32)
                       if query.element_size() == 2 and max(query.size(-1), dv) > 128 else None)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, keep_lse)
        del accumulator
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, bias, out, _ = ctx.saved_tensors
        b, h, sq, d = query.shape
        sk, dv = key.size(2), value.size(-1)
        # attention_backward.cu:313 (_efficient_attention_backward) at v2.6.0: grad_out made
        # contiguous as [b, s, h, d_v] (a copy unless it is one already, as out is), alive to the end.
        dout = grad.transpose(1, 2).contiguous()
        # dq, dk, dv apart (:377-379): the SDPA path leaves shared_storage_dqdkdv off (its one
        # [b, s, 3, h, d] chunk is only for callers of _efficient_attention_backward that ask).
        dq = torch.empty(b, sq, h, d, dtype=query.dtype)
        dk = torch.empty(b, sk, h, d, dtype=key.dtype)
        dv_ = torch.empty(b, sk, h, dv, dtype=value.dtype)
        dbias = None
        if bias is not None and ctx.needs_input_grad[3]:
            dbias = torch.empty(*bias.shape[:-1], _round_up(bias.size(-1), 16), dtype=bias.dtype)[..., :bias.size(-1)]
        # delta = rowsum(dout * out) (:541): written by the 16-bit kernels, made by torch ops for fp32.
        if query.element_size() == 2:
            delta = torch.empty(b, h, sq, dtype=torch.float32)
        else:
            delta = (dout.float() * out.transpose(1, 2).float()).sum(-1).transpose(-2, -1).contiguous()
        # The dq accumulators and, for some 16-bit kernels, dk / dv staging: one buffer (:693-695),
        # alive while the kernel runs (zeroed in place when the keys are split).
        workspace = torch.empty(_efficient_backward_workspace(b, h, sq, sk, d, dv, query.element_size() == 2,
                                                              ctx.kernel), dtype=torch.uint8)
        del dout, delta, workspace
        return dq.transpose(1, 2), dk.transpose(1, 2), dv_.transpose(1, 2), dbias, None, None


# cuda/mem_eff_attention/kernels/cutlassB.h:227 dispatch_cutlassB_bf16_sm80 at v2.6.0 (and its f16,
# f32 twins; sm80 to sm90 share them): the
# backward kernels in dispatch order as (kBlockSizeI, kBlockSizeJ, kMaxK, sizeof(SharedStorage)
# in KiB rounded up; fp16's, never below bf16's), the seqaligned twins left out (same shapes).
# fp32 has the same kernels with dropout; fp16 / bf16 dispatch their k96 kernel on sm86 / sm89
# only. The sizes are sizeof(Kernel::SharedStorage) as a host build of kernel_backward.h (with
# CUTLASS 4.2) prints them.
_EFFICIENT_BW_KERNELS = {
    (2, False): ((64, 64, 32, 40), (64, 64, 64, 44), (128, 64, 96, 90), (128, 128, 128, 151), (64, 64, 128, 34),
                 (128, 64, 65536, 60), (64, 64, 65536, 34)),
    (2, True): ((64, 64, 32, 40), (64, 64, 64, 52), (128, 128, 128, 159), (64, 64, 128, 34), (128, 64, 65536, 60),
                (64, 64, 65536, 34)),
    (4, False): ((64, 64, 32, 53), (64, 64, 64, 53), (128, 64, 128, 119), (64, 64, 128, 67), (128, 64, 65536, 119),
                 (64, 64, 65536, 67)),
}
# sharedMemPerBlockOptin (CUDA programming guide, per compute capability): 8.0 163 KiB, 8.6 and 8.9
# 99 KiB, 9.0 227 KiB. Only sm86 / sm89 turn kernels down: the 128 x 128 ones and fp32's 128 x 64.
SMEM_OPTIN_KIB = {"sm80": 163, "sm86": 99, "sm89": 99, "sm90": 227}


def _efficient_backward_kernel(arch: str, sm_count: int, half: bool, dropout: bool, max_k: int) -> tuple[int, int, int]:
    """attention_backward.cu:504 (launchKernel) at v2.6.0: the first kernel whose kMaxK covers max(d, d_v), with
    dropout when it is needed and shared memory the card can give. (kBlockSizeI, kBlockSizeJ, kMaxK).
    A question (`CudaSemantics.ask`)."""
    for i, j, k_max, smem_kib in _EFFICIENT_BW_KERNELS[(2, dropout) if half else (4, False)]:
        if k_max == 96 and arch not in ("sm86", "sm89"):
            continue
        if k_max >= max_k and smem_kib <= SMEM_OPTIN_KIB[arch]:
            return i, j, k_max
    raise AssertionError("cutlassB: no kernel found to launch")  # unreachable: k65536 always fits


def _efficient_settled_batch(h, sk, half: bool, kernel: tuple[int, int, int]) -> int:
    """A batch size from which `_efficient_backward_workspace`'s split of the keys no longer changes
    with the batch: one split once b x h >= 256 (with few keys), or once b x h > 100 where
    dk / dv are staged (200 // (b x h) <= 1), with the backward's `kernel`."""
    i, j, k_max = kernel
    if half and k_max > i:
        return -(-101 // h)
    return -(-256 // h) if sk <= 2 * j else 1


def _efficient_backward_workspace(b, h, sq, sk, d, dv, half: bool, kernel: tuple[int, int, int]) -> int:
    """The bytes of _efficient_attention_backward's workspace: mem_eff_attention/kernel_backward.h:886
    (workspace_size), b * h * workspace_strideBH() (:879) floats, for the kernel chosen and
    attention_backward.cu:655-678's num_splits_key (the SDPA path passes none, so the heuristic
    decides; no SM count in it), at v2.6.0."""
    i, j, k_max = kernel
    # kOutputInRF = 16-bit and kMaxK <= kBlockSizeI: dk, dv live in registers. Otherwise a 16-bit
    # kernel stages them in fp32 (kNeedsAccumGradK / V: output_t is not float); fp32 writes them.
    stage_dk_dv = half and k_max > i
    splits = math.ceil(sk / j)
    if b * h >= 256 and sk <= 2 * j:  # enough parallelism, too few keys to gain from splitting
        splits = 1
    if stage_dk_dv:  # splitting multiplies the staging: capped at 200 blocks in all
        splits = min(splits, 200 // (b * h))
    splits = max(splits, 1)
    gk = splits * j * _round_up(d, i) if stage_dk_dv else 0
    gv = splits * j * _round_up(dv, i) if stage_dk_dv else 0
    # kNeedsAccumGradQ (split keys, sm70+): one GradQTempStorage per (kBlockSizeI rows of q,
    # MatmulGradQ's N = kBlockSizeJ columns of d): a 16-byte lock / counter header and
    # AccumTileGmem::kElementsStored = kNumThreads * FragmentC::kElements floats. Its 32 x 32
    # warp tiles give each of the kNumThreads = 32 * (I * J / 1024) threads 32 * 32 / 32 = 32
    # accumulators, so I * J floats: (16 + 4 * I * J) / 4 = 4 + I * J floats a tile.
    gq = math.ceil(sq / i) * math.ceil(d / j) * (4 + i * j)
    return b * h * _round_up(gk + gv + gq, 4) * 4  # workspace_strideBH aligns each (b, h) to 128 bits


def _efficient_outputs(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                       scale=None):
    """_scaled_dot_product_efficient_attention's outputs as CUDA allocates them (attention.cu:1261,
    :1269-1273 at v2.6.0): the output in [b, s, h, d] memory, logsumexp fp32 [b, h, s_q rounded up
    to 32] (kAlignLSE, mem_eff_attention/kernel_forward.h:113) when asked, and
    seed and offset, host scalars on CUDA, as empty tensors: no device bytes."""
    b, h, sq, _ = query.shape
    device = query.device
    return (torch.empty(b, sq, h, value.size(-1), dtype=query.dtype, device=device).transpose(1, 2),
            torch.empty(b, h, _round_up(sq, 32) if compute_log_sumexp else 0, dtype=torch.float32, device=device),
            torch.empty(0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long, device=device))


# ---------------------------------------------------------------------------- cuDNN attention

def cudnn_attention(query, key, value, attn_mask, dropout_p, is_causal, rules: TorchRules):
    """attention.cpp:717-721's cuDNN case at v2.6.0: a bool mask made additive in the query's dtype
    (:545 convert_boolean_attn_mask_cudnn), then _scaled_dot_product_cudnn_attention with the
    logsumexp computed when an input requires grad (:618 should_compute_logsumexp)."""
    if attn_mask is not None:
        attn_mask = _additive_mask(attn_mask, query.dtype)
    keep_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return _Cudnn.apply(query, key, value, attn_mask, keep_lse, dropout_p, is_causal, rules.wheel_cudnn)


class _Cudnn(torch.autograd.Function):
    """_scaled_dot_product_cudnn_attention_cuda (attention.cu:748) -> aten/src/ATen/native/cudnn/
    MHA.cpp:617 run_cudnn_SDP_fprop / :717 run_cudnn_SDP_bprop at v2.6.0. derivatives.yaml:2943 at
    v2.13.0: the backward (_scaled_dot_product_cudnn_attention_backward) keeps query, key, value,
    output, logsumexp, philox_seed, philox_offset and attn_bias."""

    @staticmethod
    def forward(ctx, query, key, value, bias, keep_lse, dropout_p, is_causal, wheel_cudnn):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, bias, keep_lse, dropout_p, is_causal)
        ctx.save_for_backward(query, key, value, out, lse, seed, offset, bias)
        ctx.wheel_cudnn = wheel_cudnn
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out = ctx.saved_tensors[:4]
        b, h, sq, d = query.shape
        # MHA.cpp:747-765 (run_cudnn_SDP_bprop) at v2.6.0: a cuDNN older than 9.5.1 (CUDNN_VERSION
        # < 90501, the wheels of torch 2.5 / 2.6) needs grad_output in the strides of the output, a
        # newer one only a contiguous last dim; otherwise permute_to_matching_layout (:328) copies
        # it in the output's layout.
        same_strides = grad.stride() == out.stride()
        dout = (torch.empty_like(out) if (not same_strides if ctx.wheel_cudnn < 90501 else grad.stride(-1) != 1)
                else grad)
        dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))  # alloc_with_matching_layout
        # The graph's workspace (mha_graph.get_workspace_size()) is cuDNN's engine's, not in
        # PyTorch's source: modelled as the FlashAttention-2 backward's fp32 dQ accumulator
        # [b, s_q, h, d] and softmax sum [b, h, s_q], the sizes NVIDIA's own cuDNN SDPA backward
        # asks for (TransformerEngine fused_attn_f16_arbitrary_seqlen.cu: dqAccum_workspace_size,
        # softmaxSum_workspace_size), alive while the kernel runs.
        workspace = torch.empty(b * sq * h * d * 4 + b * h * sq * 4, dtype=torch.uint8)
        del dout, workspace
        return dq, dk, dv, None, None, None, None, None


def _cudnn_outputs(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                   return_debug_mask=False, *, scale=None):
    """_scaled_dot_product_cudnn_attention's outputs as CUDA allocates them (MHA.cpp:617
    run_cudnn_SDP_fprop at v2.6.0): the output in the query's layout (:639 alloc_with_matching_layout),
    the logsumexp fp32 [b, h, s_q, 1] when asked (:644 softmaxstats), and the Philox seed and offset,
    two 0-dim int64 tensors on the device with or without dropout (cuda/attention.cu:790-791
    _scaled_dot_product_cudnn_attention_cuda at v2.6.0; so in the newest source's
    _cudnn_attention_forward)."""
    b, h, sq, _ = query.shape
    device = query.device
    out = torch.empty_strided((b, h, sq, value.size(-1)), _matching_strides(query, value.size(-1)), dtype=query.dtype,
                              device=device)
    lse = torch.empty(b, h, sq if compute_log_sumexp else 0, 1, dtype=torch.float32, device=device)
    seed, offset = (torch.empty((), dtype=torch.long, device=device) for _ in range(2))
    return out, lse, None, None, sq, key.size(2), seed, offset, torch.empty(0, dtype=query.dtype, device=device)


def _matching_strides(query, d_v: int) -> tuple[int, ...]:
    """MHA.cpp:296 (alloc_with_matching_layout) at v2.6.0: dense strides for [b, h, s_q, d_v] in the dimension order
    of the query's strides (largest stride outermost)."""
    order = sorted(range(4), key=lambda i: -query.stride(i))
    sizes = [*query.shape[:3], d_v]
    strides, running = [0] * 4, 1
    for i in reversed(order):
        strides[i] = running
        running *= sizes[i]
    return tuple(strides)


# ---------------------------------------------------------------------------- math

def _additive_mask(mask, dtype):
    """attention.cpp:525-541 (convert_boolean_attn_mask) at v2.6.0: a bool mask as 0 where kept,
    -inf where masked."""
    if mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype), torch.scalar_tensor(-math.inf, dtype=dtype))


def math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """attention.cpp:792 (_scaled_dot_product_attention_math) at v2.6.0, op by op: fp16 / bf16
    inputs are upcast to fp32 (:808; allowFP16BF16ReductionMathSDP is off by default), the
    (s_q x s_k) scores and probabilities are materialised, grouped-query keys and values repeated
    (:858), a mask added to the scores in place (:864 `attn.add_`, for tensors that are no
    subclass; so in the newest source), and dropout is at::dropout (:877), which on CUDA is
    native_dropout with its bool mask."""
    origin = query.dtype
    if origin in (torch.float16, torch.bfloat16):
        query, key, value = query.float(), key.float(), value.float()
    factor = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.size(-1)))
    query = query * factor
    if is_causal:
        attn_mask = _additive_mask(torch.ones(query.size(-2), key.size(-2), dtype=torch.bool).tril(), query.dtype)
    elif attn_mask is not None:
        attn_mask = _additive_mask(attn_mask, query.dtype)
    if enable_gqa and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    attn = query @ (key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    out = (attn @ value).to(origin)
    attn.to(origin)  # the second output, the probabilities in the input dtype: made, then dropped
    return out


# ---------------------------------------------------------------------------- dropout

def dropout(input, p, train):
    """aten::dropout as native/Dropout.cpp:132-139 (at v2.6.0) runs it on CUDA: for 0 < p < 1 the fused native_dropout,
    whose backward keeps a bool mask; anything else as on CPU. (In-place dropout_ takes the
    unfused path on CUDA too: it is not replaced.)"""
    if not train or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype)
    return torch.native_dropout(input, p, True)[0]


# The attention kernels' autograd Functions: each one's backward gives gradients to its inputs and
# runs nothing else (no parameters of its own, no backward of another graph inside it).
KERNEL_FUNCTIONS = (_Flash, _Efficient, _Cudnn)

__all__ = ["ARCHS", "ATTENTION_BACKENDS", "CudaSemantics", "KERNEL_FUNCTIONS", "SM_COUNTS", "check_backend_available",
           "cuda_semantics", "cudnn_refusal", "efficient_refusal", "flash_refusal", "priority", "same_answers"]
