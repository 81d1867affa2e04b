"""Normalization kernels' statistics on fake tensors: the dtypes the real kernels give
(`estimate.kernel_outputs`), so that a prediction holds what the real step holds."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import ckptlab
from ckptlab.core.policy import as_policy
from ckptlab.estimate import kernel_outputs as kernel_outputs_module
from ckptlab.estimate.fake_mode import new_fake_mode
from ckptlab.estimate.fake_step import clear_prepared
from ckptlab.estimate.kernel_outputs import kernel_outputs
from ckptlab.estimate.predict import predict_policy
from ckptlab.probe.memory import track_memory

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NORMS = {   # a module and the shape of its input
    "layer": (lambda: nn.LayerNorm(32), (4, 8, 32)),
    "layer, no affine": (lambda: nn.LayerNorm(32, elementwise_affine=False), (4, 8, 32)),
    "batch": (lambda: nn.BatchNorm1d(32), (4, 32, 8)),
    "batch, no running stats": (lambda: nn.BatchNorm1d(32, track_running_stats=False), (4, 32, 8)),
    "group": (lambda: nn.GroupNorm(4, 32), (4, 32, 8)),
    "rms": (lambda: nn.RMSNorm(32), (4, 8, 32)),
}


class _Ops(TorchDispatchMode):
    """Each op's name and its outputs' dtypes and shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.prim.device.default:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.ops.append((str(func), [(o.dtype, tuple(o.shape)) if isinstance(o, torch.Tensor) else None
                                         for o in outs]))
        return out


def _forward_backward(norm, shape, x_dtype, param_dtype, make) -> list:
    module = norm()
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(param_dtype)
    x = make(shape, x_dtype).requires_grad_()
    ops = _Ops()
    with ops:
        module(x).float().sum().backward()
    return ops.ops


def _fake_ops(norm, shape, x_dtype, param_dtype, mode: str) -> list:
    """The ops of a fake forward and backward: in ckptlab's fake mode with the CPU's rules, in
    torch's with the rules as a mode above it, or in torch's alone."""
    fake = new_fake_mode() if mode == "ckptlab" else FakeTensorMode()
    fake.allow_non_fake_inputs = True
    rules = kernel_outputs(fake) if mode != "uncorrected" else contextlib.nullcontext()
    with fake, rules:
        return _forward_backward(norm, shape, x_dtype, param_dtype, lambda s, d: torch.empty(*s, dtype=d))


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("x_dtype,param_dtype", [(BF16, FP32), (FP16, FP32), (BF16, BF16), (FP32, FP32)])
def test_fake_norms_give_the_dtypes_of_the_cpu_kernels(name, x_dtype, param_dtype):
    norm, shape = NORMS[name]
    real = _forward_backward(norm, shape, x_dtype, param_dtype, lambda s, d: torch.randn(*s, dtype=d))
    assert _fake_ops(norm, shape, x_dtype, param_dtype, "ckptlab") == real
    assert _fake_ops(norm, shape, x_dtype, param_dtype, "torch") == real
    mixed = x_dtype != param_dtype and name not in ("layer, no affine", "rms")
    # torch's own fake kernels differ exactly where the kernel runs mixed types
    assert (_fake_ops(norm, shape, x_dtype, param_dtype, "uncorrected") != real) == mixed


def test_on_cuda_a_layer_norm_keeps_its_statistics_in_fp32_for_16_bit_inputs():
    fake = new_fake_mode()
    with fake:
        x, w = torch.empty(4, 8, 32, dtype=BF16), torch.empty(32, dtype=BF16)
        with kernel_outputs(fake, cuda=True):
            cuda = torch.ops.aten.native_layer_norm(x, [32], w, w, 1e-5)
            fp32 = torch.ops.aten.native_layer_norm(x.float(), [32], w.float(), w.float(), 1e-5)
        with kernel_outputs(fake, cuda=False):
            cpu = torch.ops.aten.native_layer_norm(x, [32], w, w, 1e-5)
        plain = torch.ops.aten.native_layer_norm(x, [32], w, w, 1e-5)
    assert [t.dtype for t in plain] == [BF16, BF16, BF16]   # the rules hold only inside
    assert [t.dtype for t in cuda] == [BF16, FP32, FP32] and [t.dtype for t in fp32] == [FP32] * 3
    assert [t.dtype for t in cpu] == [BF16, BF16, BF16]
    assert cuda[1].shape == (4, 8, 1) and cuda[1].stride() == cpu[1].stride()


