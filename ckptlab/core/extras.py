"""Optional dependencies: what each extra of `pip install 'ckptlab[...]'` brings, and one clear
line when a feature needs a package that is not installed (instead of a traceback)."""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> the extra that installs it (pyproject.toml's optional-dependencies)
EXTRA_OF = {"nbformat": "notebooks", "papermill": "notebooks", "ipywidgets": "notebooks",
            "transformers": "hf", "accelerate": "hf", "peft": "hf", "submitit": "cluster"}


class MissingExtraError(ImportError, ValueError):
    """A feature needs an optional package that is not installed. An ImportError to Python, and
    a ValueError so that the command line reports it as one line (bad setup, nothing was run)."""


def missing_extra(module: str, feature: str) -> MissingExtraError:
    extra = EXTRA_OF[module]
    return MissingExtraError(f"{feature} needs {module}, which is not installed: pip install 'ckptlab[{extra}]'",
                             name=module)


def require(module: str, feature: str) -> ModuleType:
    """Import `module`, or raise MissingExtraError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing_extra(module, feature) from None


__all__ = ["EXTRA_OF", "MissingExtraError", "missing_extra", "require"]
