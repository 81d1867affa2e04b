"""The gradient check of a comparison's rows: each row's model, applied as the row applies it,
against the un-checkpointed eager model (`probe.verify`), its verdict written into the row.

Fresh models from the workload's seed, one forward + backward each, compiled ones drawing random
numbers as eager does. A row gains `gradients` (exact | within tolerance | wrong),
`max_grad_diff` and `max_grad_rel_diff` (the largest absolute and relative differences judged);
a row whose check fails keeps its measurements and says why in `message`.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from ..probe.step import autocast_dtype, with_dtype
from ..probe.verify import RELATIVE_TOLERANCE, GradientComparison, gradient_difference, like_eager, step_gradients
from ..workloads.base import Workload
from .progress import Progress


def verify_rows(rows: list[dict], appliers: Mapping[str, Optional[Callable]], workload: Workload, batch_size: int,
                seq_len: int, dtype: str, dev: torch.device, bar: Optional[Progress] = None) -> None:
    """Check the gradients of every row not yet checked (module docstring). `appliers` maps a
    row's policy label to how it is applied to a model (`apply(model, record) -> (model to run,
    compiled?, handle or None)`, as `probe.measure.prepare_step` takes it); a row without one, or
    whose status is not ok, gets no verdict (None)."""
    rows = [r for r in rows if "gradients" not in r]
    if not rows:
        return
    bar = bar or Progress("verify", False)
    bar.phase("verify gradients", len(rows), "config")
    workload = with_dtype(workload, dtype)
    batch = workload.batch(batch_size, seq_len, dev)
    autocast = autocast_dtype(dtype)
    reference = step_gradients(workload.build(dev).train(), workload, batch, workload.seed, autocast_dtype=autocast)
    for r in rows:
        apply = appliers.get(r["policy"])
        r.update(gradients=None, max_grad_diff=None, max_grad_rel_diff=None)
        bar.step(r["policy"])
        if r["status"] != "ok" or apply is None:
            continue
        model = workload.build(dev).train()
        try:
            runner, compiled, _ = apply(model, {})
            with like_eager(bool(compiled)):
                loss, grads = step_gradients(model, workload, batch, workload.seed, runner=runner,
                                             autocast_dtype=autocast)
        except Exception as exc:  # noqa: BLE001 - the row keeps its measurements and says why
            r["message"] = f"gradient check failed: {type(exc).__name__}: {exc}"
            continue
        check = GradientComparison(r["policy"], reference[0].item(), loss.item(),
                                   *gradient_difference(*reference, loss, grads), RELATIVE_TOLERANCE[dtype])
        r.update(gradients=check.verdict, max_grad_diff=check.max_abs_diff, max_grad_rel_diff=check.max_rel_diff)


__all__ = ["verify_rows"]
