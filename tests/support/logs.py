"""Log lines captured inside a rank that tests/support/dist.py spawned, where pytest's caplog does not
reach."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def captured_log(name: str, level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages logger `name` (and its children) emits at `level` and above inside the block; the list
    stays readable after it."""
    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
