"""`ckptlab.plots`: the public path of `ckptlab.report.plots`."""

from .report.plots import *  # noqa: F401,F403
from .report.plots import __all__  # noqa: F401
