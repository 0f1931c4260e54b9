"""One spawn of 4 gloo ranks for every pipeline, topology and tensor-parallel test (spawning is the slow
part on the 2-core CI box). Each test file's worker runs in turn on the same ranks; a part that raises
is reported as that part's failure only (its traceback goes to the tests that read it), so the other
files' tests still see their results. The run happens once per pytest process, on first use.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import traceback
from typing import Any

from tests.support.dist import run_distributed

WORLD = 4


class PartFailed(AssertionError):
    pass


def _all_parts(rank: int, world_size: int, save_root: str) -> dict[str, Any]:
    from tests.runtime.parallel import test_topology
    from tests.runtime.pipe import test_pipe_engine, test_pipe_module
    from tests.runtime.tp import test_tp_autotp

    parts = {
        "topology": lambda: test_topology._grid_worker(rank, world_size),
        "module": lambda: test_pipe_module._worker(rank, world_size),
        "engine": lambda: test_pipe_engine._run_cases(rank, world_size, test_pipe_engine.CASES, save_root),
        "tp": lambda: test_tp_autotp._worker(rank, world_size),
    }
    out: dict[str, Any] = {}
    for name, run in parts.items():
        try:
            out[name] = run()
        except Exception:  # a collective may now be out of step: later parts are skipped, not hung
            out[name] = PartFailed(f"rank {rank}, part {name!r}:\n{traceback.format_exc()}")
            for later in list(parts)[list(parts).index(name) + 1 :]:
                out[later] = PartFailed(f"rank {rank}: part {later!r} skipped after {name!r} failed")
            break
    return out


@functools.cache
def _run() -> list[dict[str, Any]]:
    save_root = tempfile.mkdtemp(prefix="dslaunch-pipe-")
    atexit.register(shutil.rmtree, save_root, True)
    return run_distributed(_all_parts, WORLD, save_root, timeout=300)


def part(name: str) -> list[Any]:
    """The per-rank results of one part; raises every failed rank's failure together (the first rank's is
    often only "connection closed by peer", the consequence of another rank's real error)."""
    results = [r[name] for r in _run()]
    failures = [value for value in results if isinstance(value, PartFailed)]
    if failures:
        raise PartFailed("\n\n".join(str(failure) for failure in failures))
    return results
