"""``deepspeed.runtime.sequence_parallel``: DeepSpeed's ALST names (see ``ulysses_sp``)."""

from deepspeed.runtime.sequence_parallel import ulysses_sp

__all__ = ["ulysses_sp"]
