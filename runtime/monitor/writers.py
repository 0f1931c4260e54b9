"""Where training events go: CSV files, TensorBoard, Weights & Biases (the config's monitor sections).

An event is ``(name, value, step)`` with DeepSpeed's names (``Train/Samples/train_loss``, ...) and the
number of samples trained so far as the step. Only rank 0 writes, but every rank checks at
``runtime.initialize`` that an enabled backend's package is importable, so a missing package stops the
whole job with one clear error instead of failing on rank 0 while the other ranks wait in a collective.

- csv_monitor (always available, no dependency): one file per event under ``<output_path>/<job_name>/``,
  named after the event with "/" and spaces replaced by "_" (``Train_Samples_train_loss.csv``), with the
  header ``step,<last part of the name>`` and one ``step,value`` row per event, DeepSpeed's layout. A rerun
  appends to existing files.
- tensorboard (needs the ``tensorboard`` package): ``torch.utils.tensorboard.SummaryWriter`` writing to
  ``<output_path>/<job_name>/``, one scalar per event.
- wandb (needs ``wandb``): ``wandb.init(project, group, entity=team)``, one ``wandb.log`` per step.

An empty ``output_path`` means the current directory.
"""

from __future__ import annotations

import csv
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only
    from runtime.config import Config

__all__ = [
    "CSVWriter",
    "Event",
    "EventWriter",
    "MonitorUnavailable",
    "TensorBoardWriter",
    "WandbWriter",
    "open_writers",
]

Event = tuple[str, float, int]  # (name, value, step)


class MonitorUnavailable(RuntimeError):
    """A monitor is enabled in the config but its package is not installed."""


class EventWriter(Protocol):
    def write(self, events: Sequence[Event]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _directory(output_path: str, job_name: str) -> Path:
    return Path(output_path or ".") / job_name


def _file_name(event: str) -> str:
    return event.replace("/", "_").replace(" ", "_") + ".csv"


class CSVWriter:
    """DeepSpeed's csv_monitor layout: one ``step,value`` file per event name."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.directory = _directory(output_path, job_name)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[IO[str], Any]] = {}

    def _writer(self, name: str) -> Any:
        entry = self._files.get(name)
        if entry is None:
            path = self.directory / _file_name(name)
            new = not path.exists() or path.stat().st_size == 0
            handle = path.open("a", newline="")
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            entry = self._files[name] = (handle, writer)
        return entry[1]

    def write(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            # repr of a float round-trips exactly, so readers get the very value the engine computed
            self._writer(name).writerow([step, repr(float(value))])

    def flush(self) -> None:
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


class TensorBoardWriter:
    def __init__(self, output_path: str, job_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = _directory(output_path, job_name)
        self._writer = SummaryWriter(log_dir=str(self.directory))

    def write(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, group=group, entity=team)

    def write(self, events: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            self._run.log(by_step[step], step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def _require(section: str, module: str, package: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise MonitorUnavailable(
            f"{section}.enabled is true but the '{package}' package is not installed ({error}); "
            f"install it (pip install {package}) or set {section}.enabled to false"
        ) from None


def open_writers(config: Config, *, rank: int) -> list[EventWriter]:
    """The writers the config enables: checked on every rank, opened on rank 0 (others get [])."""
    if config.tensorboard.enabled:
        _require("tensorboard", "torch.utils.tensorboard", "tensorboard")
    if config.wandb.enabled:
        _require("wandb", "wandb", "wandb")
    if rank != 0:
        return []
    writers: list[EventWriter] = []
    if config.csv_monitor.enabled:
        writers.append(CSVWriter(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.tensorboard.enabled:
        writers.append(TensorBoardWriter(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.wandb.enabled:
        writers.append(WandbWriter(config.wandb.project, config.wandb.group, config.wandb.team))
    return writers
