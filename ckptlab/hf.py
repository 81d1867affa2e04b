"""`ckptlab.hf`: Hugging Face transformers in ckptlab under one short public path — the Trainer
callback and the side-by-side of the transformers guide's recipe (`ckptlab.run.trainer`).
Needs the optional extra `ckptlab[hf]` (transformers and accelerate)."""

from .run.trainer import CkptlabCallback, compare_trainer_runs

__all__ = ["CkptlabCallback", "compare_trainer_runs"]
