"""What every benchmark in scripts/bench shares: the provenance stamped on each result line, the run's
environment record, result file names, the closing table, the isolation and timing of measurements, and
the devices' bf16 peaks that model FLOPs utilisation (MFU) is measured against, and a small real
corpus for loss curves (`stdlib_corpus`: the Python standard library's sources).

Provenance. `emit` adds `"provenance": {...}` to every JSON line: the commit and whether the tree
differed from it (`dirty`), the UTC date, the machine (host name, CPU, cores, memory, GPU name and
count), the torch version, and the command line (with the variables that change what a bench measures).
It is computed once per process. The commit comes from `DSLAUNCH_BENCH_COMMIT` where it is set (to what
`git describe --always --dirty --abbrev=40` prints where the tree came from; a `-dirty` suffix sets the
flag): the GPU machine runs on a copy of the working tree whose own `.git`, when it has one, may be
stale. Otherwise it comes from git where the tree has a `.git` (a checkout or a worktree); without either
the commit is "unknown" and `dirty` null. `dirty` leaves scripts/bench/results/ out, so a run that
appends there does not mark the next one.

Result files are named `results/<yyyymmdd>_<hw>_<theme>.jsonl` (`result_path`): hw is the GPU's short
name ("h200", "h200x8" for eight) or "cpu" without one. A bare `--out` picks that name.

The module imports nothing from the project and nothing heavy when imported (torch only inside the
helpers that take a torch device), so the launch benches, which never import torch, use it too, and a
copy of this one file still works: `python common.py` prints the provenance.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMMIT_ENV = "DSLAUNCH_BENCH_COMMIT"
RESULTS = Path(__file__).resolve().parent / "results"
AUTO: Any = object()
"""`--out` given without a file (`out_file` turns it into the file `result_path` names)."""
# What else decides what a bench measures, shown in its command line: our overrides and device choice
COMMAND_ENV = re.compile(r"^(DSLAUNCH_\w+|DS_ACCELERATOR|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS)$")


# -- provenance -----------------------------------------------------------------------------------------
def repo_root(start: Path | None = None) -> Path | None:
    """The nearest directory at or above `start` (this file's) with a `.git`, a folder or a worktree's
    file; None in a copy of the tree without one."""
    here = (start or Path(__file__)).resolve()
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return folder
    return None


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=20
    ).stdout.strip()


def git_commit(root: Path) -> tuple[str, bool] | None:
    """(HEAD, whether tracked files other than the results differ from it), or None where git cannot
    say (no git binary, not a repository, a timeout)."""
    try:
        head = _git(root, "rev-parse", "HEAD")
        results = ":(exclude)scripts/bench/results"
        changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", results)
    except (OSError, subprocess.SubprocessError):
        return None
    return head, bool(changed)


def commit_from_env(environ: Mapping[str, str]) -> tuple[str, bool] | None:
    """The commit `DSLAUNCH_BENCH_COMMIT` names (`git describe --dirty` style), or None where unset."""
    text = environ.get(COMMIT_ENV, "").strip()
    if not text:
        return None
    commit = text.removesuffix("-dirty")
    return commit, commit != text


def commit_info(environ: Mapping[str, str] | None = None, start: Path | None = None) -> dict[str, Any]:
    """{"commit", "dirty", "commit_from"}: from the variable where it is set (it names the tree a copy was
    made from: the GPU machine's copy carries a .git of its own that may lag behind), else from git."""
    environ = os.environ if environ is None else environ
    found, source = commit_from_env(environ), COMMIT_ENV
    if found is None:
        root = repo_root(start)
        found, source = (None if root is None else git_commit(root)), "git"
    if found is None:
        return {"commit": "unknown", "dirty": None, "commit_from": None}
    return {"commit": found[0], "dirty": found[1], "commit_from": source}


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 1)
    return None


def gpus() -> list[str]:
    """The machine's GPU names: NVML's view (every GPU, whatever CUDA_VISIBLE_DEVICES hides), else torch's
    where the caller imported it, else none."""
    with contextlib.suppress(Exception):  # no driver, no pynvml: ask torch below
        import pynvml

        pynvml.nvmlInit()
        try:
            names = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                names.append(name.decode() if isinstance(name, bytes) else name)
            return names
        finally:
            pynvml.nvmlShutdown()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return []


def machine() -> dict[str, Any]:
    names = gpus()
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": memory_gib(),
        "gpu": ", ".join(dict.fromkeys(names)) or None,
        "gpu_count": len(names),
    }


