"""Per-rank model-state memory of ZeRO stages 0/1/2 against the ZeRO paper's formulas.

Mixed-precision Adam (bf16 working weights and gradients, fp32 master weights, fp32 exp_avg/exp_avg_sq)
per parameter: stage 0 keeps 2 + 2 + 12 = 16 bytes, stage 1 keeps 4 + 12/N, stage 2 keeps 2 + 14/N
(Rajbhandari et al., SC20, §5). Each rank's `engine.memory_breakdown()` must be within 5% of those at
N = 2 and 3, and must agree with the bytes of the storages the engine really holds (working weights
through the model, gradients, master weights and optimizer state through the optimizer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support.dist import run_distributed

PAPER_BYTES_PER_PARAM = {0: lambda n: 16.0, 1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n}


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 250), nn.GELU(), nn.Linear(250, 130))


def _storage_bytes(tensors: list[torch.Tensor], exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _measure(rank: int, world_size: int) -> dict:
    import runtime

    out = {}
    for stage in (0, 1, 2):
        model = make_mlp()
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
        }
        engine, optimizer, _, _ = runtime.initialize(model=model, config=config)
        x = torch.randn(4, 256)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()  # creates the optimizer state
        breakdown = engine.memory_breakdown()

        working = _storage_bytes([p for p in model.parameters()])
        working_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        grads = [t for pieces in engine.zero.grad_pieces() for t in pieces]
        out[stage] = {
            "numel": sum(p.numel() for p in model.parameters()),
            "breakdown": breakdown,
            "actual": {
                "param_bytes": working,
                "grad_bytes": _storage_bytes(grads),
                "master_bytes": _storage_bytes(masters, exclude=working_ptrs),
                "optimizer_bytes": sum(t.numel() * t.element_size() for t in states),
            },
            "grads_alive": sum(p.grad is not None for p in model.parameters()),
        }
        engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_state_bytes_follow_the_zero_paper(world_size: int) -> None:
    results = run_distributed(_measure, world_size, timeout=120)
    for rank, per_stage in enumerate(results):
        for stage, got in per_stage.items():
            where = f"rank {rank}, stage {stage}, N={world_size}"
            breakdown = got["breakdown"]
            expected = PAPER_BYTES_PER_PARAM[stage](world_size)
            measured = breakdown.model_state_bytes / got["numel"]
            assert abs(measured - expected) <= 0.05 * expected, (
                f"{where}: {measured:.3f} B/param vs {expected:.3f}"
            )
            # the breakdown is what the tensors really occupy
            for field, actual in got["actual"].items():
                reported = getattr(breakdown, field)
                assert reported == actual, f"{where}: {field} reported {reported}, storages hold {actual}"
            assert breakdown.buffer_bytes == 0, f"{where}: staging buffers left alive after the step"
            if stage == 2:
                assert got["grads_alive"] == 0, f"{where}: stage 2 must not keep full gradients on parameters"


def test_a_container_memory_limit_caps_the_host_memory_left_to_allocate(tmp_path: Path) -> None:
    """psutil sees the whole machine; a cgroup limit (Docker --memory, a Kubernetes pod) is what kills the
    process, so the room left under it, on any level of the process's cgroup path, is what counts."""
    from runtime.memory import cgroup_headroom, host_available_bytes

    gib = 1 << 30

    def write(directory: Path, **files: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name.replace("_", ".", 1)).write_text(text)

    # cgroup v2: the pod has 8 GiB with 3 in use (1 of it reclaimable cache): 6 left; its parent 4 GiB
    # with 3.5 in use: 0.5 left, and that binds the pod too
    v2 = tmp_path / "v2"
    write(v2, memory_stat="anon 0\n")  # the root: no memory.max, no limit
    write(v2 / "kubepods", memory_max=str(4 * gib), memory_current=str(7 * gib // 2), memory_stat="")
    pod = v2 / "kubepods" / "pod1"
    write(pod, memory_max=str(8 * gib), memory_current=str(3 * gib), memory_stat=f"inactive_file {gib}\n")
    assert cgroup_headroom("0::/kubepods/pod1\n", v2) == gib // 2
    write(v2 / "kubepods", memory_max="max")
    assert cgroup_headroom("0::/kubepods/pod1\n", v2) == 6 * gib
    # cgroup v1: the memory controller's hierarchy, "no limit" written as a huge number
    v1 = tmp_path / "v1"
    unlimited = "9223372036854771712"
    write(v1 / "memory", memory_limit_in_bytes=unlimited, memory_usage_in_bytes="1", memory_stat="")
    box = v1 / "memory" / "docker" / "abc"
    stat = f"cache 5\ntotal_inactive_file {gib // 4}\n"
    write(box, memory_limit_in_bytes=str(2 * gib), memory_usage_in_bytes=str(gib), memory_stat=stat)
    membership = "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    assert cgroup_headroom(membership, v1) == gib + gib // 4
    # a limit whose memory.stat cannot be read still counts, with no cache taken as reclaimable
    (box / "memory.stat").unlink()
    assert cgroup_headroom(membership, v1) == gib
    # no limit anywhere, or no cgroup files at all: nothing to cap with
    assert cgroup_headroom("4:memory:/docker/abc\n", v1 / "nowhere") is None
    assert cgroup_headroom("0::/\n", v2) is None
    # what the engine reads: the smaller of the host's figure and the container's room
    proc = tmp_path / "cgroup"
    proc.write_text(membership)
    assert host_available_bytes(proc_cgroup=proc, cgroup_root=v1) == gib
