"""The checks of this machine, and their order: can a dslaunch job start here, on which devices, how well.

This module holds the software, system and tools checks and the list of every local check
(:func:`local_checks`); the GPU checks live in ``gpu`` and the try-it-once feature checks in ``features``.
Each check is a small function answering ``(Status, detail)`` that imports torch, psutil or paramiko
lazily, so that the report still comes out, with the reason, when one of them is missing or broken. The
order matters: later checks reuse what earlier ones imported, and ``needs`` skips a check whose
prerequisite already failed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import sys
from pathlib import Path

from launcher.report import features, gpu
from launcher.report.gpu import known_gpu_count
from launcher.report.runner import Check, Outcome, Status

GIB = 1024**3
MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)  # pyproject's floor
SHM_WARN_BYTES = 1 * GIB
MEMORY_WARN_BYTES = 2 * GIB
_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_DISTRIBUTED", "TORCH_NCCL", "MASTER_", "OMP_NUM_THREADS")
_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "LD_LIBRARY_PATH", "PYTORCH_CUDA_ALLOC_CONF")


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


# --- software -----------------------------------------------------------------------------------------


def check_python() -> Outcome:
    version = platform.python_version()
    detail = f"{version} ({platform.python_implementation()}) at {sys.executable}"
    if sys.version_info[:2] < MIN_PYTHON:
        return Status.FAIL, f"{detail}: dslaunch needs Python >= {'.'.join(map(str, MIN_PYTHON))}"
    return Status.OK, detail


def check_torch() -> Outcome:
    import torch

    detail = f"{torch.__version__} at {os.path.dirname(torch.__file__)}"
    if _version_tuple(torch.__version__) < MIN_TORCH:
        return Status.FAIL, f"{detail}: dslaunch needs torch >= {'.'.join(map(str, MIN_TORCH))}"
    return Status.OK, detail


def check_dslaunch() -> Outcome:
    import launcher

    root = Path(launcher.__file__).resolve().parent.parent
    detail = f"{launcher.__version__} at {root}"
    runtime = importlib.util.find_spec("runtime")
    if runtime is None or runtime.origin is None:
        return Status.FAIL, f"{detail}; package 'runtime' not importable: `import runtime` in workers fails"
    runtime_root = Path(runtime.origin).resolve().parent.parent
    if runtime_root != root:
        return Status.WARNING, f"{detail}, but 'runtime' comes from {runtime_root}: two installs mixed?"
    try:
        installed = importlib.metadata.version("dslaunch")
    except importlib.metadata.PackageNotFoundError:
        return Status.WARNING, f"{detail}, not pip-installed (PYTHONPATH checkout?): no dslaunch command"
    if installed != launcher.__version__:
        return Status.WARNING, f"{detail}, but pip metadata says {installed}: reinstall (pip install -e .)"
    return Status.OK, detail


def check_deepspeed() -> Outcome:
    """Which `import deepspeed` Hugging Face Trainer and Accelerate would get (they look it up by name)."""
    from launcher.deepspeed_report import find_deepspeed

    found = find_deepspeed()
    if not found.importable:
        return Status.OK, "not installed (optional: pip install ./compat runs Trainer and Accelerate on us)"
    if not found.is_dslaunch:
        return Status.OK, f"{found.describe()}: `import deepspeed` runs DeepSpeed itself, not dslaunch"
    return Status.OK, found.describe()


def check_paramiko() -> Outcome:
    try:
        import paramiko
    except ImportError as error:
        return Status.WARNING, f"not importable ({error}): multi-node launch over SSH is unavailable"
    return Status.OK, f"{paramiko.__version__} (multi-node launch over SSH)"


# --- system -------------------------------------------------------------------------------------------


def _cgroup_cpus() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def check_cpu() -> Outcome:
    import psutil

    logical = psutil.cpu_count(logical=True) or 0
    physical = psutil.cpu_count(logical=False)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    detail = f"{usable} usable of {logical} logical cores ({physical or '?'} physical)"
    quota = _cgroup_cpus()
    if quota is not None:
        detail += f", cgroup quota {quota:g} CPUs"
    gpus = known_gpu_count()
    if gpus and min(usable, quota or usable) < gpus:
        return Status.WARNING, f"{detail}: fewer cores than the {gpus} GPUs, one worker per GPU will contend"
    return Status.OK, detail


def check_memory() -> Outcome:
    import psutil

    memory = psutil.virtual_memory()
    detail = f"{_gib(memory.total)} total, {_gib(memory.available)} available"
    if memory.available < MEMORY_WARN_BYTES:
        return Status.WARNING, f"{detail}: CPU offload and DataLoader workers need host memory"
    return Status.OK, detail


def check_shm() -> Outcome:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError as error:
        return Status.WARNING, f"/dev/shm unusable ({error.strerror}): DataLoader workers and NCCL need it"
    total = stats.f_blocks * stats.f_frsize
    free = stats.f_bavail * stats.f_frsize
    detail = f"{_gib(total)} ({_gib(free)} free)"
    if total < SHM_WARN_BYTES:
        return Status.WARNING, (
            f"{detail}: small; DataLoader workers pass batches and NCCL keeps intra-node buffers here "
            "(docker: --shm-size=8g or --ipc=host)"
        )
    return Status.OK, detail


def check_hostname() -> Outcome:
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as error:
        return (
            Status.WARNING,
            f"{name} does not resolve ({error}): gloo falls back to loopback, multi-node fails",
        )
    if address.startswith("127."):
        return Status.OK, f"{name} -> {address} (loopback: fine on one node; set GLOO_SOCKET_IFNAME for many)"
    return Status.OK, f"{name} -> {address}"


def check_env() -> Outcome:
    names = sorted(name for name in os.environ if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES)
    if not names:
        return Status.OK, "no NCCL_*, GLOO_*, MASTER_*, CUDA_VISIBLE_DEVICES or OMP_NUM_THREADS set"
    shown = []
    for name in names:
        value = os.environ[name]
        shown.append(f"{name}={value if len(value) <= 40 else value[:37] + '...'}")
    return Status.OK, " ".join(shown)


# --- tools on PATH (informational: only the chosen --launcher needs one) ----------------------------

_TOOLS = {
    "ssh": "ssh (the built-in launcher uses paramiko, not this binary)",
    "pdsh": "--launcher pdsh",
    "mpirun": "--launcher openmpi",
    "srun": "--launcher slurm",
}


def _tool_check(tool: str) -> Check:
    def check() -> Outcome:
        path = shutil.which(tool)
        if path is None:
            return Status.OK, f"not on PATH (only needed for {_TOOLS[tool]})"
        return Status.OK, path

    return Check(tool, "tools", check)


def local_checks() -> list[Check]:
    """Every check of this machine, in report order."""
    return [
        Check("python", "software", check_python),
        # A cold import from a network filesystem can take far longer than the default timeout.
        Check("torch", "software", check_torch, timeout_s=120.0),
        Check("dslaunch", "software", check_dslaunch),
        Check("paramiko", "software", check_paramiko),
        Check("deepspeed", "software", check_deepspeed),
        Check("driver", "gpu", gpu.check_driver),
        Check("gpus", "gpu", gpu.check_gpus, needs=("driver",)),
        Check("cuda", "gpu", gpu.check_cuda, needs=("torch",), timeout_s=30.0),
        Check("backends", "gpu", gpu.check_backends, needs=("torch",)),
        Check("cpu", "system", check_cpu),
        Check("memory", "system", check_memory),
        Check("shm", "system", check_shm),
        Check("hostname", "system", check_hostname),
        Check("env", "system", check_env),
        Check("pinned_memory", "features", features.check_pinned_memory, needs=("cuda",)),
        Check("cpu_adamw_fused", "features", features.check_cpu_adamw_fused, needs=("torch",)),
        Check("fp16", "features", features.check_fp16, needs=("cuda",)),
        Check("bf16", "features", features.check_bf16, needs=("cuda",)),
        Check("gloo", "features", features.check_gloo_smoke, needs=("backends",)),
        *(_tool_check(tool) for tool in _TOOLS),
    ]
