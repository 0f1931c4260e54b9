"""Features of this machine, checked by doing them once, tiny: pinned host memory, a fused CPU AdamW step,
a matmul in each low-precision dtype, and a two-rank gloo all_reduce.

A version table can say a feature exists; only running it says it works here.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import TYPE_CHECKING

from launcher.report.runner import Outcome, Status

if TYPE_CHECKING:
    import torch  # imported for real inside each check


def check_pinned_memory() -> Outcome:
    import torch

    if not torch.cuda.is_available():
        return Status.SKIP, "not applicable: no CUDA device (offload buffers stay in pageable memory)"
    size = 64 * 1024**2
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    if not host.is_pinned():
        return Status.WARNING, "pin_memory=True returned pageable memory: offload copies will not overlap"
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return Status.OK, f"64 MiB pinned, host-to-device {size / seconds / 1e9:.1f} GB/s"


def _adamw_steps(param: torch.Tensor, grad: torch.Tensor, fused: bool, steps: int = 1) -> float:
    """AdamW steps in place through torch's functional form; returns the last step's wall time in seconds.

    The functional form runs the kernel of ``torch.optim.AdamW(fused=True)`` (``torch._fused_adamw_``), which
    is also what the runtime's CPU offload optimizer calls. Constructing a ``torch.optim`` optimizer would
    import torch._dynamo, over a second, more than the rest of the report.
    """
    import torch
    from torch.optim.adamw import adamw

    exp_avg, exp_avg_sq, step = torch.zeros_like(param), torch.zeros_like(param), torch.tensor(0.0)
    seconds = 0.0
    for _ in range(steps):
        begin = time.perf_counter()
        adamw(
            [param], [grad], [exp_avg], [exp_avg_sq], [], [step], foreach=False, fused=fused, amsgrad=False,
            beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=1e-2, eps=1e-8, maximize=False,
        )  # fmt: skip
        seconds = time.perf_counter() - begin
    return seconds


def check_cpu_adamw_fused() -> Outcome:
    import torch

    start = torch.linspace(-1.0, 1.0, 1024)
    grad = torch.linspace(0.5, -0.5, 1024)
    fused, reference = start.clone(), start.clone()
    try:
        _adamw_steps(fused, grad, fused=True, steps=2)
    except RuntimeError as error:
        reason = str(error).splitlines()[0]
        return (
            Status.WARNING,
            f"not available ({reason}): configs that offload the optimizer to CPU cannot run",
        )
    _adamw_steps(reference, grad, fused=False, steps=2)
    gap = (fused - reference).abs().max().item()
    if not gap <= 1e-6:
        return Status.FAIL, f"fused CPU AdamW disagrees with the reference implementation by {gap:.2e}"
    # A warm step on 1M parameters: memory traffic bounds CPU-offload step time (28 B/param: read p, g, m,
    # v, write p, m, v), so report it as bandwidth, as scripts/bench/cpu_adam.py does.
    params = 1 << 20
    big = torch.zeros(params)
    seconds = _adamw_steps(big, torch.ones_like(big), fused=True, steps=2)
    rate = f"1M params in {seconds * 1e3:.1f} ms ({params * 28 / seconds / 1e9:.1f} GB/s)"
    return Status.OK, f"torch's fused AdamW steps on CPU and matches the reference; {rate}"


def _matmul_check(dtype_name: str, tolerance: float) -> Outcome:
    import torch

    dtype = getattr(torch, dtype_name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.linspace(-1.0, 1.0, 64 * 64, device=device).reshape(64, 64)
    b = torch.cos(a)
    reference = a @ b
    try:
        product = (a.to(dtype) @ b.to(dtype)).float()
    except RuntimeError as error:
        return Status.WARNING, f"matmul not supported on {device}: {str(error).splitlines()[0]}"
    relative = ((product - reference).abs().max() / reference.abs().max()).item()
    if not relative <= tolerance:
        return Status.FAIL, f"matmul on {device} is wrong: relative error {relative:.1e} > {tolerance:g}"
    detail = f"matmul on {device} works (relative error {relative:.1e})"
    if device == "cuda" and dtype_name == "bfloat16" and torch.cuda.get_device_capability() < (8, 0):
        return Status.WARNING, f"{detail}, but emulated before sm_80: slow, prefer fp16"
    return Status.OK, detail


def check_fp16() -> Outcome:
    return _matmul_check("float16", 1e-2)


def check_bf16() -> Outcome:
    return _matmul_check("bfloat16", 5e-2)


def check_gloo_smoke() -> Outcome:
    """A real two-rank gloo all_reduce over a TCP store on loopback, ranks on two threads of this process.

    Built from ProcessGroupGloo directly so that the report never touches the default process group.
    """
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=5)
    begin = time.perf_counter()
    server = dist.TCPStore(
        "127.0.0.1", 0, world_size=2, is_master=True, timeout=timeout, wait_for_workers=False
    )
    client = dist.TCPStore("127.0.0.1", server.port, world_size=2, is_master=False, timeout=timeout)
    sums: list[float | None] = [None, None]
    errors: list[BaseException] = []

    def rank(index: int, store: dist.Store) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("ds_report", store), index, 2, timeout)
            value = torch.tensor([float(index + 1)])
            # torch's stubs leave the backend's collectives off `Backend`; gloo's has them at run time
            group.allreduce([value]).wait()  # type: ignore[attr-defined]
            sums[index] = value.item()
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=rank, args=(i, s), daemon=True) for i, s in enumerate((server, client))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout.total_seconds() + 1)
    if errors:
        raise errors[0]
    if None in sums:
        return Status.FAIL, f"2-rank all_reduce did not finish in {timeout.total_seconds() + 1:g} s"
    if sums != [3.0, 3.0]:
        return Status.FAIL, f"2-rank all_reduce(1 + 2) gave {sums}, expected 3 on both ranks"
    return Status.OK, f"2-rank all_reduce over TCP store on loopback in {time.perf_counter() - begin:.2f} s"
