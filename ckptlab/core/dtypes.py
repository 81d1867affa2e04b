"""The dtypes a training step can run in, by name. Imports nothing of ckptlab, nor torch:
validators and the command line read it; `probe.step` turns a name into torch's dtypes.

bf16 and fp16 are mixed precision: fp32 weights, matmuls in bf16 / fp16 under autocast (fp16
with a grad scaler in its loop, `core.loop`, as torch's AMP recipe runs it). bf16-weights /
fp16-weights is pure low-precision training, as after loading with `torch_dtype=torch.bfloat16`:
the model and the batch are cast (`probe.step.with_dtype`), no autocast.
"""

from __future__ import annotations

# name -> the torch dtype autocast runs in, by its name in torch (None: no autocast)
DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16", "bf16-weights": None, "fp16-weights": None}
# name -> the torch dtype the model and the batch are cast to, by its name in torch
WEIGHT_DTYPES = {"bf16-weights": "bfloat16", "fp16-weights": "float16"}
DTYPE_HELP = ("one of fp32 | bf16 | fp16 (autocast) | bf16-weights | fp16-weights (model and batch cast, "
              "no autocast)")


__all__ = ["DTYPES", "DTYPE_HELP", "WEIGHT_DTYPES"]
