"""`ckptlab.analysis`: the public path of `ckptlab.report.analysis`."""

from .report.analysis import *  # noqa: F401,F403
from .report.analysis import __all__  # noqa: F401
