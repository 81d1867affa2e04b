"""`ckptlab.hf`: Hugging Face transformers in ckptlab under one short public path — the hf-* and
hf:<model_type> workloads (`ckptlab.workloads.hf`), transformers' own checkpointing as policies
(`ckptlab.checkpoint.hf`), the Trainer callback and the side-by-side of the transformers guide's
recipe (`ckptlab.run.trainer`). Needs the optional extra `ckptlab[hf]` (transformers and accelerate)."""

from .checkpoint.hf import HFCheckpointHandle, apply_hf_checkpointing, hf_capabilities, hf_layers
from .run.trainer import CkptlabCallback, compare_trainer_runs
from .workloads.hf import HF_PRESETS, HFWorkload, get_hf_workload

__all__ = ["HF_PRESETS", "CkptlabCallback", "HFCheckpointHandle", "HFWorkload", "apply_hf_checkpointing",
           "compare_trainer_runs", "get_hf_workload", "hf_capabilities", "hf_layers"]
