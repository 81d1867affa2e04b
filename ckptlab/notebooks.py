"""`ckptlab.notebooks`: the public path of `ckptlab.apps.notebooks` (notebooks import run_folder and save_headline from here)."""

from .apps.notebooks import *  # noqa: F401,F403
from .apps.notebooks import __all__  # noqa: F401
