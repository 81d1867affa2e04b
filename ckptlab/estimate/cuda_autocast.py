"""CUDA autocast on CPU tensors: `cuda_autocast(torch.bfloat16)` runs a step under the op lists of
`torch.autocast("cuda")` where the tensors are CPU (fake) tensors.

CPU autocast has other lists than CUDA's: it leaves softmax, log_softmax, layer_norm, group_norm,
pow, exp, sum and the other ops of CUDA's fp32 lists in bf16, so a CPU prediction of an autocast
step keeps those activations at half their CUDA size. Inside `cuda_autocast`, CPU autocast is on
and its per-op kernels (the AutocastCPU dispatch key) are replaced by CUDA's policies: the ops of
CUDA's lists get a kernel that casts as autocast_mode.h's WrapFunction does, the ops only CPU
lists fall through. The casts happen above autograd, as real autocast's do, so autograd records
them (ToCopyBackward0), and lower-precision casts of fp32 leaf tensors that require grad (the
weights) are cached until the outermost `cuda_autocast` exits (autocast_mode.cpp:120 cached_cast
at v2.6.0).

The lists are AT_FORALL_LOWER_PRECISION_FP (:820), AT_FORALL_FP32 (:855),
AT_FORALL_FP32_SET_OPT_DTYPE (:915), AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (:934) and
AT_FORALL_PROMOTE (:961) of aten/src/ATen/autocast_mode.h at v2.11.0, the same at every tag from
v2.4.0 to v2.11.0, and the banned binary_cross_entropy of autocast_mode.cpp:151 at v2.6.0; the
lists of the torch version modelled add what that version adds (`FP32_FROM`: rms_norm from 2.12,
autocast_mode.h:876 at v2.12.0, `estimate.torch_versions`); an op the running torch does not
have is skipped. Known difference: for fp16,
CUDA's softmax and log_softmax read fp16 input directly into an fp32 result, where the CPU
kernel first copies the input to fp32 (an extra transient); for bf16 both copy.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .torch_versions import torch_rules

LOWER_PRECISION_FP = (
    ("_convolution", "deprecated"), ("_convolution", ""), ("conv1d", ""), ("conv2d", ""), ("conv3d", ""),
    ("conv_tbc", ""), ("conv_transpose1d", ""), ("conv_transpose2d", "input"), ("conv_transpose3d", "input"),
    ("convolution", ""), ("prelu", ""), ("addmm", ""), ("addmv", ""), ("addr", ""), ("matmul", ""), ("einsum", ""),
    ("mm", ""), ("mv", ""), ("linalg_vecdot", ""), ("linear", ""), ("addbmm", ""), ("baddbmm", ""), ("bmm", ""),
    ("chain_matmul", ""), ("linalg_multi_dot", ""), ("_thnn_fused_lstm_cell", ""), ("_thnn_fused_gru_cell", ""),
    ("lstm_cell", ""), ("gru_cell", ""), ("rnn_tanh_cell", ""), ("rnn_relu_cell", ""),
    ("_scaled_dot_product_flash_attention", ""), ("scaled_dot_product_attention", ""))
FP32 = (
    ("acos", ""), ("asin", ""), ("cosh", ""), ("erfinv", ""), ("exp", ""), ("expm1", ""), ("log", ""), ("log10", ""),
    ("log2", ""), ("log1p", ""), ("reciprocal", ""), ("rsqrt", ""), ("sinh", ""), ("tan", ""),
    ("pow", "Tensor_Scalar"), ("pow", "Tensor_Tensor"), ("pow", "Scalar"), ("softplus", ""), ("layer_norm", ""),
    ("native_layer_norm", ""), ("group_norm", ""), ("frobenius_norm", "dim"), ("nuclear_norm", ""),
    ("nuclear_norm", "dim"), ("cosine_similarity", ""), ("poisson_nll_loss", ""), ("cosine_embedding_loss", ""),
    ("nll_loss", ""), ("nll_loss2d", ""), ("hinge_embedding_loss", ""), ("kl_div", ""), ("l1_loss", ""),
    ("smooth_l1_loss", ""), ("huber_loss", ""), ("mse_loss", ""), ("margin_ranking_loss", ""),
    ("multilabel_margin_loss", ""), ("soft_margin_loss", ""), ("triplet_margin_loss", ""), ("multi_margin_loss", ""),
    ("binary_cross_entropy_with_logits", ""), ("dist", ""), ("pdist", ""), ("cdist", ""), ("renorm", ""),
    ("logsumexp", ""), ("upsample_nearest1d", ""), ("_upsample_nearest_exact1d", ""), ("upsample_nearest2d", ""),
    ("_upsample_nearest_exact2d", ""), ("upsample_nearest3d", ""), ("_upsample_nearest_exact3d", ""),
    ("upsample_linear1d", ""), ("upsample_bilinear2d", ""), ("_upsample_bilinear2d_aa", ""),
    ("upsample_trilinear3d", ""), ("upsample_bicubic2d", ""), ("_upsample_bicubic2d_aa", ""))
FP32_SET_OPT_DTYPE = (
    ("prod", ""), ("prod", "dim_int"), ("prod", "dim_Dimname"), ("softmax", "int"), ("softmax", "Dimname"),
    ("log_softmax", "int"), ("log_softmax", "Dimname"), ("cumprod", ""), ("cumprod", "dimname"), ("cumsum", ""),
    ("cumsum", "dimname"), ("linalg_vector_norm", ""), ("linalg_matrix_norm", ""), ("linalg_matrix_norm", "str_ord"),
    ("sum", ""), ("sum", "dim_IntList"), ("sum", "dim_DimnameList"))
# Ops a later torch adds to AT_FORALL_FP32, by the TorchRules property that says whether it has them.
FP32_FROM = {("rms_norm", ""): "autocast_fp32_rms_norm"}
# fp32_append_dtype: norm without a dtype is redispatched to the overload with one, in fp32.
FP32_APPEND_DTYPE = {("norm", "Scalar"): "ScalarOpt_dtype", ("norm", "ScalarOpt_dim"): "ScalarOpt_dim_dtype",
                     ("norm", "names_ScalarOpt_dim"): "names_ScalarOpt_dim_dtype"}
PROMOTE = (("addcdiv", ""), ("addcmul", ""), ("atan2", ""), ("bilinear", ""), ("cross", ""), ("dot", ""), ("vdot", ""),
           ("grid_sampler", ""), ("index_put", ""), ("tensordot", ""), ("scatter_add", ""))

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


class _State:
    """The registered policies (while any user holds them) and the weight-cast cache (used
    inside `cuda_autocast`, cleared when the outermost one exits)."""

    policies: torch.library.Library | None = None
    users = 0
    autocast_depth = 0
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(weight) -> (weight, its cast)


@contextlib.contextmanager
def cuda_autocast_policies(torch_version: str | None = None) -> Iterator[None]:
    """While inside, CPU autocast, wherever it is entered, follows CUDA autocast's lists (those of
    `torch_version`, default the installed torch's): the step's own autocast, and the one
    torch.utils.checkpoint re-enters to recompute a region. Nested inside another, the outer
    one's lists stay."""
    if _State.users == 0:
        _State.policies = _cuda_policies(torch_version)
    _State.users += 1
    try:
        yield
    finally:
        _State.users -= 1
        if _State.users == 0:
            _State.policies._destroy()
            _State.policies = None


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """`torch.autocast("cuda", dtype)` for CPU (fake) tensors: see the module docstring."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype!r} is invalid: allowed are torch.bfloat16, torch.float16")
    _State.autocast_depth += 1
    try:
        with cuda_autocast_policies(), torch.autocast("cpu", dtype=dtype):
            yield
    finally:
        _State.autocast_depth -= 1
        if _State.autocast_depth == 0:
            _State.cache.clear()


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(t, dtype: torch.dtype):
    """autocast_mode.cpp cached_cast. The cache lives inside `cuda_autocast`; a recomputation's
    autocast, entered by torch.utils.checkpoint, casts without it."""
    if not _eligible(t) or t.dtype == dtype:
        return t
    if (_State.autocast_depth and dtype == torch.get_autocast_dtype("cpu") and t.dtype == torch.float32 and t.requires_grad
            and t.is_leaf and not t._is_view()):
        hit = _State.cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = _State.cache[id(t)] = (t, t.to(dtype))
        return hit[1]
    return t.to(dtype)


def _kernel(op, policy: str):
    """One op's autocast kernel (autocast_mode.h's WrapFunction_ for `policy`): cast, then call the
    op with autocast excluded, as the C++ kernels redispatch."""
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        if policy == "lower_precision_fp":
            args, kwargs = tree_map(lambda t: _cast(t, torch.get_autocast_dtype("cpu")), (args, kwargs))
        elif policy == "fp32":
            args, kwargs = tree_map(lambda t: _cast(t, torch.float32), (args, kwargs))
        elif policy == "fp32_set_opt_dtype" and args and _eligible(args[0]):
            if dtype_index is not None and dtype_index < len(args):
                args = (*args[:dtype_index], args[dtype_index] or torch.float32, *args[dtype_index + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif policy == "promote":
            widest = torch.get_autocast_dtype("cpu")  # promote_type starts from the lower precision
            for t in tree_leaves((args, kwargs)):
                if _eligible(t):
                    widest = torch.promote_types(widest, t.dtype)
            args, kwargs = tree_map(lambda t: _cast(t, widest), (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return op(*args, **kwargs)

    return kernel


def _append_dtype_kernel(target):
    """fp32_append_dtype: the overload with a dtype, fp32 when the first argument is eligible."""
    def kernel(self, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return target(self, *args, **kwargs, dtype=torch.float32 if _eligible(self) else self.dtype)
    return kernel


def _banned_binary_cross_entropy(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
                       "(CUDA autocast refuses them); use binary_cross_entropy_with_logits")


def _cuda_policies(torch_version: str | None = None) -> torch.library.Library:
    """A library registering CUDA's policies of `torch_version` for the AutocastCPU key, and a
    fallthrough for every op that only CPU autocast lists; destroying it restores CPU autocast."""
    rules = torch_rules(torch_version)
    fp32 = FP32 + tuple(op for op, has in FP32_FROM.items() if getattr(rules, has))
    lib = torch.library.Library("aten", "IMPL")
    registered = set()

    def register(name: str, overload: str, make_kernel) -> None:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or (overload or "default") not in packet.overloads():
            return  # an op this torch does not have
        qualified = f"{name}.{overload}" if overload else name
        lib.impl(qualified, make_kernel(packet), "AutocastCPU")
        registered.add(f"aten::{qualified}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": CPU autocast's, on purpose
        for policy, ops in (("lower_precision_fp", LOWER_PRECISION_FP), ("fp32", fp32),
                            ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE), ("promote", PROMOTE)):
            for name, overload in ops:
                register(name, overload, lambda packet, o=overload, p=policy: _kernel(getattr(packet, o or "default"), p))
        for (name, overload), target in FP32_APPEND_DTYPE.items():
            register(name, overload, lambda packet, t=target: _append_dtype_kernel(getattr(packet, t)))
        register("binary_cross_entropy", "", lambda packet: _banned_binary_cross_entropy)
        for qualified in torch._C._dispatch_get_all_op_names():
            if (qualified.startswith("aten::") and qualified not in registered
                    and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, torch._C.DispatchKey.AutocastCPU)):
                lib.impl(qualified[len("aten::"):], torch.library.fallthrough_kernel, "AutocastCPU")
    return lib


__all__ = ["FP32", "FP32_FROM", "FP32_SET_OPT_DTYPE", "LOWER_PRECISION_FP", "PROMOTE", "cuda_autocast",
           "cuda_autocast_policies"]
