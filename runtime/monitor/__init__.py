"""Training monitors: events to CSV / TensorBoard / W&B, and a progress bar for training scripts.

`TrainingMonitor` (metrics.py) is what the engine feeds at every accumulation boundary (``engine.monitor``);
`open_writers` (writers.py) opens the backends the config enables; `ProgressBar` (progress.py) is the
terminal progress line with an ETA that scripts/train_gpt.py uses on rank 0.
"""

from runtime.monitor.metrics import PREFIX, TrainingMonitor
from runtime.monitor.progress import ProgressBar, format_duration
from runtime.monitor.writers import (
    CSVWriter,
    Event,
    EventWriter,
    MonitorUnavailable,
    TensorBoardWriter,
    WandbWriter,
    open_writers,
)

__all__ = [
    "PREFIX",
    "CSVWriter",
    "Event",
    "EventWriter",
    "MonitorUnavailable",
    "ProgressBar",
    "TensorBoardWriter",
    "TrainingMonitor",
    "WandbWriter",
    "format_duration",
    "open_writers",
]
