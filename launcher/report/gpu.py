"""The GPU checks: what the NVIDIA driver reports (through NVML, without initialising CUDA), whether torch can
use those GPUs, and which distributed backends torch has.

A machine without the driver is not an error: it runs jobs on CPU with gloo. A machine whose driver lists
GPUs that torch cannot use is, because a job there would silently run on CPU or not at all.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from launcher.report.runner import NamedOutcome, Outcome, Status

GIB = 1024**3
# A GPU with more memory than this already in use is probably running someone else's job.
GPU_BUSY_FRACTION = 0.25
NO_GPU = "no GPU: workers will use CPU + gloo"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


# --- NVML: what the driver says, without initialising CUDA ----------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class DriverInfo:
    driver_version: str
    cuda_version: str  # the newest CUDA runtime this driver supports, e.g. "12.4"
    gpus: tuple[GpuInfo, ...]


class NoDriver(Exception):
    """libnvidia-ml is not installed: a machine without NVIDIA GPUs (not an error)."""


class BrokenDriver(Exception):
    """The driver is installed but NVML calls fail (e.g. driver/library mismatch after an upgrade)."""


class NvmlUnavailable(Exception):
    """nvidia-ml-py does not import here, so nobody can ask the driver (GPUs may still be there)."""


_driver_cache: dict[str, DriverInfo | NoDriver | NvmlUnavailable] = {}


def probe_driver() -> DriverInfo:
    """Ask NVML about the driver and GPUs once.

    Raises NoDriver, NvmlUnavailable, or BrokenDriver (not cached: a later call asks again).
    """
    if "answer" not in _driver_cache:
        _driver_cache["answer"] = _query_nvml()
    answer = _driver_cache["answer"]
    if isinstance(answer, (NoDriver, NvmlUnavailable)):
        raise answer
    return answer


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _query_nvml() -> DriverInfo | NoDriver | NvmlUnavailable:
    try:
        import pynvml
    except ImportError as error:
        return NvmlUnavailable(f"nvidia-ml-py does not import ({error}): cannot ask the driver about GPUs")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return NoDriver("no NVIDIA driver (NVML library not found)")
    except pynvml.NVMLError as error:
        raise BrokenDriver(f"{type(error).__name__}: {error}") from error
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    total_bytes=int(memory.total),
                    used_bytes=int(memory.used),
                    capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                )
            )
        return DriverInfo(
            driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            gpus=tuple(gpus),
        )
    except pynvml.NVMLError as error:
        raise BrokenDriver(f"{type(error).__name__}: {error}") from error
    finally:
        pynvml.nvmlShutdown()


def known_gpu_count() -> int | None:
    """GPUs the driver reported, if the driver check already ran and answered; never blocks."""
    answer = _driver_cache.get("answer")
    if isinstance(answer, NoDriver):
        return 0
    return len(answer.gpus) if isinstance(answer, DriverInfo) else None


# --- GPU ----------------------------------------------------------------------------------------------


def check_driver() -> Outcome:
    try:
        info = probe_driver()
    except NoDriver as reason:
        return Status.OK, str(reason)
    except NvmlUnavailable as reason:
        return Status.WARNING, str(reason)
    except BrokenDriver as error:
        return Status.FAIL, (
            f"NVIDIA driver installed but not working ({error}): "
            "after a driver upgrade, reboot or reload the nvidia kernel module"
        )
    gpus = len(info.gpus)
    return Status.OK, f"{info.driver_version}, supports CUDA <= {info.cuda_version}, {gpus} GPU(s)"


def check_gpus() -> list[NamedOutcome]:
    try:
        info = probe_driver()
    except NoDriver:
        return [("gpus", Status.OK, NO_GPU)]
    except NvmlUnavailable:
        return [
            ("gpus", Status.SKIP, "cannot list GPUs without nvidia-ml-py; the cuda row says what torch sees")
        ]
    if not info.gpus:
        return [("gpus", Status.WARNING, f"driver loaded but it lists no GPU; {NO_GPU}")]
    outcomes: list[NamedOutcome] = []
    for gpu in info.gpus:
        major, minor = gpu.capability
        bf16 = "yes" if major >= 8 else "no (needs sm_80+)"
        memory = f"{_gib(gpu.total_bytes)} ({_gib(gpu.used_bytes)} used)"
        detail = f"{gpu.name}, {memory}, sm_{major}{minor}, bf16 {bf16}"
        status = Status.OK
        if gpu.used_bytes > GPU_BUSY_FRACTION * gpu.total_bytes:
            status, detail = Status.WARNING, f"{detail}: memory already in use, another job running?"
        outcomes.append((f"gpu{gpu.index}", status, detail))
    return outcomes


def check_cuda() -> Outcome:
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    built_for = torch.version.cuda
    driver_gpus = known_gpu_count()
    if available:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        note = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        return Status.OK, f"CUDA {built_for} runtime, {torch.cuda.device_count()} device(s) visible{note}"
    why = "; ".join(str(w.message).splitlines()[0] for w in caught) or "torch.cuda.is_available() is False"
    if driver_gpus and os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return Status.WARNING, f"CUDA_VISIBLE_DEVICES hides all {driver_gpus} GPU(s): {NO_GPU}"
    if driver_gpus:
        if built_for is None:
            return Status.FAIL, (
                f"torch {torch.__version__} is a CPU-only build but the driver lists {driver_gpus} GPU(s): "
                "install a CUDA build of torch"
            )
        return Status.FAIL, f"torch built for CUDA {built_for} cannot use the {driver_gpus} GPU(s): {why}"
    build = "CPU-only torch build" if built_for is None else f"torch built for CUDA {built_for}"
    return Status.OK, f"{NO_GPU} ({build})"


def check_backends() -> Outcome:
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return Status.FAIL, "torch was built without torch.distributed"
    have = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    names = []
    for name, present in have.items():
        if present and name == "nccl":
            version = torch.cuda.nccl.version()  # a tuple (2, 21, 5); an int like 2708 in old builds
            names.append(
                "nccl " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version))
            )
        elif present:
            names.append(name)
    missing = [name for name, present in have.items() if not present]
    detail = ", ".join(names) + (f" (not built: {', '.join(missing)})" if missing else "")
    if not have["gloo"]:
        return Status.FAIL, f"{detail}: gloo is missing, and CPU jobs and CPU-side collectives need it"
    if torch.cuda.is_available() and not have["nccl"]:
        return Status.FAIL, f"{detail}: CUDA is available but NCCL is not, so GPU jobs cannot communicate"
    return Status.OK, detail
