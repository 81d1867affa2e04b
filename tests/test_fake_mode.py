"""A prediction's fake mode keys torch's dispatch cache by what torch's own keys tell apart, and
predicts what torch's own mode predicts."""

import dataclasses
import itertools

import pytest
import torch
import torch._dynamo.config
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensorMode

from ckptlab.core.policy import as_policy
from ckptlab.estimate import fake_mode
from ckptlab.estimate.fake_mode import FakeMode, new_fake_mode
from ckptlab.estimate.fake_step import clear_prepared
from ckptlab.estimate.predict import predict_policy
from ckptlab.workloads.registry import get_workload


def keys(mode, args) -> tuple:
    """(ckptlab's, torch's) cache key values of `args`."""
    ours, torchs = [], []
    mode._prep_args_for_hash(ours, args, _CacheKeyState(None), [])
    FakeTensorMode._prep_args_for_hash(mode, torchs, args, _CacheKeyState(None), [])
    return tuple(ours), tuple(torchs)


def test_keys_tell_apart_what_torchs_keys_tell_apart():
    mode = new_fake_mode()
    assert type(mode) is FakeMode
    with mode:
        base = torch.empty(4, 6)
        complex_ = torch.empty(4, 6, dtype=torch.complex64)
        wide = torch.empty(8, 6)
        with torch.inference_mode():
            inferred = torch.empty(4, 6)
        args = {
            "base": base, "alike": torch.empty(4, 6), "half": base.half(), "shape": torch.empty(6, 4),
            "transposed": torch.empty(6, 4).t(), "offset": wide[4:], "in more storage": wide[:4],
            "requires grad": torch.empty(4, 6, requires_grad=True), "complex": complex_,
            "conjugate": complex_.conj(), "negative": torch._neg_view(complex_), "inference": inferred,
            "cuda": torch.empty(4, 6, device="cuda"),
            "one": 1, "one float": 1.0, "true": True, "none": None, "dtype": torch.float16, "list": [1, 2],
            "tuple": (1, 2), "size": torch.Size([1, 2]), "dict": {"a": 1}, "other dict": {"b": 1},
        }
        made = {name: keys(mode, (arg, 3)) for name, arg in args.items()}
    for (one, (ours_1, torchs_1)), (other, (ours_2, torchs_2)) in itertools.combinations(made.items(), 2):
        assert (ours_1 == ours_2) == (torchs_1 == torchs_2), (one, other)
    assert made["base"][0] == made["alike"][0]


def test_an_argument_only_torch_keys_is_keyed_by_torch():
    mode = new_fake_mode()
    with mode:
        fake = torch.empty(2)
    other = FakeTensorMode()
    with other:
        theirs = torch.empty(2)
    for args in [(fake, torch.zeros(2)), (fake, theirs), (fake, object())]:
        ours, torchs = [], []
        try:
            FakeTensorMode._prep_args_for_hash(mode, torchs, args, _CacheKeyState(None), [])
        except Exception as exc:   # torch bypasses its cache for these: so does ckptlab's mode
            with pytest.raises(type(exc)):
                mode._prep_args_for_hash(ours, args, _CacheKeyState(None), [])
        else:
            mode._prep_args_for_hash(ours, args, _CacheKeyState(None), [])
            assert ours == torchs


@pytest.mark.parametrize("spec, overrides, policy, options", [
    ("gpt-tiny", {}, "selective", dict(dtype="bf16")),
    ("gpt-tiny", dict(n_layer=7), "full+offload", dict(device="cuda", card="rtx4090")),
    ("hf-llama-tiny+lora=4", {}, "none", dict(device="cuda", card="h100-80", dtype="bf16-weights")),
])
def test_a_prediction_is_torchs_modes_and_every_cached_output_is_what_dispatch_makes(spec, overrides, policy,
                                                                                     options, monkeypatch):
    """torch's cross-check runs every dispatch that a cache entry answers, and compares."""
    workload = get_workload(spec, **overrides)
    FakeTensorMode.cache.clear()
    hits = FakeTensorMode.cache_hits
    with torch._dynamo.config.patch(fake_tensor_cache_crosscheck_enabled=True):
        ours = predict_policy(workload, 2, 16, as_policy(policy), **options)
    assert FakeTensorMode.cache_hits > hits + 100
    clear_prepared()
    monkeypatch.setattr(fake_mode, "_keys_as_expected", lambda: False)
    assert type(new_fake_mode()) is FakeTensorMode
    torchs = predict_policy(workload, 2, 16, as_policy(policy), **options)
    theirs = dataclasses.asdict(torchs)
    differ = {k: v for k, v in dataclasses.asdict(ours).items() if k != "predict_s" and v != theirs[k]}
    assert not differ


def test_a_torch_that_keys_its_cache_otherwise_gets_its_own_mode(monkeypatch):
    monkeypatch.setattr(FakeTensorMode, "_prep_args_for_hash", lambda self, result, args, state: None)
    assert type(new_fake_mode()) is FakeTensorMode
