"""The benchmark overrides of the `offload_optimizer` settings: the only environment read in runtime/offload.

`OffloadSettings` itself, the typed section and what its keys do, is the config's
(runtime/config/offload.py). The offload's front door (`runtime.offload.build_master_placement`) applies
the overrides here once, logs each, and plans the offloaded step from the result (plan.py); nothing
below it reads a knob from anywhere but those settings.

Benchmark overrides: `DSLAUNCH_OFFLOAD_UPDATE`, `DSLAUNCH_OFFLOAD_HOST_SHARE` and
`DSLAUNCH_OFFLOAD_GRAD_TRANSFER`, when set and not empty, replace their key (scripts/bench/offload.py's
rows use them; the launcher forwards them to remote hosts). Each override is logged on rank 0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from runtime.config.offload import GRAD_TRANSFER_CHOICES, SECTION, UPDATE_CHOICES, OffloadSettings

OVERRIDES = {
    "update": "DSLAUNCH_OFFLOAD_UPDATE",
    "host_share": "DSLAUNCH_OFFLOAD_HOST_SHARE",
    "grad_transfer": "DSLAUNCH_OFFLOAD_GRAD_TRANSFER",
}
"""The benchmark override of each key."""


def parse_override(key: str, text: str) -> str | float | None:
    """The value of `key` that the override variable's `text` asks for (None: auto); ValueError names the
    variable and what it takes."""
    name = OVERRIDES[key]
    if text.lower() == "auto":
        return None
    if key == "host_share":
        try:
            share = float(text)
        except ValueError:
            share = math.nan
        if not 0.0 <= share <= 1.0:  # also false for nan
            raise ValueError(
                f"{name}={text!r}: expected the fraction of the Adam step the CPU takes while the GPU runs "
                f"the rest, from 0 to 1, or auto (it overrides {SECTION}.host_share)"
            )
        return share
    choices = UPDATE_CHOICES if key == "update" else GRAD_TRANSFER_CHOICES
    value = text.lower()
    if value not in choices:
        raise ValueError(
            f"{name}={text!r}: expected one of {', '.join(choices)} (it overrides {SECTION}.{key})"
        )
    return value


def with_overrides(
    settings: OffloadSettings, environ: Mapping[str, str] | None = None
) -> tuple[OffloadSettings, list[str]]:
    """`settings` with every override variable that is set (and not empty) in place of its key, and one
    line per override for the log. `environ`: the process's environment when None."""
    environ = os.environ if environ is None else environ
    changes: dict[str, Any] = {}
    notes = []
    for key, name in OVERRIDES.items():
        text = environ.get(name, "").strip()
        if not text:
            continue
        changes[key] = parse_override(key, text)
        configured = getattr(settings, key)
        notes.append(
            f"{name}={text} overrides {SECTION}.{key} (the config says "
            f"{'auto' if configured is None else repr(configured)}); the variable is a benchmark "
            "override: set the key in the config instead"
        )
    return replace(settings, **changes), notes
