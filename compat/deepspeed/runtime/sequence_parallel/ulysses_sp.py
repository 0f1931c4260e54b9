"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: the tiled MLP and loss and Ulysses sequence
parallelism's attention and data loader adapter (runtime.sequence); other names of the module are refused
by name."""

from runtime.deepspeed_api.alst import (
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)
from runtime.deepspeed_api.unsupported import missing_names

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

__getattr__ = missing_names(
    "deepspeed.runtime.sequence_parallel.ulysses_sp",
    "dslaunch has the tiled MLP and loss and Ulysses attention and data; see README.md, Long context",
)
