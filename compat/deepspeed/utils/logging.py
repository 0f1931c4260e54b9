"""``deepspeed.utils.logging``: DeepSpeed's logger ("DeepSpeed") and ``log_dist``. PyTorch Lightning's
``DeepSpeedStrategy`` sets ``deepspeed.utils.logging.logger``'s level from its ``logging_level``."""

from runtime.deepspeed_api.unsupported import missing_names
from runtime.deepspeed_api.utils import log_dist, logger, print_rank_0

__all__ = ["log_dist", "logger", "print_rank_0"]

__getattr__ = missing_names(
    "deepspeed.utils.logging",
    "use deepspeed.utils.logging.logger (a logging.Logger) or log_dist",
)
