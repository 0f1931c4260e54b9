"""Optimizer and learning-rate-scheduler factories for the config's `optimizer` and `scheduler` sections.

The engine calls `build_optimizer(config.optimizer, params)` and `build_scheduler(config.scheduler, opt)`;
the classes are public for scripts that build them directly.
"""

from runtime.optim.muon import MuonWithAuxAdam, muon_split
from runtime.optim.optimizers import Lamb, adam_implementation, build_optimizer
from runtime.optim.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

__all__ = [
    "Lamb",
    "MuonWithAuxAdam",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "adam_implementation",
    "build_optimizer",
    "build_scheduler",
    "muon_split",
]