def test_a_bf16_gpt_on_cuda_saves_fp32_layer_norm_statistics(monkeypatch):
    # gpt-tiny with 2 blocks has 5 LayerNorms (two per block, one at the end), each saving a
    # mean and an rstd of one value per token for backward: fp32 on CUDA, bf16 on the CPU.
    workload = ckptlab.get_workload("gpt-tiny", n_layer=2)
    batch, seq = 2, 16

    def saved(rules) -> int:
        monkeypatch.setattr(kernel_outputs_module, "RULES", {False: {}, True: rules})
        clear_prepared()   # the step traced with the other rules is not taken again
        return predict_policy(workload, batch, seq, as_policy("none"), dtype="bf16-weights", device="cuda",
                              card="rtx4090", trace="full").saved_activation_bytes

    cuda_rules = kernel_outputs_module.rules(cuda=True)
    with_rule = saved(cuda_rules)
    without = saved({k: v for k, v in cuda_rules.items() if k is not torch.ops.aten.native_layer_norm.default})
    assert with_rule - without == 5 * 2 * batch * seq * (4 - 2)


class _MixedNorms(nn.Module):
    """Blocks whose norms take a Linear's output: bf16 under CPU autocast, their weights fp32."""

    def __init__(self, depth: int = 6):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(_MixedBlock() for _ in range(depth))
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.float().mean(1))


class _MixedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.layer, self.group, self.batch = nn.LayerNorm(32), nn.GroupNorm(4, 32), nn.BatchNorm1d(32)

    def forward(self, h):
        u = self.lin(h)
        u = self.layer(u) + self.group(u.transpose(1, 2)).transpose(1, 2) + self.batch(u.transpose(1, 2)).transpose(1, 2)
        return h + u


def _mixed_workload():
    return ckptlab.Workload.custom(
        "mixed-norms", build_model=_MixedNorms, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        make_batch=lambda b, s, g: (torch.randn(b, s, 8, generator=g), torch.randint(0, 3, (b,), generator=g)))


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_bf16_model_of_mixed_type_norms_is_predicted_on_the_cpu_as_measured(policy):
    workload = _mixed_workload()
    measured = ckptlab.measure(workload, 2, 16, policy, dtype="bf16", steps=1, warmup=0, max_seconds=0.1)
    for trace in ("fast", "full"):
        predicted = predict_policy(workload, 2, 16, as_policy(policy), dtype="bf16", trace=trace)
        assert (predicted.peak_bytes, predicted.saved_activation_bytes) == (
            measured["peak_bytes"], measured["saved_activation_bytes"]), trace
    assert predicted.trace == "full" and predict_policy(workload, 2, 16, as_policy(policy), dtype="bf16").trace == "composed"


def _layer_norm_backward(make, x, grad_out):
    c = x.shape[-1]
    return torch.ops.aten.native_layer_norm_backward(grad_out, x, [c], make(*x.shape[:-1], 1), make(*x.shape[:-1], 1),
                                                     make(c), make(c), [True, True, True])


def _group_norm_backward(make, x, grad_out):
    n, c = x.shape[:2]
    return torch.ops.aten.native_group_norm_backward(grad_out, x, make(n, 4), make(n, 4), make(c), n, c,
                                                     x[0, 0].numel(), 4, [True, True, True])


def _batch_norm_backward(make, x, grad_out):
    c = x.shape[1]
    return torch.ops.aten.native_batch_norm_backward(grad_out, x, make(c), make(c), make(c).abs(), make(c), make(c),
                                                     True, 1e-5, [True, True, True])


