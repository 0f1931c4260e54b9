"""``deepspeed.comm``: module functions over torch.distributed (runtime.deepspeed_api.collectives)."""

from runtime.deepspeed_api.collectives import *  # noqa: F403
from runtime.deepspeed_api.collectives import __all__  # noqa: F401
from runtime.deepspeed_api.unsupported import missing_names

__getattr__ = missing_names(
    "deepspeed.comm",
    "use torch.distributed for other collectives",
)
