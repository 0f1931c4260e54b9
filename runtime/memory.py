"""Memory readings of this process: device allocator counters and host RSS, ``see_memory_usage``, and
how much host memory is left to allocate (``host_available_bytes``).

Reading them never synchronizes the device (the CUDA caching allocator's counters are host-side), so the
engine can report memory every step. On a CPU-only run there is no device allocator: only the host
resident set size (RSS) is reported.

The host's available memory is not what a container may use: psutil reads /proc/meminfo, which shows
the whole machine, while a memory cgroup (a Docker ``--memory`` or Kubernetes limit) kills the process
at its own limit. ``host_available_bytes`` takes the smaller of the two, reading cgroup v2
(``memory.max``) and v1 (``memory.limit_in_bytes``) along the process's cgroup path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from runtime.log import ensure_handler
from runtime.log import logger as _log

__all__ = [
    "DeviceMemory",
    "MemoryStats",
    "cgroup_headroom",
    "format_memory",
    "host_available_bytes",
    "memory_stats",
    "see_memory_usage",
]

GIB = float(1 << 30)


@dataclass(frozen=True)
class DeviceMemory:
    """The CUDA caching allocator's counters, in bytes."""

    allocated: int  # bytes in live tensors on the device
    reserved: int  # bytes the caching allocator holds (allocated + cached)
    peak_allocated: int  # max of `allocated` since start or the last peak reset
    peak_reserved: int


@dataclass(frozen=True)
class MemoryStats:
    """Bytes; `device` is None without a CUDA device."""

    host_rss: int  # resident set size of this process
    host_used_percent: float  # share of the host's memory in use by everything
    device: DeviceMemory | None = None


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device


def memory_stats(device: torch.device | str | None = None) -> MemoryStats:
    """This process's memory now. `device`: the CUDA device to read (default: the current one, when CUDA
    is initialized); a CPU device gives host figures only."""
    host = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    cuda = _cuda_device(device)
    if cuda is None:
        return MemoryStats(host_rss=rss, host_used_percent=host.percent)
    device_memory = DeviceMemory(
        allocated=torch.cuda.memory_allocated(cuda),
        reserved=torch.cuda.memory_reserved(cuda),
        peak_allocated=torch.cuda.max_memory_allocated(cuda),
        peak_reserved=torch.cuda.max_memory_reserved(cuda),
    )
    return MemoryStats(host_rss=rss, host_used_percent=host.percent, device=device_memory)


def format_memory(stats: MemoryStats) -> str:
    """``allocated=1.20GiB reserved=2.00GiB peak=1.75GiB host_rss=3.10GiB`` (host only on CPU)."""
    parts = []
    if stats.device is not None:
        parts.append(f"allocated={stats.device.allocated / GIB:.2f}GiB")
        parts.append(f"reserved={stats.device.reserved / GIB:.2f}GiB")
        parts.append(f"peak={stats.device.peak_allocated / GIB:.2f}GiB")
    parts.append(f"host_rss={stats.host_rss / GIB:.2f}GiB")
    return " ".join(parts)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def see_memory_usage(message: str, force: bool = False) -> MemoryStats | None:
    """Log this process's memory on rank 0 with `message`, like DeepSpeed's ``see_memory_usage``.

    Does nothing unless ``force`` (so calls can stay in the code). Resets the device's peak counters
    afterwards, so the next call's peak covers only what ran in between. Returns the readings (on every
    rank when forced), or None when not forced.
    """
    if not force:
        return None
    stats = memory_stats()
    if _rank() == 0:
        ensure_handler()
        _log.info("%s | %s | host used %.1f%%", message, format_memory(stats), stats.host_used_percent)
    cuda = _cuda_device(None)
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)
    return stats


_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def host_available_bytes(
    *, proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int:
    """Bytes this process can still allocate on the host: the host's available memory, or less where a
    memory cgroup (a container's limit) leaves less."""
    available = psutil.virtual_memory().available
    try:
        membership = proc_cgroup.read_text()
    except OSError:  # not Linux, or /proc hidden: the host's figure is all there is
        return available
    headroom = cgroup_headroom(membership, cgroup_root)
    return available if headroom is None else min(available, headroom)


def cgroup_headroom(membership: str, root: Path) -> int | None:
    """The least room left under any memory limit on this process's cgroup path, or None without one.

    `membership` is /proc/self/cgroup's text, `root` where cgroupfs is mounted. Room is the limit minus
    the usage, with inactive page cache counted as free (the kernel reclaims it before it kills), as
    psutil does for the host."""
    rooms = []
    for line in membership.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":  # cgroup v2, the unified hierarchy
            files = ("memory.max", "memory.current", "inactive_file")
            rooms += [_room(d, *files) for d in _ancestors(root, path)]
        elif "memory" in controllers.split(","):  # cgroup v1, the memory controller's own hierarchy
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            rooms += [_room(d, *files) for d in _ancestors(root / "memory", path)]
    known = [room for room in rooms if room is not None]
    return min(known) if known else None


def _ancestors(base: Path, path: str) -> list[Path]:
    """`base`/`path` and each of its parents up to `base`: a parent's limit binds its children too."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _room(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        limit, usage = int(limit_text), int((directory / usage_file).read_text())
    except (OSError, ValueError):  # no such cgroup here, or a file we cannot read: no known limit
        return None
    return max(0, limit - usage + _inactive_file(directory, inactive_key))


def _inactive_file(directory: Path, key: str) -> int:
    """Reclaimable page cache from memory.stat; 0 when unreadable (a known limit is never dropped)."""
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
