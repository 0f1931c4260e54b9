"""The parts of the offload benchmark's bound that need no model (offload.py's adam, devstep and pcie
configurations), each run in its configuration's own process.

They drive runtime.offload's own pieces (HostAdam, DeviceStep, CopyEngine, HostMemory, plan_chunks, Span,
TRANSFER_CHUNK_ELEMS): every import of runtime.offload's insides in the benchmarks is in this module's
functions, or in host_threads.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scripts.bench.common import median_time
from scripts.bench.offload_work import LR, WEIGHT_DECAY, Spec, model_config

__all__ = ["work_adam", "work_devstep", "work_pcie"]


def _host_step_time(n: int, reps: int) -> float:
    """Median seconds of our host step over n parameters: bf16 gradients in, bf16 weights out, in the
    engine's chunks."""
    from runtime.config.offload import TRANSFER_CHUNK_ELEMS
    from runtime.offload.io.spans import plan_chunks
    from runtime.offload.step.host_adam import HostAdam
    from runtime.ops.adam import CPUAdam

    master = torch.nn.Parameter(torch.empty(n).normal_(0, 0.02))
    host = HostAdam(CPUAdam([master], lr=LR, weight_decay=WEIGHT_DECAY), [master])
    landing = torch.empty(n, dtype=torch.bfloat16).normal_(0, 1e-3)
    chunks = plan_chunks(n, TRANSFER_CHUNK_ELEMS)

    def ours() -> None:
        host.begin_step()
        for offset, numel in chunks:
            grad = landing.narrow(0, offset, numel)
            # the bf16 weights are written over the consumed gradient, as in the engine; the next step
            # reads them back as its gradient, which costs the same
            host.update(0, offset, grad, grad, None)

    return median_time(ours, torch.device("cpu"), 1, reps)[0]