def command_line(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """How to run this again: the variables that change what is measured, then `python SCRIPT ARGS`, the
    script relative to the repository where it lies inside it."""
    argv = list(sys.argv if argv is None else argv)
    environ = os.environ if environ is None else environ
    if argv and argv[0]:
        script = Path(argv[0]).resolve()
        root = repo_root(script) or Path(__file__).resolve().parents[2]
        with contextlib.suppress(ValueError):
            argv[0] = str(script.relative_to(root))
    variables = [f"{k}={shlex.quote(v)}" for k, v in sorted(environ.items()) if COMMAND_ENV.match(k)]
    variables = [v for v in variables if not v.startswith(f"{COMMIT_ENV}=")]
    return " ".join([*variables, "python", shlex.join(argv)])


def torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def provenance() -> dict[str, Any]:
    """Where and from what this process's numbers come (module docstring); computed once."""
    return {
        **commit_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "torch": torch_version(),
        "python": platform.python_version(),
        "command": command_line(),
    }


# -- result lines and files -----------------------------------------------------------------------------
def hardware_label(info: Mapping[str, Any] | None = None) -> str:
    """The machine's short name in result files: "h200" for one NVIDIA H200, "h200x8" for eight, "cpu"
    without a GPU."""
    info = provenance()["machine"] if info is None else info
    if not info.get("gpu"):
        return "cpu"
    words = [w for w in re.split(r"[\s-]+", info["gpu"].split(",")[0].lower()) if w]
    words = [w for w in words if w not in ("nvidia", "tesla", "geforce", "rtx")] or ["gpu"]
    short = next((w for w in words if re.fullmatch(r"[a-z]+\d+\w*", w)), words[0])
    return short + (f"x{info['gpu_count']}" if info.get("gpu_count", 1) > 1 else "")


def result_path(theme: str, hardware: str | None = None, day: datetime.date | None = None) -> Path:
    """results/<yyyymmdd>_<hw>_<theme>.jsonl, today's date (UTC) and this machine unless given."""
    day = day or datetime.datetime.now(datetime.timezone.utc).date()
    return RESULTS / f"{day:%Y%m%d}_{hardware or hardware_label()}_{theme}.jsonl"


def add_out_argument(parser: Any, theme: str) -> None:
    """`--out FILE`: append the JSON lines to FILE as well; a bare `--out`: to `result_path(theme)` (the
    parsed value is AUTO until `out_file` names it)."""
    parser.add_argument(
        "--out",
        nargs="?",
        const=AUTO,
        type=Path,
        help=f"also append the JSON lines to this file (a bare --out: scripts/bench/results/"
        f"<yyyymmdd>_<hw>_{theme}.jsonl)",
    )


def out_file(value: Path | None, theme: str) -> Path | None:
    """The file a parsed `--out` names: `result_path(theme)` for a bare `--out`."""
    return result_path(theme) if value is AUTO else value


def stamped(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with this process's provenance last; a line relayed from another bench process keeps its
    own."""
    return {**record, "provenance": record.get("provenance") or provenance()}


def emit(record: Mapping[str, Any], out: Path | None = None) -> None:
    """One JSON line with the provenance on stdout, and appended to `out` where given."""
    line = json.dumps(stamped(record))
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(line + "\n")


def environment(device: str | None = None, *, deepspeed: bool = False) -> dict[str, Any]:
    """What a run's first line adds to the provenance: the device it ran on, torch's threads, the host
    memory available now, and DeepSpeed's version where asked (importing it takes seconds)."""
    env: dict[str, Any] = {"device": device, "cpu_threads": None}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["cpu_threads"] = torch.get_num_threads()
        if device is not None and device.startswith("cuda") and torch.cuda.is_available():
            env["device_name"] = torch.cuda.get_device_name(torch.device(device))
            env["cuda"] = torch.version.cuda
    with contextlib.suppress(Exception):  # psutil or the project missing: the figure is optional
        from runtime.memory import host_available_bytes

        env["host_available_gib"] = round(host_available_bytes() / 2**30, 1)  # a container's limit too
    if deepspeed:
        try:
            env["deepspeed"] = real_deepspeed().__version__
        except Exception:  # absent, broken or ours: the deepspeed runs will say why
            env["deepspeed"] = None
    return env


def real_deepspeed() -> Any:
    """The `deepspeed` module, if it is DeepSpeed: ImportError where it is absent, or where the package that
    answers `import deepspeed` is dslaunch's compatibility package (compat/), whose rows would measure our
    own engine under DeepSpeed's name."""
    import deepspeed

    if hasattr(deepspeed, "dslaunch_version"):
        where = Path(deepspeed.__file__).parent
        raise ImportError(f"the deepspeed importable here is dslaunch's compatibility package ({where})")
    return deepspeed


@dataclass(frozen=True)
class Column:
    """One column of `print_table`: its header, the row's value (a key or a function of the row), and
    how to format it (a format spec; an empty cell where the value is missing)."""

    header: str
    value: str | Callable[[Mapping[str, Any]], Any]
    spec: str = ""
    width: int = 10

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.value) if isinstance(self.value, str) else self.value(row)
        return "" if value is None else format(value, self.spec)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], file: Any = None) -> None:
    """A readable table (stderr unless `file`): text columns left, numbers right; a row's error or skip
    reason follows its cells."""
    file = sys.stderr if file is None else file

    def line(cells: Sequence[str], left: Sequence[bool]) -> str:
        return " ".join(
            c.ljust(col.width) if is_left else c.rjust(col.width)
            for c, col, is_left in zip(cells, columns, left, strict=True)
        )

    left = [not col.spec for col in columns]
    print("\n" + line([c.header for c in columns], left), file=file)
    for row in rows:
        note = row.get("error") or row.get("skipped") or ""
        print((line([c.cell(row) for c in columns], left) + "  " + str(note)[:80]).rstrip(), file=file)


