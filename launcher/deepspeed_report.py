"""Which ``deepspeed`` this interpreter imports, and from where: dslaunch's compat package (``compat/``), a
real DeepSpeed, or none. The environment report (``ds_report``, whichever distribution installed the
command) shows it as its ``deepspeed`` check. Finding the package does not import it (nor torch)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

__all__ = ["DeepSpeedFound", "find_deepspeed"]

COMPAT_LABEL = "dslaunch"


@dataclass(frozen=True)
class DeepSpeedFound:
    """What `import deepspeed` would load in this interpreter."""

    importable: bool
    location: str | None  # the package directory
    version: str | None  # the installed distribution's version
    is_dslaunch: bool  # dslaunch's compat package (local version label "+dslaunch...")

    def describe(self) -> str:
        if not self.importable:
            return "deepspeed: not importable in this interpreter (pip install <dslaunch checkout>/compat)"
        who = "dslaunch's compatibility package" if self.is_dslaunch else "DeepSpeed (not dslaunch)"
        return f"deepspeed {self.version or '(no installed distribution)'}: {who}, from {self.location}"


def find_deepspeed() -> DeepSpeedFound:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        return DeepSpeedFound(False, None, None, False)
    locations = list(spec.submodule_search_locations or [])
    location = locations[0] if locations else (os.path.dirname(spec.origin) if spec.origin else None)
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = None
    is_dslaunch = bool(version and f"+{COMPAT_LABEL}" in version)
    return DeepSpeedFound(True, location, version, is_dslaunch)