def work_adam(spec: Spec, device: torch.device) -> dict[str, Any]:
    """Our host step on a shard of the model's size (T_adam), torch's fused step on fp32 gradients, and on
    a GPU that step with one step's fp32 copies beside it (the host floor)."""
    n, reps = model_config(spec).num_params(), max(3, spec["adam_steps"])
    t_ours = _host_step_time(n, reps)  # its state is freed on return: the reference needs the memory
    result: dict[str, Any] = {
        "params": n,
        "step_s": round(t_ours, 4),
        "gparams_per_s": round(n / t_ours / 1e9, 3),
        "gb_per_s_at_28B": round(28 * n / t_ours / 1e9, 1),
        "threads": torch.get_num_threads(),
    }
    p = torch.nn.Parameter(torch.empty(n).normal_(0, 0.02))
    p.grad = torch.empty(n).normal_(0, 1e-3)
    fused = torch.optim.AdamW([p], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    t_fused, _ = median_time(fused.step, torch.device("cpu"), 1, reps)
    result["torch_fused_fp32_grads_s"] = round(t_fused, 4)
    result["ours_over_torch_fused"] = round(t_fused / t_ours, 3)
    if device.type == "cuda":
        result["torch_fused_fp32_with_copies_s"] = round(_fused_with_copies(fused.step, n, device, reps), 4)
    return result


def _host_memory(device: torch.device) -> Any:
    from runtime.host_memory import HostMemory

    return HostMemory(device, pin=True)


def work_devstep(spec: Spec, device: torch.device) -> dict[str, Any]:
    """The device step alone: the model's fp32 master and moments streamed from pinned host memory through
    the staging slots, updated from a device gradient, and streamed back (the engine's code, no model)."""
    from runtime.offload.io.spans import Span
    from runtime.offload.step.device_step import DeviceStep
    from runtime.offload.step.host_adam import HostAdam
    from runtime.ops.adam import CPUAdam

    n = model_config(spec).num_params()
    memory = _host_memory(device)
    master = torch.nn.Parameter(memory.empty(n, torch.float32, pinned=True).normal_(0, 0.02))
    optimizer = CPUAdam([master], lr=LR, weight_decay=WEIGHT_DECAY)
    adam = HostAdam(optimizer, [master], zeros=lambda numel, dtype: memory.zeros(numel, dtype, pinned=True))
    grad = torch.empty(n, dtype=torch.bfloat16, device=device).normal_(0, 1e-3)
    working = torch.empty(n, dtype=torch.bfloat16, device=device)
    step = DeviceStep(device, torch.float32)
    span = Span(group=0, bucket=0, shard_offset=0, numel=n)

    def once() -> None:
        adam.begin_step()
        step.begin_step(adam, 1.0, memory)
        step.update_span(adam, span, master.data, grad, working, None)
        step.host_ready()  # until the host state is current: every chunk up, updated and down

    t_step, _ = median_time(once, device, 1, max(3, spec["adam_steps"]))
    result = {
        "params": n,
        "step_s": round(t_step, 4),
        "pcie_gb_per_s_each_way": round(12 * n / t_step / 1e9, 1),
        "pinned": memory.pinned_bytes > 0,
        "staging_gib": round(step.staging_bytes() / 2**30, 2),
    }
    memory.close()
    return result


class _Copies:
    """A step's worth of pinned copies in one dtype: n elements down (gradients) and n up (weights)."""

    def __init__(self, memory: Any, n: int, dtype: torch.dtype, device: torch.device) -> None:
        from runtime.offload.io.copies import CopyEngine

        self.down_host = memory.empty(n, dtype, pinned=True)
        self.up_host = memory.empty(n, dtype, pinned=True).fill_(1)
        self.down_dev = torch.ones(n, dtype=dtype, device=device)
        self.up_dev = torch.empty(n, dtype=dtype, device=device)
        self.engine = CopyEngine(device)

    def down(self) -> None:
        self.engine.to_host(self.down_host, self.down_dev)
        self.engine.downloads_done()

    def up(self) -> None:
        self.engine.fence_uploads()
        self.engine.device_wait(self.engine.to_device(self.up_dev, self.up_host))

    def start_both(self) -> None:
        """Queue both directions at once (the host does not wait); `downloads_done` ends it."""
        self.engine.fence_uploads()
        self.engine.to_host(self.down_host, self.down_dev)
        self.engine.device_wait(self.engine.to_device(self.up_dev, self.up_host))

    def both(self) -> None:
        self.start_both()
        self.engine.downloads_done()


def _fused_with_copies(step: Callable[[], Any], n: int, device: torch.device, reps: int) -> float:
    """The fused fp32 step while one step's fp32 copies (n floats down and n up, as fp32 landing moves
    them) run on the copy engines: both read and write host memory, so this is the host's real floor."""
    memory = _host_memory(device)
    copies = _Copies(memory, n, torch.float32, device)

    def shared() -> None:
        copies.start_both()
        step()
        copies.engine.downloads_done()

    try:
        seconds, _ = median_time(shared, device, 1, reps)
    finally:
        memory.close()
    return seconds


# Copies of more than this many elements are timed on this many and scaled: the link's rate is flat past a
# few hundred MB, and a 17.6B model's copies (35 GB each way in bf16, twice that in fp32, on both sides)
# filled the H100 machine's host and would not fit its GPU beside each other.
PCIE_SAMPLE_ELEMENTS = 1 << 30


def work_pcie(spec: Spec, device: torch.device) -> dict[str, Any]:
    """Pinned copies of the bytes a step moves in bf16, each way alone and both at once (T_pcie), and
    both ways in fp32 (what fp32 landing moves); a model larger than PCIE_SAMPLE_ELEMENTS is timed on that
    many elements and its times scaled to the whole."""
    n = model_config(spec).num_params()
    sample = min(n, PCIE_SAMPLE_ELEMENTS)
    scale = n / sample
    memory = _host_memory(device)
    copies = _Copies(memory, sample, torch.bfloat16, device)
    reps = 6
    t_down, _ = median_time(copies.down, device, 1, reps)
    t_up, _ = median_time(copies.up, device, 1, reps)
    t_both, _ = median_time(copies.both, device, 1, reps)
    nbytes = 2 * sample
    result = {
        "bytes_each_way": 2 * n,
        "sampled_bytes_each_way": nbytes,
        "pinned": memory.pinned_bytes > 0,
        "down_s": round(t_down * scale, 5),
        "up_s": round(t_up * scale, 5),
        "both_s": round(t_both * scale, 5),
        "down_gb_per_s": round(nbytes / t_down / 1e9, 1),
        "up_gb_per_s": round(nbytes / t_up / 1e9, 1),
        "duplex_gb_per_s": round(2 * nbytes / t_both / 1e9, 1),
    }
    del copies
    copies32 = _Copies(memory, sample, torch.float32, device)
    t_both32, _ = median_time(copies32.both, device, 1, reps)
    result["both_fp32_s"] = round(t_both32 * scale, 5)
    memory.close()
    return result
