"""Per-rank model-state memory of ZeRO stages 0/1/2 against the ZeRO paper's formulas.

Mixed-precision Adam (bf16 working weights and gradients, fp32 master weights, fp32 exp_avg/exp_avg_sq)
per parameter: stage 0 keeps 2 + 2 + 12 = 16 bytes, stage 1 keeps 4 + 12/N, stage 2 keeps 2 + 14/N
(Rajbhandari et al., SC20, §5). Each rank's `engine.memory_breakdown()` must be within 5% of those at
N = 2 and 3, and must agree with the bytes of the storages the engine really holds (working weights
through the model, gradients, master weights and optimizer state through the optimizer).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist import run_distributed

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
