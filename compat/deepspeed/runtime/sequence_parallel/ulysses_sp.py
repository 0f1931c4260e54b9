"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: the tiled MLP and loss (runtime.sequence); the
Ulysses classes raise UnsupportedFeature until sequence parallelism exists (issue 34)."""

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
    "sequence parallelism (Ulysses) is planned (issue 34); see README.md, Long sequences",
)
