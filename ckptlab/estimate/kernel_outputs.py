"""The outputs of the kernels whose dtype or layout torch's fake kernels get wrong: the statistics
normalization kernels keep, and the input gradients of norms and log-softmax.

A layer, group or batch norm whose input is bf16 or fp16 while its weight and bias are fp32 (a
LayerNorm fed by a Linear under CPU autocast, a bf16 CNN whose norms keep fp32 affine parameters)
runs a "mixed type" kernel: its mean and rstd (saved for backward) are fp32, and group norm's
backward gives the input's gradient in the input's dtype. torch's fake kernels (its
decompositions at v2.13.0) give the statistics in the input's dtype and group norm's input
gradient in fp32 (which autograd then casts, one more copy): a fake step of such a model holds
other bytes than the real one. On CUDA, layer norm keeps its statistics in the accumulate type of
its input, fp32 for bf16 and fp16, mixed or not: a bf16 model's LayerNorms (`bf16-weights`) keep
twice the bytes the CPU's do.

`kernel_outputs(fake_mode, cuda)` gives these ops' outputs the real kernels' dtypes and layouts (a
new fake tensor of the same shape) inside ckptlab's fake mode (`fake_mode.RetypingFakeMode`:
a lookup per op), or in a dispatch mode just above another fake mode (`KernelOutputs`), so the tracker
above sees what the real step allocates:

- native_layer_norm: CPU: fp32 statistics where mixed, else the input's dtype (layer_norm.cpp
  layer_norm_cpu: `param_scalar_type(input, mixed_type)`); CUDA: `toAccumulateType(input, true)`
  (cuda/layer_norm_kernel.cu layer_norm_cuda).
- native_group_norm: fp32 statistics where mixed, on both (group_norm.cpp native_group_norm, one
  kernel entry for every device); native_group_norm_backward: the input's gradient in the input's
  dtype and its suggested memory format (`empty_like(X, ..., X.suggest_memory_format())`).
- native_layer_norm_backward: the input's gradient contiguous, on both (`empty_like` of the
  contiguous input, layer_norm_backward_cpu and _cuda).
- native_batch_norm, _native_batch_norm_legit (with and without running stats): CPU: fp32 saved
  statistics where mixed (Normalization.cpp batch_norm_cpu); native_batch_norm_backward: CPU: the
  input's gradient in the input's suggested memory format. On CUDA left as torch's fake kernels
  give them: CUDA runs cuDNN's batch norm where it can, whose reserve buffer only cuDNN sizes.
- _log_softmax_backward_data: the input's gradient contiguous, on both (SoftMax.cpp, its structured
  meta function: `LEGACY_CONTIGUOUS_MEMORY_FORMAT`; fp16 where the gradient is fp32 and the input
  was fp16, CUDA's half-to-float log-softmax); torch's fake kernel lays it out as the gradient.

torch's fake kernels give these backwards' input gradients the strides of the incoming gradient:
where that is a transposed or permuted one (a norm followed by a transpose, Swin's window
partition, a log-softmax transposed into `nll_loss`), a later `view` of it becomes a copy on fake
tensors that the real step does not make (and the other way round). Dropout's backward needs no
rule: torch's fake kernel makes its input gradient in the gradient's suggested memory format, as
CUDA's fused dropout does (cuda/Dropout.cu dropout_backward_cuda: `empty_like(grad,
grad.suggest_memory_format())`), and on the CPU `nn.Dropout` runs unfused (elementwise ops, no
`native_dropout`: Dropout.cpp `is_fused_kernel_acceptable` takes CUDA, XPU and other devices only).

"Mixed" is `is_mixed_type` (native/cpu/mixed_data_type.h): the defined parameters' dtype differs
from the input's. The CPU rules are checked against the installed torch's CPU kernels
(tests/test_kernel_outputs.py); the CUDA rules cite the newest stored source (no tag source).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from ..probe.memory import fake_device
from .fake_mode import RetypingFakeMode

aten = torch.ops.aten


def _mixed(x: torch.Tensor, *params) -> bool:
    """`is_mixed_type`: the defined parameters' dtype is not the input's (other arguments skipped)."""
    defined = [p for p in params if isinstance(p, torch.Tensor)]
    return bool(defined) and defined[0].dtype != x.dtype


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """`toAccumulateType(dtype, is_cuda=true)` for the floating types."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _retyped(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor like `t` in `dtype`, made without a dispatch (inside the fake mode's own)."""
    if t.dtype == dtype:
        return t
    with no_dispatch():
        meta = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
    return FakeTensor(t.fake_mode, meta, t.fake_device)


