"""The version: DeepSpeed's release whose API this mirrors, then dslaunch's own as the local label."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("deepspeed")
except metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0.20.2+dslaunch.0.1.0"

_public = __version__.split("+", 1)[0].split(".")
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in _public[:3])
