"""``deepspeed.runtime.lr_schedules``: the schedulers of the config's "scheduler" section.

``VALID_LR_SCHEDULES`` is what Accelerate checks a client scheduler's class name against before it hands
the scheduler to the engine.
"""

from runtime.config.optim import SCHEDULER_TYPES
from runtime.optim.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
ONE_CYCLE = "OneCycle"
VALID_LR_SCHEDULES = list(SCHEDULER_TYPES)

__all__ = [
    "ONE_CYCLE",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LR",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
