"""`ckptlab.hf`: Hugging Face transformers in ckptlab, in one public place — the hf-* workloads
(`ckptlab.workloads.hf`) and transformers' own checkpointing as policies (`ckptlab.checkpoint.hf`).
Needs the optional extra `ckptlab[hf]`."""

from .checkpoint.hf import *  # noqa: F401,F403
from .checkpoint.hf import __all__ as _checkpointing
from .workloads.hf import *  # noqa: F401,F403
from .workloads.hf import __all__ as _workloads

__all__ = [*_workloads, *_checkpointing]
