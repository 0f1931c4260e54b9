"""ZeRO stages 0/1/2 x fp32/bf16/fp16 x accumulation 1/2 x clipping on/off equal a plain PyTorch run.

One spawn per world size (1, 2, 3) runs the whole grid (tests/support/parity.py: the cases, the reference,
what is compared and why the tolerances are what they are), plus the reduction options: fp32 on the wire,
prescaling, predivision, reduce-scatter emulated by all-reduce, no overlap, one bucket per group.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import global_batch, make_model, param_groups, rank_batch, train_engine
from tests.support.parity import CLIP, ROWS, STEPS, Case, assert_grid_matches

GRID = [
    Case(stage, dtype, acc, clip)
    for stage in (0, 1, 2)
    for dtype in ("fp32", "bf16", "fp16")
    for acc in (1, 2)
    for clip in (0.0, CLIP)
]
EXTRA = [
    Case(2, "bf16", 2, CLIP, reduce_dtype="fp32"),  # bf16 gradients, fp32 on the wire
    Case(1, "fp32", 1, 0.0, prescale=True),
    Case(0, "fp16", 2, 0.0, predivide=4.0),
    Case(2, "fp32", 2, CLIP, native_reduce_scatter=False),  # reduce-scatter emulated by all-reduce
    Case(2, "fp32", 2, 0.0, overlap=False),
    Case(1, "fp32", 2, CLIP, bucket=10**9),  # one bucket per group: the master aliases the working buffer
    Case(0, "bf16", 1, CLIP, overlap=False),
]


def _train(case: Case, rank: int, world_size: int) -> dict:
    import runtime

    model = make_model(0)
    engine, _, _, _ = runtime.initialize(
        model=model, model_parameters=param_groups(model), config=case.config()
    )
    losses, norms = train_engine(
        engine, steps=STEPS, accumulation=case.accumulation, rows=ROWS, rank=rank, world_size=world_size
    )
    out = {
        "losses": losses,
        "norms": norms,
        "master": engine.full_state_dict(),
        "working": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "skipped": engine.skipped_steps,
        "dtypes": {str(p.dtype) for p in engine.module.parameters()},
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_engine_matches_plain_pytorch(world_size: int) -> None:
    assert_grid_matches(world_size, GRID + EXTRA, _train)


def test_reference_sees_the_same_global_batch() -> None:
    """The split of a global batch over ranks covers exactly its rows, for every world size."""
    x, y = global_batch(3, 1, ROWS)
    for world_size in (1, 2, 3):
        parts = [rank_batch(3, 1, ROWS, r, world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