def _grad_input(out: tuple, memory_format: torch.memory_format, dtype: Optional[torch.dtype] = None) -> tuple:
    """(input's gradient, weight's, bias's) with the input's gradient, where asked for, as the
    kernel allocates it (`_allocated`)."""
    return out if out[0] is None else (_allocated(out[0], memory_format, dtype), out[1], out[2])


def _allocated(t: torch.Tensor, memory_format: torch.memory_format, dtype: Optional[torch.dtype] = None):
    """`t` in `memory_format` and `dtype` (default its own), made without a dispatch where it is
    not already so: as the kernel allocates it."""
    with no_dispatch():
        meta = torch.empty(t.shape, dtype=dtype or t.dtype, device="meta", memory_format=memory_format)
    if meta.dtype == t.dtype and meta.stride() == t.stride():
        return t
    return FakeTensor(t.fake_mode, meta, t.fake_device)


def _stats(out: tuple, dtype: torch.dtype) -> tuple:
    """(output, statistic, statistic) with the statistics in `dtype`."""
    return (out[0], _retyped(out[1], dtype), _retyped(out[2], dtype))


def _layer_norm(cuda: bool, args: tuple, out: tuple) -> tuple:
    x, weight, bias = args[0], args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None
    if cuda:
        return _stats(out, _accumulate(x.dtype))
    return _stats(out, torch.float32 if _mixed(x, weight, bias) else x.dtype)


def _group_norm(cuda: bool, args: tuple, out: tuple) -> tuple:
    x, weight, bias = args[0], args[1], args[2]
    return _stats(out, torch.float32 if _mixed(x, weight, bias) else x.dtype)


def _group_norm_backward(cuda: bool, args: tuple, out: tuple) -> tuple:
    x = args[1]
    return _grad_input(out, suggest_memory_format(x), x.dtype)


def _layer_norm_backward(cuda: bool, args: tuple, out: tuple) -> tuple:
    return _grad_input(out, torch.contiguous_format)


def _batch_norm_backward(cuda: bool, args: tuple, out: tuple) -> tuple:
    if cuda:
        return out
    return _grad_input(out, suggest_memory_format(args[1]))


def _log_softmax_backward(cuda: bool, args: tuple, out: torch.Tensor) -> torch.Tensor:
    grad, input_dtype = args[0], args[3]
    dtype = torch.float16 if grad.dtype == torch.float32 and input_dtype == torch.float16 else grad.dtype
    return _allocated(out, torch.contiguous_format, dtype)


def _batch_norm(cuda: bool, args: tuple, out: tuple) -> tuple:
    if cuda:
        return out
    x = args[0]   # then weight, bias, and (not in the no_stats overload) the running statistics
    return _stats(out, torch.float32 if _mixed(x, *args[1:5]) else x.dtype)


_RULES: dict[object, Callable[[bool, tuple, tuple], tuple]] = {
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.native_group_norm.default: _group_norm,
    aten.native_group_norm_backward.default: _group_norm_backward,
    aten.native_batch_norm.default: _batch_norm,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten._native_batch_norm_legit.default: _batch_norm,
    aten._native_batch_norm_legit.no_stats: _batch_norm,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
}


def rules(cuda: bool) -> dict:
    """{op: rule(args, outputs) -> outputs} for the CPU's kernels or (`cuda`) CUDA's."""
    return {op: functools.partial(rule, cuda) for op, rule in _RULES.items()}


RULES = {False: rules(False), True: rules(True)}


@contextlib.contextmanager
def kernel_outputs(fake_mode: FakeTensorMode, cuda: bool = False):
    """While inside, `fake_mode`'s ops give the real kernels' dtypes and layouts (module
    docstring): through its rules where it is ckptlab's, else a `KernelOutputs` mode above it (the
    caller is inside `fake_mode`)."""
    if not isinstance(fake_mode, RetypingFakeMode):
        with KernelOutputs(cuda):
            yield
        return
    before, fake_mode.output_rules = fake_mode.output_rules, RULES[cuda]
    try:
        yield
    finally:
        fake_mode.output_rules = before


class KernelOutputs(TorchDispatchMode):
    """Above a fake mode that applies no rules: the ops' outputs in the dtypes and layouts the real
    kernels give, on the CPU or (`cuda`) as CUDA's (module docstring)."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.rules = RULES[cuda]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = fake_device(func, args)
        if device is not None:
            return device
        out = func(*args, **(kwargs or {}))
        rule = self.rules.get(func)
        return out if rule is None else rule(args, out)


__all__ = ["KernelOutputs", "RULES", "kernel_outputs", "rules"]