def _transposed(make, *shape):
    return make(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


def _channels_last(make, *shape):
    return make(*shape).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("op", [_layer_norm_backward, _group_norm_backward, _batch_norm_backward])
@pytest.mark.parametrize("x_layout,grad_layout,shape", [
    (None, _transposed, (4, 16, 8)),          # a norm followed by a transpose: the gradient comes transposed
    (_transposed, None, (4, 16, 8)),
    (None, _channels_last, (2, 8, 4, 4)),
    (_channels_last, None, (2, 8, 4, 4)),
])
def test_a_norms_input_gradient_is_laid_out_as_the_cpu_kernels_lay_it_out(op, x_layout, grad_layout, shape):
    # torch's fake kernels lay a backward's input gradient out as the incoming gradient; the
    # kernels allocate it from the input (module docstring)
    def backward(make):
        x = x_layout(make, *shape) if x_layout else make(*shape)
        grad_out = grad_layout(make, *shape) if grad_layout else make(*shape)
        return [t.stride() for t in op(make, x, grad_out)]

    real = backward(torch.randn)
    for mode in ("ckptlab", "torch"):
        fake = new_fake_mode() if mode == "ckptlab" else FakeTensorMode()
        with fake, kernel_outputs(fake):
            assert backward(torch.empty) == real, mode


class _MixesPositions(nn.Module):
    """Blocks that normalize each position, then mix the positions (a Linear over the sequence,
    as an MLP-Mixer does, without its residual): each norm's incoming gradient is a transposed
    one, and its input's gradient goes on to a Linear, whose backward views it as a matrix."""

    def __init__(self, seq: int = 16, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.norms = nn.ModuleList(nn.LayerNorm(32) for _ in range(depth))
        self.mixes = nn.ModuleList(nn.Linear(seq, seq) for _ in range(depth))

    def forward(self, x):
        h = self.embed(x)
        for norm, mix in zip(self.norms, self.mixes):
            h = mix(norm(h).transpose(1, 2)).transpose(1, 2)
        return h.mean()


def test_a_step_whose_norms_get_transposed_gradients_holds_on_fake_tensors_what_it_holds_for_real():
    def timeline(model, x) -> list:
        with track_memory(model, inputs=[x]) as tracker:
            loss = model(x)
            tracker.phase("backward")
            loss.backward()
        return tracker.report().timeline

    torch.manual_seed(0)
    model, x = _MixesPositions(), torch.randn(2, 16, 8)
    real = timeline(model, x)
    for p in model.parameters():
        p.grad = None
    fake = new_fake_mode()
    with FakeCopyMode(fake):
        fake_model = copy.deepcopy(model)
    with fake, kernel_outputs(fake):
        assert timeline(fake_model, fake.from_tensor(x)) == real



def _log_softmax_backward(grad_out, output, input_dtype=None):
    return torch.ops.aten._log_softmax_backward_data(grad_out, output, -1, input_dtype or grad_out.dtype)


def _permuted(make, *shape):
    return make(*shape[1:], shape[0]).movedim(-1, 0)


@pytest.mark.parametrize("grad_layout", [None, _transposed, _permuted, _channels_last])
@pytest.mark.parametrize("output_layout", [None, _transposed, _channels_last])
def test_a_log_softmax_input_gradient_is_laid_out_as_the_cpu_kernel_lays_it_out(grad_layout, output_layout):
    # torch's fake kernel lays it out as the incoming gradient; the kernel contiguous (module docstring)
    shape = (2, 8, 4, 4)

    def backward(make):
        grad_out = grad_layout(make, *shape) if grad_layout else make(*shape)
        output = output_layout(make, *shape) if output_layout else make(*shape)
        return _log_softmax_backward(grad_out, output).stride()

    real = backward(torch.randn)
    for mode in ("ckptlab", "torch"):
        fake = new_fake_mode() if mode == "ckptlab" else FakeTensorMode()
        with fake, kernel_outputs(fake):
            assert backward(torch.empty) == real, mode


def test_on_cuda_log_softmax_and_dropout_input_gradients_are_laid_out_as_the_cuda_kernels_lay_them_out():
    # log-softmax's structured meta function: contiguous, fp16 for CUDA's half-to-float
    # log-softmax; dropout_backward_cuda: empty_like(grad, grad.suggest_memory_format()), which
    # torch's fake kernel already gives (no rule)
    fake = new_fake_mode()
    with fake, kernel_outputs(fake, cuda=True):
        grad = torch.empty(16, 8).t()
        half = _log_softmax_backward(grad, torch.empty(8, 16), FP16)
        assert (half.stride(), half.dtype) == ((16, 1), FP16)
        for mask in (torch.empty(8, 16) > 0, torch.empty(16, 8).t() > 0):
            assert torch.ops.aten.native_dropout_backward(grad, mask, 2.0).stride() == (16, 1)
        channels_last = _channels_last(torch.empty, 2, 8, 4, 4)
        assert torch.ops.aten.native_dropout_backward(channels_last, channels_last > 0, 2.0).stride() == \
            channels_last.stride()


class _TransposedLogSoftmax(nn.Module):
    """A log-softmax over the classes whose output is transposed into the loss (`nll_loss` takes
    the classes in dim 1, as a sequence model's loss over positions does): its incoming gradient
    comes transposed, and its input gradient goes on to the head, a Linear whose backward views it
    as a matrix."""

    def __init__(self, depth: int = 6):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(32, 256)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.nll_loss(F.log_softmax(self.head(h), -1).transpose(1, 2), y)


@pytest.mark.parametrize("rule", [True, False])
def test_a_step_whose_log_softmax_gets_a_transposed_gradient_holds_on_fake_tensors_what_it_holds_for_real(
        rule, monkeypatch):
    def timeline(model, x, y) -> list:
        with track_memory(model, inputs=[x, y]) as tracker:
            loss = model(x, y)
            tracker.phase("backward")
            loss.backward()
        return tracker.report().timeline

    torch.manual_seed(0)
    model, x, y = _TransposedLogSoftmax(), torch.randn(2, 16, 8), torch.randint(0, 256, (2, 16))
    real = timeline(model, x, y)
    for p in model.parameters():
        p.grad = None
    if not rule:   # without it the fake step holds a copy the real one does not make: the test sees it
        cpu = {op: r for op, r in kernel_outputs_module.RULES[False].items()
               if op is not torch.ops.aten._log_softmax_backward_data.default}
        monkeypatch.setattr(kernel_outputs_module, "RULES", {False: cpu, True: kernel_outputs_module.RULES[True]})
    fake = new_fake_mode()
    with FakeCopyMode(fake):
        fake_model = copy.deepcopy(model)
    with fake, kernel_outputs(fake):
        predicted = timeline(fake_model, fake.from_tensor(x), fake.from_tensor(y))
    assert (predicted == real) is rule


def test_a_model_whose_log_softmax_gets_a_transposed_gradient_is_predicted_on_the_cpu_as_measured():
    workload = ckptlab.Workload.custom(
        "transposed-log-softmax", build_model=_TransposedLogSoftmax, loss=lambda m, b: m(*b),
        make_batch=lambda b, s, g: (torch.randn(b, s, 8, generator=g), torch.randint(0, 256, (b, s), generator=g)))
    measured = ckptlab.measure(workload, 2, 16, "none", steps=1, warmup=0, max_seconds=0.1)
    for trace in ("fast", "full"):
        predicted = predict_policy(workload, 2, 16, as_policy("none"), trace=trace)
        assert (predicted.peak_bytes, predicted.saved_activation_bytes) == (
            measured["peak_bytes"], measured["saved_activation_bytes"]), trace
    assert predicted.trace == "full" and predict_policy(workload, 2, 16, as_policy("none")).trace == "composed"
