"""A prediction's fake mode keys torch's dispatch cache by what torch's own keys tell apart, and
predicts what torch's own mode predicts."""

import contextlib
import dataclasses
import itertools
from unittest import mock

import pytest
import torch
import torch._dynamo.config
from torch._subclasses import fake_tensor
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensorMode

from ckptlab.core.policy import as_policy
from ckptlab.estimate import fake_mode
from ckptlab.estimate.fake_mode import FakeMode, new_fake_mode
from ckptlab.estimate.fake_step import clear_prepared
from ckptlab.estimate.predict import predict_policy
from ckptlab.workloads.registry import get_workload


def keys(mode, args) -> tuple:
    """(ckptlab's, torch's) cache key values of `args`: torch's with its own method all the way
    down (its walk recurses through the mode's method)."""
    ours, torchs = [], []
    mode._prep_args_for_hash(ours, args, _CacheKeyState(None), [])
    with mock.patch.object(FakeMode, "_prep_args_for_hash", FakeTensorMode._prep_args_for_hash):
        mode._prep_args_for_hash(torchs, args, _CacheKeyState(None), [])
    assert ours != torchs   # ckptlab's key was made (the two kinds never meet)
    return tuple(ours), tuple(torchs)


def test_keys_tell_apart_what_torchs_keys_tell_apart():
    mode = new_fake_mode()
    assert type(mode) is FakeMode
    with mode:
        base = torch.empty(4, 6)
        complex_ = torch.empty(4, 6, dtype=torch.complex64)
        wide = torch.empty(8, 6)
        image = torch.empty(2, 3, 4, 4)
        with torch.inference_mode():
            inferred = torch.empty(4, 6)
        args = {
            "base": base, "alike": torch.empty(4, 6), "half": base.half(), "shape": torch.empty(6, 4),
            "transposed": torch.empty(6, 4).t(), "offset": wide[4:], "in more storage": wide[:4],
            "requires grad": torch.empty(4, 6, requires_grad=True), "parameter": torch.nn.Parameter(torch.empty(4, 6)),
            "complex": complex_, "conjugate": complex_.conj(), "negative": torch._neg_view(complex_),
            "inference": inferred, "cuda": torch.empty(4, 6, device="cuda"), "meta": torch.empty(4, 6, device="meta"),
            "image": image, "channels last": image.to(memory_format=torch.channels_last),
            "tensors": [base, wide], "tensors again": [torch.empty(4, 6), torch.empty(8, 6)],
            "other tensors": [wide, base], "one": 1, "one float": 1.0, "true": True, "[1]": [1], "[True]": [True],
            "none": None, "dtype": torch.float16, "list": [1, 2], "tuple": (1, 2), "size": torch.Size([1, 2]),
            "dict": {"a": 1, "b": 2}, "dict in another order": {"b": 2, "a": 1}, "other dict": {"b": 1},
        }
        made = {name: keys(mode, (arg, 3)) for name, arg in args.items()}
        made["kwargs"] = keys(mode, {"dim": 0, "keepdim": True})
        made["kwargs in another order"] = keys(mode, {"keepdim": True, "dim": 0})
    for (one, (ours_1, torchs_1)), (other, (ours_2, torchs_2)) in itertools.combinations(made.items(), 2):
        assert (ours_1 == ours_2) == (torchs_1 == torchs_2), (one, other)
    assert made["base"][0] == made["alike"][0] and made["tensors"][0] == made["tensors again"][0]


