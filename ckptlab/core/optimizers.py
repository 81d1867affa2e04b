"""The optimizers a training step can run, by name, and the implementation each name means on a
device. Imports nothing of ckptlab, nor torch: validators and the command line read it.

torch's AdamW and SGD have three implementations that hold different temporaries at the
optimizer step: the for-loop (`foreach=False`: one parameter at a time, so its temporaries are
the size of the largest parameter), foreach (`foreach=True`: `_foreach_sqrt` of every second
moment at once, a temporary the size of the whole state) and fused (`fused=True`: one kernel,
none). Left to choose, torch takes foreach when every parameter is a plain tensor on CUDA and
the for-loop on CPU (torch/optim/optimizer.py:161 `_default_to_fused_or_foreach` at v2.13.0; its
foreach devices, torch/utils/_foreach_utils.py:10, have no CPU).
"""

from __future__ import annotations

OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused", "adamw-forloop", "sgd", "none")
OPTIMIZER_HELP = ("adamw (the implementation torch picks on the device: foreach on CUDA, the for-loop on CPU) | "
                  "adamw-foreach | adamw-fused | adamw-forloop | sgd (torch's pick) | none")


def implementation(name: str, device_type: str) -> str:
    """'foreach', 'fused' or 'forloop': what optimizer `name` runs on `device_type` ('cpu',
    'cuda'); 'none' for no optimizer."""
    if name == "none":
        return "none"
    explicit = name.partition("-")[2]
    return explicit or ("foreach" if device_type == "cuda" else "forloop")


def implementation_options(name: str, device_type: str) -> dict:
    """The keywords that make torch's optimizer run `implementation(name, device_type)`: passed
    explicitly, so a step on CPU tensors standing for CUDA ones (a prediction) runs CUDA's."""
    kind = implementation(name, device_type)
    return {"foreach": True} if kind == "foreach" else {"fused": True} if kind == "fused" else {"foreach": False}


__all__ = ["OPTIMIZERS", "OPTIMIZER_HELP", "implementation", "implementation_options"]
