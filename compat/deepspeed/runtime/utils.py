"""``deepspeed.runtime.utils``: memory reporting and the seeding helper scripts import."""

from runtime.deepspeed_api.utils import set_random_seed
from runtime.memory import see_memory_usage

__all__ = ["see_memory_usage", "set_random_seed"]
