"""``deepspeed.comm``: module functions over torch.distributed (runtime.dist_api)."""

from runtime.dist_api import *  # noqa: F403
from runtime.dist_api import __all__  # noqa: F401
