"""One training step and what it runs on: the step closure, optimizers, devices, and torch's dtypes for a
dtype name (`core.dtypes`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import platform

import torch
from torch.utils._foreach_utils import _device_has_foreach_support

from ..core.dtypes import DTYPES, WEIGHT_DTYPES
from ..core.loop import Loop, as_loop
from ..core.optimizers import implementation_options
from ..workloads.base import Workload


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The torch dtype a step in `dtype` (`core.dtypes.DTYPES`) runs autocast in; None: no autocast."""
    name = DTYPES[dtype]
    return None if name is None else getattr(torch, name)


def with_dtype(workload: Workload, dtype: str) -> Workload:
    """The workload whose models and batches are `dtype`'s: cast for bf16-weights / fp16-weights,
    itself otherwise (autocast happens in the step)."""
    weights = getattr(torch, WEIGHT_DTYPES[dtype]) if dtype in WEIGHT_DTYPES else None
    if weights is None or workload.weights_dtype == weights:
        return workload
    return dataclasses.replace(workload, weights_dtype=weights)


def training_step(model, workload: Workload, batch: tuple, optimizer, dtype: str = "fp32", loop: Loop | str | None = None,
                  autocast=None):
    """A closure running one optimizer step of `loop` (`core.loop.Loop`); pass it a tracker to
    mark phases. `optimizer` is the one `make_optimizer(loop, ...)` built (None for "none").
    `autocast(dtype)` makes the context a mixed-precision forward runs in (default:
    `torch.autocast` on the batch's device); a prediction for CUDA passes CUDA's emulation.

    The loop, in order: `accum_steps` forward + backward passes on the micro-batch (gradients
    accumulate, the loss scaled by 1/accum_steps; with `grad_scaler` the scaled loss backward);
    then, in the optimizer phase, with `clip_grad_norm` the gradients unscaled (a scaler's
    `unscale_`) and clipped (`clip_grad_norm_`, foreach where torch picks it for the batch's
    device: torch/nn/utils/clip_grad.py:49 _get_total_norm at v2.13.0), the optimizer step (through the
    scaler's `step`, then its `update`), and `zero_grad` (gradients set to None, or zero-filled
    and kept). With `holds_output` the step keeps the model's output until the next forward has
    made its own (`HeldOutput`; `step.inputs()` includes it). `step.scaler` is the GradScaler
    (None without one)."""
    loop = as_loop(loop)
    loop.check_dtype(dtype)
    in_dtype = autocast_dtype(dtype)
    device_type = batch[0].device.type
    if autocast is None:
        autocast = functools.partial(torch.autocast, device_type)
    held = HeldOutput(model, workload.label) if loop.holds_output else None
    scaler = torch.amp.GradScaler(device_type) if loop.grad_scaler else None
    # torch picks foreach norms for plain tensors on a device that has them (CPU and CUDA); fake
    # tensors fail its type check, so the choice is passed (clip_grad.py:93 _get_total_norm at v2.13.0).
    clip_foreach = _device_has_foreach_support(batch[0].device)
    set_to_none = loop.zero_grad == "set_to_none"
    accum_steps = loop.accum_steps

    def forward_loss():
        with autocast(dtype=in_dtype) if in_dtype else contextlib.nullcontext():
            loss = workload.loss(model, step.batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shown = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"the loss of model={workload.label!r} is invalid: it returned {shown}; allowed is a "
                             "tensor of one value (reduce it, e.g. .mean(), in the loss function)")
        return loss

    def step(tracker=None):
        for micro in range(accum_steps):
            if tracker is not None and micro:
                tracker.phase("forward")
            loss = forward_loss() if held is None else held.forward(forward_loss)
            if tracker is not None:
                tracker.phase("backward")
            scaled = loss / accum_steps if accum_steps > 1 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            scaled = None
        if tracker is not None:
            tracker.phase("optimizer")
        if loop.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip_grad_norm, foreach=clip_foreach)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        elif optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=set_to_none)
        return loss.detach()

    # The batch it steps on: a prediction sets another to step the same model at another shape.
    step.batch = batch
    # The forward alone (a prediction's warm-up, `estimate.fake_step`), holding the output as the step does.
    step.forward_loss = forward_loss if held is None else functools.partial(held.forward, forward_loss)
    # What the step starts from beside the model and the optimizer: the batch, a held output, and
    # the scale and growth tracker a grad scaler keeps from step to step (torch/amp/grad_scaler.py:173
    # _lazy_init_scale_growth_tracker at v2.13.0).
    step.inputs = lambda: (*step.batch, *(held.tensors if held is not None else ()), *scaler_state(scaler))
    step.loop, step.scaler = loop, scaler
    return step


def scaler_state(scaler) -> list[torch.Tensor]:
    """The tensors a GradScaler keeps between steps once its first `scale` made them: the scale
    and the growth tracker (torch/amp/grad_scaler.py:173 `_lazy_init_scale_growth_tracker` at v2.13.0)."""
    if scaler is None:
        return []
    return [t for t in (scaler._scale, scaler._growth_tracker) if t is not None]


class HeldOutput:
    """The model's output, kept from one step into the next as a training loop that writes
    `logits, loss = model(x, y)` (or `out = model(x)`) at loop scope keeps it: alive through this
    step's backward and optimizer step and the next step's forward, released when that forward
    returns its own. Its tensors are held detached (the same storage, without the graph, which
    backward frees in the loop too). `tensors` is what is held now."""

    def __init__(self, model: torch.nn.Module, label: str):
        self.label = label
        self.tensors: list[torch.Tensor] = []
        self.called = False
        model.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.tensors = [t.detach() for t in tensors_in(output)]   # the previous output is released here
        self.called = True

    def forward(self, forward_loss):
        """`forward_loss()`, checking that it called the model, whose output is what is held."""
        self.called = False
        loss = forward_loss()
        if not self.called:
            raise ValueError(f"holds_output=True is invalid for model={self.label!r}: its loss never calls the "
                             "model itself, so there is no model output to hold; allowed is holds_output=False")
        return loss


def tensors_in(output) -> list[torch.Tensor]:
    """The tensors of a forward's output: a tensor, or tensors in tuples, lists and dicts (a
    transformers ModelOutput is a dict), nested."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in tensors_in(item)]
    return []


def make_optimizer(loop: Loop | str | None, model: torch.nn.Module, device_type: str = "cpu"):
    """The optimizer of `loop` (`core.loop.Loop`; its text, such as "adamw-fused") over the
    model's parameters, running the implementation its name means on `device_type` (the
    parameters' own device, or the one a prediction stands for); None for "none"."""
    name = as_loop(loop).optimizer
    if name == "none":
        return None
    options = implementation_options(name, device_type)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, **options)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **options)


def resolve_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is invalid: allowed are cpu, cuda, cuda:N") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index is not None):
        # cpu:N names no memory of its own: torch makes CPU tensors on "cpu", which is not "cpu:N"
        raise ValueError(f"device={device!r} is invalid: allowed are cpu, cuda, cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} is invalid here: no CUDA device is available; allowed is cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} is invalid: allowed are cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return dev


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


__all__ = ["HeldOutput", "autocast_dtype", "device_name", "make_optimizer", "resolve_device",
           "training_step", "with_dtype"]
