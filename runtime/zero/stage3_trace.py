"""The order in which ZeRO-3 units are needed, recorded on one pass and followed on the next ones.

Forward and backward each keep an `ExecutionTrace`. The first pass records the sequence of unit needs
(one entry per module call that needs a unit, so a module called twice appears twice). Later passes
follow it: each need is checked against the recorded sequence, and what lies ahead tells the scheduler
which units to all-gather early (`prefetch_candidates`) and whether a unit that just finished will be
needed again soon enough to keep it (`reuse_distance`). A need that does not match the recording (the
model took another path) invalidates the rest of the recording; the current pass is recorded from there
on, and prefetching resumes on the next pass. Every rank sees the same needs, so every rank makes the
same prefetch decisions and issues the same collectives in the same order.

Pure bookkeeping on unit indices and sizes; no tensors, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class ExecutionTrace:
    """Records one pass's unit needs and follows them on later passes."""

    recorded: list[int] | None = None  # the needs of the last complete pass that was recorded
    invalidations: int = 0  # passes that departed from the recording
    _recording: list[int] | None = None
    _position: int = 0
    _active: bool = False
    _history: list[int] = field(default_factory=list)

    def begin(self) -> None:
        """Start a pass: follow the recording when there is one, otherwise record."""
        self._active = True
        self._position = 0
        self._history = []
        self._recording = None if self.recorded is not None else []

    @property
    def following(self) -> bool:
        return self._active and self._recording is None and self.recorded is not None

    def need(self, unit: int) -> bool:
        """Note that `unit` is needed now; True when this matched the recording."""
        if not self._active:
            return False
        self._history.append(unit)
        if self._recording is not None:
            self._recording.append(unit)
            return False
        assert self.recorded is not None
        if self._position < len(self.recorded) and self.recorded[self._position] == unit:
            self._position += 1
            return True
        # Departed from the recording: record this pass instead, from its start.
        self.invalidations += 1
        self.recorded = None
        self._recording = list(self._history)
        return False

    def end(self) -> None:
        """Finish the pass; a pass that was recorded becomes the recording."""
        if self._active and self._recording is not None:
            self.recorded = self._recording
        elif self._active and self.recorded is not None and self._position != len(self.recorded):
            # Ended early (fewer needs than recorded): the recording is not this model's path.
            self.invalidations += 1
            self.recorded = list(self._history)
        self._recording = None
        self._active = False

    def upcoming(self) -> Sequence[int]:
        """The needs the recording expects after the current point (empty when not following)."""
        if not self.following:
            return ()
        assert self.recorded is not None
        return self.recorded[self._position :]


def prefetch_candidates(
    upcoming: Sequence[int],
    numel: Callable[[int], int],
    skip: Callable[[int], bool],
    *,
    prefetch_left: int,
    live_left: int,
    nothing_in_flight: bool = False,
) -> list[int]:
    """Units to gather early, in need order, while both budgets (elements) allow.

    Args:
        upcoming: the needs expected next, in order.
        numel: elements of a unit's gathered buffers.
        skip: units that need no gather (already gathered or in flight, or persistent).
        prefetch_left: elements that may still be prefetched ahead of their need.
        live_left: elements that may still be gathered without exceeding the live limit.
        nothing_in_flight: no prefetch is in flight: the next unit may then exceed `prefetch_left`
            (never `live_left`). DeepSpeed's prefetch bucket is a soft limit that always admits the next
            parameter, so its default (5e7 elements) still keeps one unit of a 10B+ model coming (a
            layer there is several times that); a hard limit would prefetch nothing, and every upload
            of an offloaded shard (offload_param) would wait for the compute before it.

    Stops at the first unit that does not fit, so prefetches never overtake each other.
    """
    out: list[int] = []
    for unit in upcoming:
        if unit in out or skip(unit):
            continue
        size = numel(unit)
        first = nothing_in_flight and not out
        if size > live_left or (size > prefetch_left and not first):
            break
        out.append(unit)
        prefetch_left -= size
        live_left -= size
    return out


def reuse_distance(upcoming: Sequence[int], unit: int, numel: Callable[[int], int]) -> int | None:
    """Elements of other units needed before `unit` is needed again; None when it is not needed again."""
    distance = 0
    counted: set[int] = set()
    for other in upcoming:
        if other == unit:
            return distance
        if other not in counted:
            counted.add(other)
            distance += numel(other)
    return None