# -- isolation ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finished:
    """A measurement's process once it ended: its exit code (None: stopped at the timeout), its output."""

    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def stop_session(proc: subprocess.Popen, grace: float = 10.0) -> tuple[str, str]:
    """SIGTERM to the process's whole session, SIGKILL after `grace`; returns what it wrote."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            out, err = proc.communicate(timeout=grace)
            return out or "", err or ""
        except subprocess.TimeoutExpired:
            continue
    return "", ""


def run_isolated(
    command: Sequence[str],
    timeout: float,
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    merge_stderr: bool = False,
) -> Finished:
    """Run one measurement in a fresh process in its own session, so that an out-of-memory error or a
    crashed library cannot spoil the next one, and a timeout stops every process it started."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        out, err = stop_session(proc)
        code = None
    except BaseException:  # ^C: its own session does not get the terminal's signal, so stop it here
        stop_session(proc, grace=2.0)
        raise
    return Finished(code, out or "", err or "", time.perf_counter() - start)


def free_port() -> int:
    """A TCP port free now, from below the kernel's ephemeral range (launcher.machine.find_free_port: port
    0's answer can be taken by another process's outgoing connection before the launcher binds it)."""
    from launcher.machine import find_free_port

    return find_free_port()


# -- model FLOPs utilisation ----------------------------------------------------------------------------
# Dense (not 2:4-sparse) bf16 tensor-core peaks from the vendor's datasheets, by a piece of the name torch
# reports for the device; the first piece found wins, so the more specific names come first.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


def peak_bf16_flops(device_name: str | None) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None for a device the table does not know (a CPU)."""
    if not device_name:
        return None
    return next((peak for piece, peak in PEAK_BF16_FLOPS if piece.lower() in device_name.lower()), None)


def mfu(flops_per_s: float, device_name: str | None) -> float | None:
    """Model FLOPs utilisation: the model's FLOPs a second over the device's bf16 peak (None: unknown)."""
    peak = peak_bf16_flops(device_name)
    return None if peak is None else round(flops_per_s / peak, 4)


# -- timing on a torch device ---------------------------------------------------------------------------
def synchronize(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], Any], device: Any, warmup: int, steps: int) -> tuple[float, list[float]]:
    """(median, every time) of `steps` calls after `warmup`, each between two synchronizations: every
    copy stream drained at each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def steady_time(fn: Callable[[], Any], device: Any, steps: int) -> float:
    """Seconds per call of `steps` calls back to back, a synchronization before and after: a training
    loop's steady state, where copies still running after one step overlap the next one's forward."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def init_single_process_group(device: Any) -> None:
    """World size 1: the variables a launcher would set, and a FileStore-backed default group (NCCL on a
    GPU, gloo on the CPU)."""
    import tempfile

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": str(device.index or 0),  # cuda:N: the engine's device_for(LOCAL_RANK) is that GPU
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        # torch.cuda.set_device wants an index (torch 2.11 refuses a bare "cuda"): that is the current GPU
        torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device.index)
    fd, store_path = tempfile.mkstemp(prefix="bench_store_")
    os.close(fd)
    store = dist.FileStore(store_path, 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)


if __name__ == "__main__":
    print(json.dumps(provenance(), indent=1))


def stdlib_corpus(limit: int) -> bytes:
    """Up to `limit` bytes of the standard library's Python sources (every ``*.py`` under sysconfig's stdlib
    path, tests, site-packages and idlelib left out), in path order: a real corpus on any machine with
    Python, for loss curves with bytewise tokens (fp8.py, states_loss.py)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"test", "tests", "site-packages", "idlelib"}:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]
