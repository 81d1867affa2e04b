"""The fake-tensor mode a prediction runs in: torch's `FakeTensorMode`, with cheaper cache keys and
views.

A traced step is bound by FakeTensorMode's dispatch, and most of each dispatch is its cache key:
every tensor argument becomes a `TensorMetadata` dataclass, flattened field by field through a
recursive walk that runs two import statements on each call (under a profiler, 30% of the time
of tests/test_fast_path.py's equality tests).
`FakeMode` keys the same cache by the same facts, read straight from each strided fake tensor
into one tuple: dtype, shape, strides, device, storage offset and bytes, requires_grad and the
quantized, conjugate, negative and inference bits (torch's memory format is left out: it is a
function of the shape and strides, which are in). Any other argument but a number, a string,
None, a dtype, device, layout or memory format (symbolic sizes, sparse layouts, another mode's or
real tensors, constants, functions, graph modules) sends the dispatch to torch's own key, which
caches or bypasses it as it always does (its walk still asks this mode for the parts it recurses
into, a tensor's shape and strides or a nested list, which come back keyed here). A key made here
holds a tuple where torch's flattened keys never do (they flatten every tuple), so the two kinds
of keys in the shared cache never meet. The facts read are those of torch's `TensorMetadata`: a
torch whose metadata has other fields, or whose key is made through another method, keeps
torch's own keys (`RetypingFakeMode`, `new_fake_mode`). Both apply the output rules a prediction
sets (`estimate.kernel_outputs`).
Predictions made in either mode are identical (tests/test_fake_mode.py); in this one (its keys,
and its views below), a 7B LoRA prediction is 1.2-1.3x faster (benchmarks/predict_speed.py).

`FakeMode` also makes `view` and `_unsafe_view` itself. torch's fake kernel for both is its
Python reference (`torch._refs._reshape_view_helper`: a dozen nested dispatches, half a
millisecond), and torch never caches `_unsafe_view` (its output shares the input's storage, which
its schema does not say); a 7B LoRA step calls it 13 times per block (the linear layers' folds).
Here the view's strides are the C++ kernel's, computed once per (shape, strides, size asked) on a
meta tensor, and the output is set on the input's storage, as torch's cache makes a view's
output. The strides are the real kernel's: torch's reference differs from it only in the strides
of size-1 and empty dimensions. A view the kernel refuses, inference mode (where the output takes
the input's dispatch keys) and a mode that propagates real tensors go to torch's path. On 2 cores
a prepared 7B LoRA prediction at s8192 took 0.35 s instead of 0.44 s (the full trace 1.14 s
instead of 1.35 s), every record the same.

Where no shape is symbolic, an op that has a C++ meta kernel runs it in `FakeMode`, not torch's
Python decomposition of it (`cpp_meta_supports_symint`, the question torch's mode asks before it
decomposes): torch decomposes nll_loss and its backward, log_softmax, silu's and gelu's backward,
dropout and addmm, among others, into an op per step, each a dispatch of its own (5 ms for an
nll_loss at a new shape). The outputs' layouts are the decompositions' and the real CPU kernels'
in every case tested (tests/test_fake_mode.py), and the predictions the same; a prepared 7B LoRA
prediction spends about 20 ms less in the dispatches a new shape computes (46 ms, not 66 ms).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from typing import Optional

import torch
from torch._decomp import meta_table
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_MARK = "ckptlab.fake_mode"   # first item of every key made here
# The fields of torch's TensorMetadata (at v2.13.0) that `_facts` reads or, for a strided tensor,
# follow from what it reads (layout, memory format, the sparse fields).
METADATA_FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
                   "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
                   "dense_dim", "sparse_dim")
# The views `FakeMode` makes itself (module docstring), and their layouts made so far.
_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})
_VIEW_LAYOUTS: dict = {}   # (shape, strides, size asked) -> (shape, strides) of the view
# Arguments keyed by their value (and type); any other object is left to torch's key.
_PLAIN = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})


class _TorchsKey(Exception):
    """An argument only torch's own key knows how to take."""


def _facts(arg, mode: FakeTensorMode):
    """A hashable value of `arg` that equal dispatches share and different ones do not."""
    if isinstance(arg, FakeTensor):
        if (arg.fake_mode is not mode or arg.constant is not None or arg.layout is not torch.strided
                or arg._has_symbolic_sizes_strides):
            raise _TorchsKey
        return (FakeTensor, arg.dtype, arg.shape, arg.stride(), arg.fake_device, arg.storage_offset(),
                arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized, arg.is_conj(), arg.is_neg(),
                arg.is_inference())
    kind = type(arg)
    if kind is list or kind is tuple or kind is torch.Size:
        return (kind, *(_facts(a, mode) for a in arg))
    if kind is dict:
        return (dict, *((_facts(k, mode), _facts(v, mode)) for k, v in arg.items()))
    if kind in _PLAIN:
        return (kind, arg)   # the type too: 1 and 1.0 hash alike, and give other dtypes
    raise _TorchsKey


