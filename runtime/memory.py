"""Memory readings of this process: device allocator counters and host RSS, and ``see_memory_usage``.

Reading them never synchronizes the device (the CUDA caching allocator's counters are host-side), so the
engine can report memory every step. On a CPU-only run there is no device allocator: only the host
resident set size (RSS) is reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

__all__ = ["MemoryStats", "format_memory", "memory_stats", "see_memory_usage"]

_log = logging.getLogger("runtime")
GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes; the device fields are None without a CUDA device."""

    host_rss: int  # resident set size of this process
    host_used_percent: float  # share of the host's memory in use by everything
    allocated: int | None = None  # bytes in live tensors on the device
    reserved: int | None = None  # bytes the caching allocator holds (allocated + cached)
    peak_allocated: int | None = None  # max of `allocated` since start or the last peak reset
    peak_reserved: int | None = None


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
    return MemoryStats(
        host_rss=rss,
        host_used_percent=host.percent,
        allocated=torch.cuda.memory_allocated(cuda),
        reserved=torch.cuda.memory_reserved(cuda),
        peak_allocated=torch.cuda.max_memory_allocated(cuda),
        peak_reserved=torch.cuda.max_memory_reserved(cuda),
    )


def format_memory(stats: MemoryStats) -> str:
    """``allocated=1.20GiB reserved=2.00GiB peak=1.75GiB host_rss=3.10GiB`` (host only on CPU)."""
    parts = []
    if stats.allocated is not None:
        parts.append(f"allocated={stats.allocated / GIB:.2f}GiB")
        parts.append(f"reserved={stats.reserved / GIB:.2f}GiB")
        parts.append(f"peak={stats.peak_allocated / GIB:.2f}GiB")
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
        from runtime.engine_log import _ensure_handler

        _ensure_handler()
        _log.info("%s | %s | host used %.1f%%", message, format_memory(stats), stats.host_used_percent)
    cuda = _cuda_device(None)
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)
    return stats
