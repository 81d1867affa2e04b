"""`ckptlab.store`: the public path of `ckptlab.run.store`."""

from .run.store import *  # noqa: F401,F403
from .run.store import __all__  # noqa: F401
