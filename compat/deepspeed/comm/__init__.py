"""``deepspeed.comm``: module functions over torch.distributed (runtime.dist_api)."""

from runtime.dist_api import *  # noqa: F403
from runtime.dist_api import __all__  # noqa: F401
from runtime.unsupported import missing_names

__getattr__ = missing_names(
    "deepspeed.comm",
    "use torch.distributed for other collectives",
)
