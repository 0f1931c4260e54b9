"""`disable_python_gc`: Python's cyclic garbage collector off while an engine that asks for it lives.

A training step allocates many short-lived Python objects (autograd nodes, hooks' closures, tensors'
wrappers), and the cyclic collector can start a full collection in the middle of one, a pause of tens to
hundreds of milliseconds on a large model that shows up as an irregular slow step. DeepSpeed's key turns the
collector off for the engine's life; the training loop then collects where a pause does no harm (after a
checkpoint, at an epoch's end) with `engine.collect_python_gc()`.

Owns the process-wide count of engines holding the collector off: the first hold collects once and
disables it, the last release turns it back on (only if it was on before the first hold), so two engines
(TRL's policy and reference model) or an engine built and destroyed in a test leave the process as they
found it. A forked child starts with no holds.
"""

from __future__ import annotations

import gc
import logging
import os
import threading

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_holds = 0
_was_enabled = False


def hold() -> None:
    """One more engine wants the collector off: collect now and disable it at the first hold."""
    global _holds, _was_enabled
    with _lock:
        if _holds == 0:
            _was_enabled = gc.isenabled()
            if _was_enabled:
                collected = gc.collect()
                gc.disable()
                _log.info("disable_python_gc: cyclic GC off after collecting %d objects", collected)
        _holds += 1


def release() -> None:
    """An engine that held the collector off is done: the last release turns it back on if it was on."""
    global _holds
    with _lock:
        if _holds == 0:
            return
        _holds -= 1
        if _holds == 0 and _was_enabled:
            gc.enable()


def collect() -> int:
    """A full collection now (the collector stays as it is); how many unreachable objects it found."""
    return gc.collect()


def _forget_holds_in_child() -> None:
    global _holds, _was_enabled, _lock
    _lock = threading.Lock()
    if _holds and _was_enabled:
        gc.enable()  # the child's engines are its own; the parent's holds mean nothing there
    _holds, _was_enabled = 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_holds_in_child)