def test_an_argument_only_torch_keys_is_keyed_by_torch():
    """A real tensor, another mode's or a constant: torch bypasses its cache, so does ckptlab's
    mode; an object it keys by itself: both keys tell two objects apart, and one object from itself."""
    mode = new_fake_mode()
    with mode:
        fake = torch.empty(2)
        constant = torch.tensor(2.0)
    with FakeTensorMode():
        theirs = torch.empty(2)
    assert constant.constant is not None
    for other in (torch.zeros(2), theirs, constant):
        with pytest.raises(Exception, match="non-fake tensor|not our fake|constant attribute") as torchs:
            FakeTensorMode._prep_args_for_hash(mode, [], (fake, other), _CacheKeyState(None), [])
        with pytest.raises(type(torchs.value), match=str(torchs.value.reason)):
            mode._prep_args_for_hash([], (fake, other), _CacheKeyState(None), [])
    first, second = object(), object()
    assert keys(mode, (fake, first))[0] == keys(mode, (fake, first))[0] != keys(mode, (fake, second))[0]
    assert keys(mode, (fake, first))[1] == keys(mode, (fake, first))[1] != keys(mode, (fake, second))[1]


@pytest.mark.parametrize("spec, overrides, policy, options", [
    ("gpt-tiny", {}, "selective", dict(dtype="bf16")),
    ("gpt-tiny", dict(n_layer=7), "full+offload", dict(device="cuda", card="rtx4090")),
    ("hf-llama-tiny+lora=4", {}, "none", dict(device="cuda", card="h100-80", dtype="bf16-weights")),
])
def test_a_prediction_is_torchs_modes_and_every_cached_output_is_what_dispatch_makes(spec, overrides, policy,
                                                                                     options, monkeypatch):
    """torch's cross-check runs every dispatch that a cache entry answers, and compares."""
    workload = get_workload(spec, **overrides)
    fake_mode.clear_dispatch_caches()
    hits = FakeTensorMode.cache_hits
    with torch._dynamo.config.patch(fake_tensor_cache_crosscheck_enabled=True):
        ours = predict_policy(workload, 2, 16, as_policy(policy), **options)
    assert FakeTensorMode.cache_hits > hits + 100
    clear_prepared()
    monkeypatch.setattr(fake_mode, "_keys_as_expected", lambda: False)
    assert type(new_fake_mode()) is fake_mode.RetypingFakeMode
    torchs = predict_policy(workload, 2, 16, as_policy(policy), **options)
    theirs = dataclasses.asdict(torchs)
    differ = {k: v for k, v in dataclasses.asdict(ours).items() if k != "predict_s" and v != theirs[k]}
    assert not differ


def test_a_torch_that_keys_its_cache_otherwise_gets_its_own_mode(monkeypatch):
    assert type(new_fake_mode()) is FakeMode
    with monkeypatch.context() as patched:   # another method makes the key
        patched.setattr(FakeTensorMode, "_prep_args_for_hash", lambda self, result, args, state: None)
        assert type(new_fake_mode()) is fake_mode.RetypingFakeMode
    with monkeypatch.context() as patched:   # the metadata holds a fact the key would leave out
        patched.setattr(fake_tensor, "TensorMetadata", dataclasses.make_dataclass(
            "TensorMetadata", [*fake_mode.METADATA_FIELDS, "is_nested"]))
        assert type(new_fake_mode()) is fake_mode.RetypingFakeMode


def _view_cases():
    """(name, a tensor maker(empty), the size asked): layouts whose views' strides differ."""
    return [
        ("contiguous", lambda e: e(4, 6), [24]),
        ("inferred", lambda e: e(4, 6), [2, -1]),
        ("offset", lambda e: e(8, 6)[4:], [2, 12]),
        ("ones kept", lambda e: e(4, 1, 6), [1, 4, 6, 1]),
        ("strided ones", lambda e: e(4, 6).unsqueeze(1).transpose(0, 2), [6, 4]),
        ("transposed, splits", lambda e: e(6, 4).t(), [2, 2, 6]),
        ("transposed, merges (refused)", lambda e: e(6, 4).t(), [24]),
        ("expanded", lambda e: e(1, 6).expand(4, 6), [2, 2, 6]),
        ("channels last", lambda e: e(2, 3, 4, 4).to(memory_format=torch.channels_last), [2, 3, 16]),
        ("empty", lambda e: e(0, 6), [3, 0, 2]),
        ("size-1 stride (torch's differs)", lambda e: e(72).as_strided([1, 3], [0, 24]), [1, 3]),
        ("empty stride (torch's differs)", lambda e: e(72).as_strided([0], [24], 3), [0]),
    ]


