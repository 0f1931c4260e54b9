"""`OffloadSettings`: the typed `zero_optimization.offload_optimizer` section, read by `runtime.config.zero`.

It lives with the config (not in runtime/offload) so the config imports nothing from the code that runs
it; the offload's front door (`runtime.offload.build_master_placement`) logs the benchmark overrides
applied here (below) and plans the offloaded step from the settings (runtime/offload/plan.py).

Keys (DeepSpeed's `device`, `pin_memory` and `ratio`, and ours, in the same style):

- `ratio`: the share of the optimizer state (masters and moments) on the host, from 0 to 1 (DeepSpeed's
  ZeRO-Offload++; 1.0, the default, offloads all of it); the rest stays on the device and is updated
  there, while the host updates its share (runtime/zero/offload_split.py, runtime/offload/partial.py).
  "auto": the engine keeps on the device the largest share that fits beside the weights, gradients and
  activations, and logs the split and why (runtime/offload/auto_ratio.py).
- `update`: where the Adam step runs (runtime/offload/plan.py): "host", "device", or "auto" (the default:
  the GPU over state streamed from pinned host memory where it can run and the host and the GPU have
  room, else the CPU).
- `host_share`: with the device step, the fraction of each span's elements the CPU updates at the same
  time, from 0 to 1, or "auto" (the default: `one_rank_host_share`, scaled by the ranks on the host:
  plan.default_host_share).
- `grad_transfer`: the dtype 16-bit gradients cross PCIe in for the host step (plan.py): "fp32",
  "native", or "auto" (the default: fp32 on a GPU where the host has room).

"auto" is decided when the engine starts, from the machine; the settings hold it as None (and the
resolved config as null), since it is a choice left open, not a value.

The other fields are internal (no config keys, not in the resolved config): chunk and bucket sizes and
the CPU's default share, which tests set so a tiny model still spans several chunks (never by
overwriting a module constant), and a benchmark may set.

Benchmark overrides: `DSLAUNCH_OFFLOAD_UPDATE`, `DSLAUNCH_OFFLOAD_HOST_SHARE` and
`DSLAUNCH_OFFLOAD_GRAD_TRANSFER`, when set and not empty, replace their key as the config is read
(`with_overrides`; scripts/bench/offload.py's rows use them, and the launcher forwards them to remote
hosts): the environment is read once, here, and nowhere in runtime/offload. The settings keep one line per
override (`overrides`), which the offload's front door logs on rank 0 and the resolved config's notes
carry.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

OffloadDevice = Literal["none", "cpu"]  # where an offload section puts its tensors ("nvme" is refused)
UpdateSite = Literal["host", "device"]  # where the offloaded Adam step runs
GradTransfer = Literal["fp32", "native"]  # the dtype 16-bit gradients cross to the host in
UPDATE_CHOICES = ("auto", "host", "device")  # "auto" is held as None
GRAD_TRANSFER_CHOICES = ("auto", "fp32", "native")
SECTION = "zero_optimization.offload_optimizer"
INTERNAL = "internal"
"""Field metadata of the internal settings: runtime.config leaves them out of the resolved config."""

TRANSFER_CHUNK_ELEMS = 1 << 23
"""Elements per copy-back chunk of the host step: small enough that only the last chunk's copy is exposed,
large enough that per-chunk overhead stays below 1% (16 MiB of bf16)."""
DEVICE_CHUNK_ELEMS = 1 << 24
"""Elements per staging slot of the device step: 256 MiB of fp32 master, moments and gradient; the chunk
and slot counts compared on the H200 are in BENCHMARKS.md."""
ONE_RANK_BUCKET_NUMEL = 1 << 24
"""Bucket cap for optimizer offload with one rank, where gradients stream to the offloaded step during
backward: its first bucket must be final before any update can start, and with DeepSpeed's default
reduce_bucket_size (5e8) a GPT-2 XL is four buckets, the first complete a quarter into backward (the
step times with and without the cap are in BENCHMARKS.md). With more ranks reduce_bucket_size stays what
the config says: it sizes the reductions. `OffloadSettings.bucket_cap` hands it to the ZeRO stage."""
ONE_RANK_HOST_SHARE = 0.0
"""The CPU's share of the device step under "auto" with one rank on the host (plan.default_host_share
scales it for more): on the H200 the GPU alone beat every split tried (BENCHMARKS.md)."""


def _internal(default: Any) -> Any:
    return field(default=default, metadata={INTERNAL: True})


@dataclass(frozen=True)
class OffloadSettings:
    """`zero_optimization.offload_optimizer` (see the module docstring)."""

    device: OffloadDevice = "none"
    pin_memory: bool = False  # DeepSpeed 0.19.8 defaults to True
    ratio: float | None = 1.0  # host's share of the optimizer state (zero/offload_split.py); None: auto
    update: UpdateSite | None = None  # None: auto
    host_share: float | None = None  # 0..1; None: auto
    grad_transfer: GradTransfer | None = None  # None: auto
    # internal: not config keys
    transfer_chunk_elems: int = _internal(TRANSFER_CHUNK_ELEMS)
    device_chunk_elems: int = _internal(DEVICE_CHUNK_ELEMS)
    device_slots: int | None = _internal(None)  # None: as many as the device has room for (plan.device_slots)
    one_rank_bucket_numel: int = _internal(ONE_RANK_BUCKET_NUMEL)
    one_rank_host_share: float = _internal(ONE_RANK_HOST_SHARE)
    # the checked step's update during backward into a second copy of the state (plan.plan_speculation);
    # None: where the host has room for that copy
    speculate: bool | None = _internal(None)
    overrides: tuple[str, ...] = _internal(())  # the benchmark overrides applied (below), one line each

    def bucket_cap(self, world_size: int) -> int | None:
        """The most elements a ZeRO bucket may hold for this offload (None: reduce_bucket_size decides).
        With one rank nothing is reduced, and a bucket is only the unit in which gradients reach the
        offloaded step: small ones let it start early in backward."""
        if self.device == "none" or world_size != 1:
            return None
        return self.one_rank_bucket_numel


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
