"""A progress line with an ETA for training scripts, in a few lines instead of a tqdm dependency.

On a terminal the line is redrawn in place (at most every `min_interval` seconds, and at the end), and log
lines written through `write()` appear above it. Elsewhere (a pipe, a file, a launcher collecting output)
nothing is drawn: `eta()` gives the text to append to the script's own periodic log lines, so logs stay
plain, one line per report.

The ETA uses the mean time per step after the first one (the first step includes warm-up: allocator,
kernel selection, the first collectives), so it settles after a couple of steps.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75.4 -> "1:15"``, ``3725 -> "1:02:05"``."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    """``step 40/100 [#########...........] 40% | loss 2.3100 | 3.2 steps/s | ETA 0:19``."""

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        min_interval: float = 0.2,
        width: int = 24,
        clock: object = time.perf_counter,
    ) -> None:
        if total < 1:
            raise ValueError(f"total must be positive, got {total}")
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.enabled = enabled
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = enabled and callable(isatty) and bool(isatty())
        self.min_interval = min_interval
        self.width = width
        self._clock = clock
        self._done = 0
        self._first_at: float | None = None  # when the first step of this run finished
        self._first_done = 0  # and its number (a resumed run starts past 1)
        self._now = 0.0
        self._drawn_at = float("-inf")
        self._text = ""

    def update(self, done: int, text: str = "") -> None:
        """`done` steps are finished; `text` (e.g. the last loss) is shown on the line."""
        now = self._clock()  # type: ignore[operator]
        if self._first_at is None:
            self._first_at, self._first_done = now, done
        self._done, self._now, self._text = done, now, text
        if self.interactive and (now - self._drawn_at >= self.min_interval or done >= self.total):
            self._draw()
            self._drawn_at = now

    def rate(self) -> float | None:
        """Steps per second after the first step of this run; None until two steps are done."""
        if self._first_at is None or self._done <= self._first_done or self._now <= self._first_at:
            return None
        return (self._done - self._first_done) / (self._now - self._first_at)

    def eta_seconds(self) -> float | None:
        rate = self.rate()
        return None if rate is None else (self.total - self._done) / rate

    def eta(self) -> str:
        """``ETA 1:15`` (``ETA ?`` until the rate is known, ``done`` at the end)."""
        if self._done >= self.total:
            return "done"
        seconds = self.eta_seconds()
        return "ETA ?" if seconds is None else f"ETA {format_duration(seconds)}"

    def line(self) -> str:
        filled = int(self.width * self._done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        parts = [f"step {self._done}/{self.total} [{bar}] {100 * self._done // self.total}%"]
        if self._text:
            parts.append(self._text)
        rate = self.rate()
        if rate is not None:
            parts.append(f"{rate:.2f} steps/s")
        parts.append(self.eta())
        return " | ".join(parts)

    def _draw(self) -> None:
        self.stream.write("\r\033[K" + self.line())
        self.stream.flush()

    def write(self, message: str) -> None:
        """Print a log line (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.interactive:
            self.stream.write("\r\033[K" + message + "\n")
            self._draw()
        else:
            self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (terminal only)."""
        if self.interactive:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.interactive = False