@pytest.mark.parametrize("op", [torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default])
@pytest.mark.parametrize("name, make, size", _view_cases())
def test_a_view_is_the_kernels_and_shares_its_base(name, make, size, op):
    """ckptlab's mode makes view and _unsafe_view from the C++ kernel's strides: the same shape,
    strides and offset as the real CPU kernel, on the base's storage; torch's fake mode (its
    Python reference) differs only in the strides of size-1 and empty dimensions. The view the
    kernel refuses here, torch's mode refuses too."""
    def made(mode):
        with mode or contextlib.nullcontext():
            base = make(torch.empty)
            try:
                out = op(base, size)
            except (RuntimeError, ValueError):   # torch's fake mode raises ValueError where the kernel raises
                return "refused"
            assert out.untyped_storage()._cdata == base.untyped_storage()._cdata
            return out.shape, out.stride(), out.storage_offset(), out.dtype
    ours, torchs, real = made(new_fake_mode()), made(FakeTensorMode()), made(None)
    assert ours == real
    assert (ours == torchs) == ("torch's differs" not in name)
    assert (ours == "refused") == ("refused" in name)


def test_a_view_in_inference_mode_is_torchs():
    """In inference mode a view's output takes its input's dispatch keys (torch's cache refuses
    the case): ckptlab's mode leaves it to torch's path, and a normal tensor's view stays normal."""
    with new_fake_mode():
        base = torch.empty(4, 6)
        with torch.inference_mode():
            viewed = base.view(24)
            unsafe = torch.ops.aten._unsafe_view(base, [24])
        assert not viewed.is_inference() and not unsafe.is_inference()
        unsafe.add_(1)


_DECOMPOSED_BY_TORCH = {   # ops torch's fake mode runs as Python decompositions though a C++ meta kernel exists:
    # name: (op, its arguments made from t(*shape))
    "silu_backward, transposed": (torch.ops.aten.silu_backward, lambda t: (t(13, 7).t(), t(7, 13))),
    "gelu_backward, channels last": (torch.ops.aten.gelu_backward, lambda t: (
        t(2, 3, 5, 7).to(memory_format=torch.channels_last), t(2, 3, 5, 7))),
    "_log_softmax, transposed": (torch.ops.aten._log_softmax, lambda t: (t(13, 7).t(), 1, False)),
    "nll_loss_forward": (torch.ops.aten.nll_loss_forward, lambda t: (
        t(7, 5), torch.zeros(7, dtype=torch.long), None, 1, -100)),
    "native_dropout, transposed": (torch.ops.aten.native_dropout, lambda t: (t(13, 7).t(), 0.1, True)),
    "addmm, a bias row": (torch.ops.aten.addmm, lambda t: (t(7), t(5, 3), t(3, 7))),
}


@pytest.mark.parametrize("name", list(_DECOMPOSED_BY_TORCH))
def test_an_op_with_a_cpp_meta_kernel_runs_it(name):
    """Where no shape is symbolic, ckptlab's mode runs an op's C++ meta kernel (one dispatch),
    not torch's Python decomposition (an op per step of it): the same outputs' layouts as torch's
    mode and the real CPU kernel."""
    op, arguments = _DECOMPOSED_BY_TORCH[name]

    def made(mode):
        fake_mode.clear_dispatch_caches()
        with mode or contextlib.nullcontext():
            args = arguments(lambda *shape: torch.ones(shape))
            computed = FakeTensorMode.cache_misses + sum(FakeTensorMode.cache_bypasses.values())
            out = op(*args)
            computed = FakeTensorMode.cache_misses + sum(FakeTensorMode.cache_bypasses.values()) - computed
        return [(t.shape, t.stride(), t.dtype) for t in (out if isinstance(out, tuple) else (out,))], computed
    (ours, our_ops), (torchs, torch_ops), (real, _) = made(new_fake_mode()), made(FakeTensorMode()), made(None)
    assert ours == torchs == real
    assert our_ops == 1 < torch_ops
