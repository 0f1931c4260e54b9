"""The monitor sections of the config: `tensorboard`, `csv_monitor` and `wandb`.

Owns their keys, types and DeepSpeed's defaults (job_name "DeepSpeedJobName", wandb project "deepspeed";
an empty output_path means the current directory). Nothing here decides whether a backend can run: that
an enabled backend's package is installed is checked by `runtime.monitor.writers` at `runtime.initialize`,
so loading a config never imports tensorboard or wandb. DeepSpeed's other monitor, `comet`, is refused by
name with the other unsupported top-level keys in `runtime.config`.

The dataclasses are re-exported by `runtime.config`, which is where callers import them from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.config_checks import Bool, Str
from runtime.config_reader import SectionReader


@dataclass(frozen=True)
class TensorBoardConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class CSVMonitorConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


def read_monitor(r: SectionReader, cls: type[TensorBoardConfig] | type[CSVMonitorConfig]) -> Any:
    cfg = cls(
        enabled=r.get("enabled", Bool(), False),
        output_path=r.get("output_path", Str(), ""),
        job_name=r.get("job_name", Str(), "DeepSpeedJobName"),
    )
    r.finish()
    return cfg


def read_wandb(r: SectionReader) -> WandbConfig:
    cfg = WandbConfig(
        enabled=r.get("enabled", Bool(), False),
        group=r.get("group", Str(nullable=True), None),
        team=r.get("team", Str(nullable=True), None),
        project=r.get("project", Str(), "deepspeed"),
    )
    r.finish()
    return cfg
