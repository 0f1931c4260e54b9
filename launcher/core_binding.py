"""Pinning each worker to its share of the CPU cores: DeepSpeed's ``--bind_cores_to_rank`` and
``--bind_core_list``.

The cores (``--bind_core_list``, e.g. ``0-7,16-23``, or every core this launcher may use) are split into
equal contiguous blocks, one per local rank; rank r runs on block r only (``os.sched_setaffinity``, which
the worker's children and any ``exec`` inherit) with ``OMP_NUM_THREADS`` set to the block's size, so the
ranks' thread pools do not fight over cores.

The launcher starts this file as the worker's program (`wrap_command`); run as ``python core_binding.py
CORES MODE TARGET ARGS...`` it binds itself using LOCAL_RANK and LOCAL_WORLD_SIZE from the environment,
then becomes the user's program: runs the script (MODE ``script``) or module (``module``) in this
interpreter, or ``exec``s the command (``exec``, for --no_python). It imports no torch.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["cores_for_rank", "parse_core_list", "wrap_command"]

ALL_CORES = "all"


def parse_core_list(text: str) -> list[int]:
    """ "0,2-4,7" -> [0, 2, 3, 4, 7]; ValueError names the bad part."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(
                f"--bind_core_list {text!r}: {part!r} is not a core number or a range a-b"
            ) from None
        if first < 0 or last < first:
            raise ValueError(
                f"--bind_core_list {text!r}: {part!r} is not an increasing range of core numbers"
            )
        cores.extend(range(first, last + 1))
    if not cores:
        raise ValueError(f"--bind_core_list {text!r}: no cores listed")
    if len(set(cores)) != len(cores):
        raise ValueError(f"--bind_core_list {text!r}: a core is listed twice")
    return cores


def cores_for_rank(cores: Sequence[int], local_rank: int, local_size: int) -> list[int]:
    """Local rank `local_rank`'s contiguous block of `cores`, split evenly over `local_size` ranks (the
    remainder, if any, stays unused, as in DeepSpeed)."""
    per_rank = len(cores) // local_size
    if per_rank == 0:
        raise ValueError(
            f"cannot bind {local_size} ranks to {len(cores)} core(s): each rank needs at least one; "
            "start fewer workers or list more cores with --bind_core_list"
        )
    return list(cores[local_rank * per_rank : (local_rank + 1) * per_rank])


def wrap_command(dslaunch_args: list[str], script_and_args: list[str], core_list: str | None) -> list[str]:
    """The user script and arguments, run through this file so each worker binds first. Removes
    --module / --no_python from `dslaunch_args` (the wrapper is a plain Python file) and passes the mode
    on instead."""
    if not script_and_args:
        return script_and_args  # the CLI reports the missing script
    if core_list is not None:
        parse_core_list(core_list)  # refuse a bad list before anything starts
    mode = "script"
    for flag, flag_mode in (("--module", "module"), ("--no_python", "exec"), ("--no-python", "exec")):
        if flag in dslaunch_args:
            dslaunch_args.remove(flag)
            mode = flag_mode
    return [os.path.abspath(__file__), core_list or ALL_CORES, mode, *script_and_args]


def _bind(core_spec: str) -> list[int]:
    available = sorted(os.sched_getaffinity(0))
    cores = available if core_spec == ALL_CORES else parse_core_list(core_spec)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = cores_for_rank(cores, local_rank, local_size)
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    return mine


def _run(argv: list[str]) -> None:
    local_rank_arg = []
    if argv and argv[0].startswith("--local_rank="):  # the launcher puts it right after the program
        local_rank_arg = [argv.pop(0)]  # and the user's program gets it in the same place
    if len(argv) < 3 or argv[1] not in ("script", "module", "exec"):
        raise SystemExit("usage: core_binding.py CORES script|module|exec TARGET [ARGS...]")
    core_spec, mode, target, args = argv[0], argv[1], argv[2], local_rank_arg + argv[3:]
    try:
        _bind(core_spec)
    except (ValueError, OSError) as error:
        raise SystemExit(
            f"dslaunch: error: core binding on local rank {os.environ.get('LOCAL_RANK')}: {error}"
        ) from None
    if mode == "exec":
        os.execvp(target, [target, *args])
    sys.argv = [target, *args]
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` would have it
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    _run(sys.argv[1:])