class RetypingFakeMode(FakeTensorMode):
    """FakeTensorMode whose ops' outputs, while `output_rules` is set ({op: rule(args, outputs)}),
    are what the rules make of them: the dtypes the real kernels give where torch's fake kernels
    differ (`estimate.kernel_outputs`), at the cost of a lookup per op rather than another mode."""

    output_rules: Optional[dict] = None

    def dispatch(self, func, types, args=(), kwargs=None):
        out = self._output(func, types, args, kwargs)
        rules = self.output_rules
        rule = rules.get(func) if rules is not None else None
        return out if rule is None else rule(args, out)

    def _output(self, func, types, args, kwargs):
        """The op's output before the rules."""
        return super().dispatch(func, types, args, kwargs)


class FakeMode(RetypingFakeMode):
    """FakeTensorMode with cheaper cache keys for plain strided fake tensors, views made as the
    C++ kernels make them, and C++ meta kernels before Python decompositions (module docstring)."""

    def _output(self, func, types, args, kwargs):
        if (func in _VIEWS and not kwargs and self.shape_env is None and not self.propagate_real_tensors
                and not torch.is_inference_mode_enabled()):   # there the output's dispatch keys are the input's
            out = self._view(*args)
            if out is not None:
                return out
        return super()._output(func, types, args, kwargs)

    def cpp_meta_supports_symint(self, func) -> bool:
        # torch's mode asks this before it runs an op's Python decomposition instead of its meta
        # kernel: with no symbolic shapes, an op with a C++ meta kernel runs it (module docstring).
        return (self.shape_env is None and _has_cpp_meta(func)) or super().cpp_meta_supports_symint(func)

    def _view(self, a, size, *rest) -> Optional[FakeTensor]:
        """`a.view(size)` sharing a's storage, its strides those of the C++ kernel (kept by a's
        shape and strides and `size`); None for anything but a plain strided fake tensor of this
        mode and a sequence of ints, or a view the kernel refuses (torch's own path then answers
        as it does)."""
        if (rest or type(a) is not FakeTensor or a.fake_mode is not self or a.constant is not None
                or a.layout is not torch.strided or a._has_symbolic_sizes_strides or a.is_conj() or a.is_neg()
                or type(size) not in (list, tuple, torch.Size) or any(type(n) is not int for n in size)):
            return None
        key = (a.shape, a.stride(), tuple(size))
        layout = _VIEW_LAYOUTS.get(key)
        if layout is None:
            try:
                view = torch.empty_strided(a.shape, a.stride(), dtype=torch.uint8, device="meta").view(size)
            except RuntimeError:
                return None
            layout = _VIEW_LAYOUTS[key] = (view.shape, view.stride())
        shape, stride = layout
        with fake_tensor.in_kernel_invocation_manager(self):
            out = torch.empty_strided(shape, stride, dtype=a.dtype, device="meta")
            out.set_(a.untyped_storage(), a.storage_offset(), shape, stride)
        return FakeTensor(self, out, a.fake_device)

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if self.shape_env is None:
            try:
                result.append((_MARK, _facts(args, self)))
                return
            except _TorchsKey:
                pass
        super()._prep_args_for_hash(result, args, state, id_hashed_objects)


def _keys_as_expected() -> bool:
    """Whether the installed torch makes its cache keys through the method `FakeMode` replaces,
    from the tensor metadata `_facts` reads."""
    method = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    metadata = getattr(fake_tensor, "TensorMetadata", None)
    return (method is not None and dataclasses.is_dataclass(metadata)
            and list(inspect.signature(method).parameters) == ["self", "result", "args", "state", "id_hashed_objects"]
            and tuple(f.name for f in dataclasses.fields(metadata)) == METADATA_FIELDS)


@functools.cache
def _has_cpp_meta(func) -> bool:
    """Whether `func` has a Meta kernel that torch's Python meta registrations did not make."""
    return (isinstance(func, torch._ops.OpOverload) and func not in meta_table
            and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "Meta"))


def clear_dispatch_caches() -> None:
    """Forget every dispatch output kept: torch's cache (both modes' keys) and the views' layouts."""
    FakeTensorMode.cache.clear()
    _VIEW_LAYOUTS.clear()


def new_fake_mode() -> FakeTensorMode:
    """A fake mode for a prediction: `FakeMode` where this torch keys its cache as expected, else
    torch's own keys (`RetypingFakeMode`). Real tensors (none are expected) are refused rather than
    silently allocated."""
    mode = FakeMode if _keys_as_expected() else RetypingFakeMode
    return mode(allow_non_fake_inputs=False)


@contextlib.contextmanager
def kernel_failures_unlogged():
    """While inside, torch's fake mode does not log the fake kernels that fail (a shortened step
    of a model sized by its blocks, a kernel that refuses a dtype): each failure is an exception
    the prediction answers or names, and the log would repeat its traceback on stderr."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)

