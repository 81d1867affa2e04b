"""transformers' Trainer, measured: a callback that records every optimizer step into a run folder,
and a side-by-side of the transformers guide's recipe against ckptlab's policies.

    from ckptlab.hf import CkptlabCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[CkptlabCallback("results/my-run", "density=0.5")])
    trainer.train()
    ckptlab.load_run("results/my-run")      # one row per optimizer step

With a policy the callback checkpoints the model at train begin and removes it at train end;
with `policy=None` the model stays as `TrainingArguments` set it; both at once are refused. What
a row holds, how memory is read without slowing every step, and where each phase starts:
docs/design.md, note "What the Trainer callback records".
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..core.extras import missing_extra

try:
    import transformers
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
except ImportError:
    raise missing_extra("transformers", "CkptlabCallback") from None

from ..checkpoint.blocks import handle_of
from ..checkpoint.hf import HFCheckpointHandle, hf_layers
from ..checkpoint.wrap import apply_checkpointing
from ..core.loop import Loop
from ..core.policy import parse_policy
from ..core.records import new_record, tokens_per_second
from ..core.validate import integer
from ..probe.memory import CATEGORIES, cuda_allocator_stats, track_memory
from ..probe.step import device_name, resolve_device
from ..workloads.registry import as_workload
from .provenance import environment, now
from .store import RunWriter, check_replaceable, fresh_run_folder, load_run, read_records

TRANSFORMERS_FLAG = "gradient_checkpointing"  # run label: TrainingArguments' own checkpointing
STEP_PHASES = ("forward", "backward", "optimizer")


class CkptlabCallback(TrainerCallback):
    """Records one row per optimizer step of a transformers `Trainer` into the run folder `out`.

    policy:       a ckptlab policy ("full", "density=0.5", "hf", ...) applied at train begin and
                  removed at train end; None leaves the model as TrainingArguments configured it.
    track_steps:  on CPU, how many of the first optimizer steps run under the live-tensor tracker
                  (None: all); later rows have no memory columns and an untouched step time.
    model_name:   the `model` column (default: the config's name_or_path, else the class name).
    """

    def __init__(self, out: str | Path, policy: Optional[str] = None, *, track_steps: Optional[int] = None,
                 model_name: Optional[str] = None):
        if not isinstance(out, (str, Path)) or not str(out):
            raise ValueError(f"out={out!r} is invalid: allowed is a folder path")
        self.policy = None if policy is None else parse_policy(policy)
        if track_steps is not None and (isinstance(track_steps, bool) or not isinstance(track_steps, int)
                                        or track_steps < 0):
            raise ValueError(f"track_steps={track_steps!r} is invalid: allowed is None or an integer >= 0")
        self.out = Path(out)
        self.track_steps = track_steps
        self.model_name = model_name
        self.handle = None           # the policy this callback applied (removed at train end)
        self._applied = None         # the policy on the model during training, whoever applied it
        self._writer = None
        self._hooks: list = []
        self._run: dict = {}
        self._step: Optional[dict] = None
        self._memory: Optional[contextlib.ExitStack] = None
        self._tracker = None
        self._steps_done = 0

    # ----------------------------------------------------------------------------- train begin/end

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.close()
        self._loop = training_loop(args)
        earlier = read_records(self.out)
        if earlier:
            raise ValueError(f"out={str(self.out)!r} is invalid: it already holds {len(earlier)} records of an earlier "
                             "run; choose another folder (one run folder per train())")
        layers = hf_layers(model)   # a peft model too: its layers are the transformers model's
        marked = [i for i, layer in enumerate(layers) if getattr(layer, "gradient_checkpointing", False)]
        applied = _user_applied_handle(model)  # a policy the user applied before train()
        if marked and (self.policy is not None or applied is not None):
            which = f"policy={str(self.policy)!r}" if self.policy is not None else \
                f"the ckptlab policy {str(applied.policy)!r} already on the model"
            raise ValueError(
                f"{which} is invalid for this Trainer: transformers' own checkpointing is already on "
                f"({_transformers_label(args)}, layers {marked}), and the two would nest (every checkpointed "
                "layer recomputed twice). Choose one: CkptlabCallback(policy=None) on a model without a ckptlab "
                "policy measures transformers' checkpointing; TrainingArguments(activation_checkpointing=False) "
                "lets ckptlab's policy apply")
        if self.policy is not None:
            self.handle = apply_checkpointing(model, self.policy)
            applied = self.handle
        self._applied = applied
        if applied is not None:
            policy, mechanism = str(applied.policy), ("none" if applied.effective_density == 0 else "ckptlab")
            n_blocks, checkpointed = applied.n_blocks, applied.checkpointed_blocks
        elif marked:
            policy, mechanism, n_blocks, checkpointed = _transformers_label(args), "transformers", len(layers), marked
        else:
            policy, mechanism, n_blocks, checkpointed = "none", "none", len(layers) or None, []
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        config = getattr(model, "config", None)
        self._run = {
            "model": self.model_name or getattr(config, "_name_or_path", "") or type(model).__name__,
            "n_blocks": n_blocks,
            "policy": policy,
            "mechanism": mechanism,
            "effective_density": len(checkpointed) / n_blocks if n_blocks else 0.0,
            "checkpointed_blocks": ",".join(map(str, checkpointed)),
            "device": str(device),
            "device_name": device_name(device),
            "dtype": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        }
        self._device = device
        self._steps_done = 0
        self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       model.register_forward_hook(self._after_forward, with_kwargs=True)]
        self._writer = RunWriter(self.out).__enter__()
        self._meta = {"kind": "trainer", **{k: self._run[k] for k in ("model", "policy", "mechanism")},
                      "training_arguments": _arguments(args), "track_steps": self.track_steps,
                      "started_at": now(), "finished_at": None, "steps": 0,
                      "environment": _environment(str(device))}
        self._writer.write_meta(self._meta)

    def on_train_end(self, args, state, control, **kwargs):
        if self._writer is not None:
            self._meta.update(finished_at=now(), steps=self._steps_done)
            self._writer.write_meta(self._meta)
        self.close()

    def close(self) -> None:
        """Undo everything the callback set up: the tracker of a step in flight, the model hooks,
        the policy, the run folder's lock. Train end calls it; call it yourself after a `train()`
        that raised, before using the model again."""
        if self._memory is not None:
            self._memory.close()
        self._memory = self._tracker = self._step = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self._writer is not None:
            self._writer.__exit__(None, None, None)
            self._writer = None

    # ----------------------------------------------------------------------------- one optimizer step

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        tracked = self._device.type == "cpu" and (self.track_steps is None or self._steps_done < self.track_steps)
        self._step = {"micro_batches": 1, "sequences": 0, "tokens": 0, "seq_len": None, "losses": [],
                      "loss_spans_batch": False}
        if self._applied is not None:
            self._applied.reset_counts()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        if tracked:
            self._memory = contextlib.ExitStack()
            self._tracker = self._memory.enter_context(
                track_memory(model, optimizer, device=self._device, detect_backward=True))
        self._started = time.perf_counter()

    def _before_forward(self, module, args, kwargs):
        if self._step is None:  # evaluation or generation outside a training step
            return
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self._tracker is not None:
            self._tracker.phase("forward")
            self._tracker.add_inputs(tensors)
        ids = kwargs.get("input_ids", tensors[0] if tensors else None)
        if ids is not None:
            self._step["sequences"] += ids.shape[0]
            self._step["tokens"] += ids.numel()
            self._step["seq_len"] = ids.shape[1] if ids.dim() > 1 else None

    def _after_forward(self, module, args, kwargs, output):
        if self._step is None:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self._step["losses"].append(loss.detach())
            # Normalised by the item count of the whole accumulated batch: the micro-batch losses add up.
            self._step["loss_spans_batch"] |= kwargs.get("num_items_in_batch") is not None

    def on_substep_end(self, args, state, control, **kwargs):
        if self._step is not None:  # Trainer calls it after every micro-batch but the last
            self._step["micro_batches"] += 1

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._tracker is not None:
            self._tracker.phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self._step is None:
            return
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        step_ms = (time.perf_counter() - self._started) * 1e3
        report = None
        if self._memory is not None:
            self._memory.close()
            report = self._tracker.report()
        self._memory = self._tracker = None
        step, self._step = self._step, None
        losses = [float(l) for l in step["losses"]]
        loss = (sum(losses) if step["loss_spans_batch"] else sum(losses) / len(losses)) if losses else None
        record = new_record(
            self._run["model"], step["sequences"] // step["micro_batches"], step["seq_len"],
            dataclasses.replace(self._loop, accum_steps=step["micro_batches"]),
            n_blocks=self._run["n_blocks"], effective_batch_size=step["sequences"], tokens=step["tokens"],
            **{k: self._run[k] for k in ("policy", "mechanism", "effective_density", "checkpointed_blocks",
                                         "device", "device_name", "dtype")},
            step=state.global_step,
            epoch=state.epoch,
            memory_tracked=report is not None,
            peak_bytes=report.peak_bytes if report else None,
            **{f"peak_{c}_bytes": report.peak_by_category.get(c) if report else None for c in CATEGORIES},
            peak_phase=report.peak_phase if report else None,
            **{f"peak_in_{phase}_bytes": max((b for p, b in report.timeline if p == phase), default=None)
               if report else None for phase in STEP_PHASES},
            saved_activation_bytes=report.saved_activation_bytes if report else None,
            recompute_count=self._applied.recompute_count if self._applied is not None else None,
            note="step time includes the live-tensor tracker's hooks" if report else "",
            loss=loss,
            step_ms=step_ms,
            tokens_per_s=tokens_per_second(step["tokens"], step_ms),
        )
        if self._device.type == "cuda":
            record.update(cuda_allocator_stats(self._device))
            record["peak_bytes"] = record["cuda_max_allocated_bytes"]
        self._writer.append(record)
        self._steps_done += 1


def _user_applied_handle(model: nn.Module):
    """The handle of a ckptlab policy (other than transformers' own, which marks layers) that
    some module of `model` carries, or None."""
    for module in model.modules():
        handle = handle_of(module)
        if handle is not None and not isinstance(handle, HFCheckpointHandle):
            return handle
    return None


def _transformers_label(args) -> str:
    """transformers' checkpointing as TrainingArguments set it, in ckptlab's policy words."""
    options = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
    if options.get("offload"):
        return "hf:offload"
    if options.get("every_n_layers", 1) != 1:
        return f"hf:every_n_layers={options['every_n_layers']}"
    return "hf"


# TrainingArguments.optim -> the loop's optimizer: Trainer builds torch.optim.AdamW (implementation
# left to torch, or fused=True) and torch.optim.SGD for these (transformers' trainer_optimizer.py).
OPTIMS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw-fused", "sgd": "sgd"}


def training_loop(args: TrainingArguments) -> Loop:
    """The loop Trainer runs for `args` (`core.loop`): gradient_accumulation_steps, max_grad_norm
    (0 or None: no clipping), optim (`OPTIMS`) and fp16 (a GradScaler); Trainer sets gradients to
    None between steps and keeps no output. An optim ckptlab's loop cannot name is refused."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in OPTIMS:
        raise ValueError(f"optim={optim!r} is invalid for CkptlabCallback: its loop names torch's optimizers; allowed "
                         f"are {', '.join(OPTIMS)}")
    return Loop(accum_steps=args.gradient_accumulation_steps, optimizer=OPTIMS[optim],
                clip_grad_norm=args.max_grad_norm or None, grad_scaler=bool(args.fp16))


def _arguments(args) -> dict:
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "learning_rate",
            "activation_checkpointing", "activation_checkpointing_kwargs", "max_grad_norm", "seed", "bf16", "fp16")
    return {k: getattr(args, k, None) for k in keys}


def _environment(device: str) -> dict:
    env = environment(device)
    env["packages"].update({name: metadata.version(name) for name in ("transformers", "accelerate")})
    return env


# ----------------------------------------------------------------------------- the guide's recipe, measured

def compare_trainer_runs(
    out: str | Path,
    runs: Sequence[str] = ("none", TRANSFORMERS_FLAG, "full"),
    model: str = "hf-llama-tiny",
    batch_size: int = 4,
    seq_len: int = 64,
    accum_steps: int = 2,
    max_steps: int = 8,
    track_steps: Optional[int] = 2,
    learning_rate: float = 1e-3,
    device: str = "cpu",
    seed: int = 0,
):
    """Train the same model on the same data with transformers' `Trainer` once per entry of
    `runs`: "none" (no checkpointing), "gradient_checkpointing" (TrainingArguments'
    activation_checkpointing=True, the guide's recipe), or any ckptlab policy (applied by
    `CkptlabCallback`). Every run uses `gradient_accumulation_steps=accum_steps`, dropout as the
    preset has it, and the same seed, so checkpointing must not change a single logged loss.

    Each run writes its folder `out/<run>/`. Returns one DataFrame row per optimizer step of every
    run: the callback's record plus `run` and `trainer_loss` (the loss Trainer itself logged).
    `ckptlab.analysis.trainer_summary` makes it one row per run: the median step time with its 95%
    interval, and the overhead against "none" with an unpaired interval — the runs train one
    after another, not in interleaved rounds, so their steps cannot be paired.
    """
    runs = list(runs)
    if "none" not in runs or len(set(runs)) != len(runs):
        raise ValueError(f"runs={runs!r} is invalid: allowed is a list of distinct labels that includes 'none' "
                         "(the run every other is compared against)")
    policies = {run: (None if run in ("none", TRANSFORMERS_FLAG) else str(parse_policy(run))) for run in runs}
    for name, value, minimum in (("batch_size", batch_size, 1), ("seq_len", seq_len, 2), ("accum_steps", accum_steps, 1),
                                 ("max_steps", max_steps, 1), ("seed", seed, 0)):
        integer(name, value, minimum)
    if track_steps is not None and (isinstance(track_steps, bool) or not isinstance(track_steps, int) or track_steps < 0):
        raise ValueError(f"track_steps={track_steps!r} is invalid: allowed is None or an integer >= 0")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid here: allowed are cpu, cuda (Trainer trains on the first "
                         "visible GPU; choose it with CUDA_VISIBLE_DEVICES)")
    dev = resolve_device(device)
    workload = as_workload(model)
    causal = set(transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    built = workload.build("meta")
    base = built.get_base_model() if hasattr(built, "peft_config") else built   # a LoRA fine-tune's model
    if type(base).__name__ not in causal:
        raise ValueError(f"model={getattr(workload, 'name', model)!r} is invalid here: allowed are transformers causal "
                         "language models (hf-gpt2-tiny, hf-llama-tiny, hf-gpt2, hf-llama-1b)")
    workload.check_shape(batch_size, seq_len, min_seq_len=2)
    out = Path(out)
    for run in runs:
        check_replaceable(out / run)

    dataset = _RandomTokens(workload.config.vocab_size, batch_size * accum_steps * max_steps, seq_len, seed)
    frames = []
    for run in runs:
        run_dir = fresh_run_folder(out / run)   # a rerun replaces a run folder ckptlab made, nothing else
        callback = CkptlabCallback(run_dir, policies[run], track_steps=track_steps, model_name=workload.name)
        with tempfile.TemporaryDirectory() as scratch:
            args = OneDeviceArguments(
                output_dir=scratch, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accum_steps,
                max_steps=max_steps, learning_rate=learning_rate, logging_steps=1, save_strategy="no", report_to="none",
                disable_tqdm=True, seed=seed, data_seed=seed, use_cpu=dev.type == "cpu",
                activation_checkpointing=run == TRANSFORMERS_FLAG)
            trainer = Trainer(model=workload.build(dev), args=args, train_dataset=dataset, callbacks=[callback])
            trainer.remove_callback(PrinterCallback)  # the losses are in the returned frame, not printed
            trainer.train()
        logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        df = load_run(run_dir)
        df.insert(0, "run", run)
        df["trainer_loss"] = df["step"].map(logged)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


class OneDeviceArguments(TrainingArguments):
    """TrainingArguments on one device. Where several GPUs are visible, Trainer counts them all
    (`n_gpu`), wraps the model in `nn.DataParallel` and splits every batch over them: another step
    than the one measured, with another model object than the one the callback checkpoints."""

    @property
    def n_gpu(self) -> int:
        return min(super().n_gpu, 1)


class _RandomTokens(torch.utils.data.Dataset):
    """Random token sequences from a seeded generator; labels are the inputs (the model shifts)."""

    def __init__(self, vocab_size: int, n: int, seq_len: int, seed: int):
        self.tokens = torch.randint(0, vocab_size, (n, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


__all__ = ["CkptlabCallback", "OneDeviceArguments", "compare_trainer_runs"]
