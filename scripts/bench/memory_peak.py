"""What the CUDA allocator held at its peak, grouped by where it was allocated: the check of an estimator's
memory terms against a real step.

``start_trace()`` turns on torch's allocation history (Python frames only) before anything is allocated;
``peak_breakdown(trace)`` replays the history's allocations and frees, finds the moment the allocated
bytes peaked, and sums what was alive then by the innermost frame outside torch (the model's line, or
ours), largest first. The replay is a pure function of the trace entries, so it is tested on CPU with
made-up ones (tests/scripts/test_memory_peak.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

GIB = 1 << 30
MAX_ENTRIES = 2_000_000  # events kept; a long-context step of the 8B shape makes a few hundred thousand


def start_trace() -> None:
    """Record every CUDA allocation and free of this process from now on, with its Python stack."""
    import torch

    torch.cuda.memory._record_memory_history(
        enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES
    )


def device_trace(device: Any) -> list[dict]:
    """The recorded events of `device`'s allocator, oldest first."""
    import torch

    index = torch.device(device).index or 0
    return list(torch.cuda.memory._snapshot()["device_traces"][index])


def short(frame: Mapping[str, Any]) -> str | None:
    """``path:line function`` for a frame outside torch and Python's own library (None for those), the
    path from its package down (``transformers/...``, ``runtime/...``)."""
    name = str(frame.get("filename", ""))
    if "/torch/" in name or name.startswith("<") or ("/lib/python3" in name and "-packages/" not in name):
        return None
    for marker in ("-packages/", "/runtime/", "/scripts/", "/compat/", "/tests/"):
        at = name.rfind(marker)
        if at >= 0:
            name = name[at + len(marker) :] if marker == "-packages/" else name[at + 1 :]
            break
    return f"{name}:{frame.get('line')} {frame.get('name')}"


def site(frames: Iterable[Mapping[str, Any]]) -> str:
    """Where a block was allocated: its innermost frame outside torch."""
    return next((s for s in map(short, frames) if s is not None), "(torch only)")


def peak_breakdown(trace: list[Mapping[str, Any]], top: int = 25) -> dict[str, Any]:
    """Replay `trace` (torch's ``device_traces`` entries: ``action``, ``addr``, ``size``, ``frames``);
    the peak of live allocated bytes, the event that reached it, and what was alive then by site."""
    live: dict[int, int] = {}
    total = peak = peak_at = 0
    for index, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_at = total, index
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])
    # replay again to the peak, now keeping each live block's site (computed for these blocks only)
    alive: dict[int, Mapping[str, Any]] = {}
    born: dict[int, int] = {}
    # blocks whose tensor is gone but whose memory the allocator still holds: the free waits for the
    # work of another stream the block was marked used by (record_stream) to finish
    pending: set[int] = set()
    for index, event in enumerate(trace[: peak_at + 1]):
        action = event.get("action")
        if action == "alloc":
            alive[event["addr"]], born[event["addr"]] = event, index
            pending.discard(event["addr"])
        elif action == "free_requested" and event["addr"] in alive:
            pending.add(event["addr"])
        elif action == "free_completed":
            alive.pop(event["addr"], None)
            pending.discard(event["addr"])
    groups: dict[str, list[int]] = {}
    for event in alive.values():
        entry = groups.setdefault(site(event.get("frames", ())), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    peak_event = trace[peak_at] if trace else {}
    return {
        "traced_peak_gib": round(peak / GIB, 3),
        # a full ring buffer lost its oldest events, and with them blocks alive at the peak
        "trace_complete": len(trace) < MAX_ENTRIES,
        # the stack of the allocation that reached the peak: which phase of the step it is
        "peak_during": [s for s in map(short, peak_event.get("frames", ())) if s is not None][:8],
        "by_site": [
            {"site": name, "gib": round(size / GIB, 3), "blocks": count}
            for name, (size, count) in ranked[:top]
        ],
        "other_gib": round(sum(size for _, (size, _) in ranked[top:]) / GIB, 3),
        "pending_free_gib": round(sum(alive[addr]["size"] for addr in pending) / GIB, 3),
        # the largest blocks themselves, and how many events before the peak each was allocated: blocks of
        # one site and size allocated far apart are one tensor per layer kept alive
        "largest_blocks": [
            {
                "site": site(event.get("frames", ())),
                "mib": round(event["size"] / 2**20, 1),
                "age": peak_at - born[addr],
                "free_pending": addr in pending,  # dead tensor, memory held for another stream's use
            }
            for addr, event in sorted(alive.items(), key=lambda item: -item[1]["size"])[:top]
        ],
    }
