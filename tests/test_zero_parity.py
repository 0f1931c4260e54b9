"""ZeRO stages 0/1/2 x fp32/bf16/fp16 x accumulation 1/2 x clipping on/off equal a plain PyTorch run.

One spawn per world size (1, 2, 3) runs the whole grid; rank 0 also runs the single-process reference
(tests/models.py) on the same global batches and returns the differences. Checked per case: every
micro-step's loss (mean over ranks), the global gradient norm where the engine computed one, the fp32
master weights gathered with `engine.full_state_dict()`, and the working weights of the model.

Clipping-on cases use AdamW with two param groups (decay / no decay) and a clip that is active on some
steps; clipping-off cases use SGD with momentum, whose update is proportional to the gradient, so any
error in averaging over ranks or micro-steps shows up in the weights (Adam would hide it).
fp32 must match to 1e-5 relative. bf16/fp16 reduce and accumulate in 16 bits in a different order than
the reference (per-rank partial sums), so they are compared by the relative error of the weight *update*.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pytest
import torch

from tests.dist import run_distributed
from tests.models import (
    global_batch,
    make_model,
    param_groups,
    rank_batch,
    reference_train,
    train_engine,
)

STEPS = 10
ROWS = 12  # global rows per micro-step: divisible by 1, 2 and 3
LR = {"AdamW": 3e-3, "SGD": 0.05}
CLIP = 0.5
FP16_SCALE_POWER = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    stage: int
    dtype: str
    accumulation: int
    clip: float
    bucket: int = 700  # elements: several buckets per group, so pieces and ordering are exercised
    reduce_dtype: str | None = None
    prescale: bool = False
    predivide: float = 1.0
    overlap: bool = True
    native_reduce_scatter: bool = True

    @property
    def optimizer(self) -> str:
        return "AdamW" if self.clip > 0 else "SGD"

    def config(self) -> dict:
        cfg: dict = {
            "train_batch_size": ROWS * self.accumulation,
            "gradient_accumulation_steps": self.accumulation,
            "steps_per_print": 0,
            "gradient_clipping": self.clip,
            "prescale_gradients": self.prescale,
            "gradient_predivide_factor": self.predivide,
            "optimizer": {"type": self.optimizer, "params": {"lr": LR[self.optimizer]}},
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": self.bucket,
                "overlap_comm": self.overlap,
                "reduce_scatter": self.native_reduce_scatter,
            },
        }
        if self.optimizer == "SGD":
            cfg["optimizer"]["params"]["momentum"] = 0.9
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.dtype == "fp16":
            cfg["fp16"] = {"enabled": True, "auto_cast": True, "initial_scale_power": FP16_SCALE_POWER}
        if self.reduce_dtype:
            cfg["communication_data_type"] = self.reduce_dtype
        return cfg


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


def _update_error(got: torch.Tensor, want: torch.Tensor, initial: torch.Tensor) -> float:
    """|(got - initial) - (want - initial)| / |want - initial| over one tensor."""
    delta = (want.float() - initial).norm()
    return float((got.float() - want.float()).norm() / max(float(delta), 1e-12))


def _compare(case: Case, got: dict) -> list[str]:
    ref = reference_train(
        steps=STEPS,
        accumulation=case.accumulation,
        rows=ROWS,
        param_dtype=DTYPES[case.dtype],
        optimizer=case.optimizer,
        lr=LR[case.optimizer],
        clip=case.clip,
        loss_scale=2.0**FP16_SCALE_POWER if case.dtype == "fp16" else 1.0,
    )
    problems = []
    if got["skipped"]:
        problems.append(f"{got['skipped']} steps skipped")
    if got["dtypes"] != {str(DTYPES[case.dtype])}:
        problems.append(f"working weights are {got['dtypes']}")
    exact = case.dtype == "fp32"
    loss_tol = 1e-5 if exact else 2e-2
    for i, (a, b) in enumerate(zip(got["losses"], ref.losses, strict=True)):
        if abs(a - b) > loss_tol * abs(b):
            problems.append(f"loss[{i}] {a:.7f} vs reference {b:.7f}")
            break
    for i, (a, b) in enumerate(zip(got["norms"], ref.norms, strict=True)):
        if a is not None and abs(a - b) > (1e-5 if exact else 3e-2) * b:
            problems.append(f"grad norm[{i}] {a:.7f} vs reference {b:.7f}")
            break
    if case.clip > 0 and any(n is None for n in got["norms"]):
        problems.append("no grad norm with clipping on")
    for name, want in ref.master.items():
        have = got["master"][name]
        if have.dtype != torch.float32:
            problems.append(f"master {name} is {have.dtype}")
        elif exact:
            if not torch.allclose(have, want, rtol=1e-5, atol=1e-6):
                problems.append(f"master {name}: max abs diff {float((have - want).abs().max()):.3e}")
        elif (err := _update_error(have, want, ref.initial[name])) > 0.05:
            problems.append(f"master {name}: update error {err:.3f}")
        working = got["working"][name]
        # the working weights are the masters rounded to the working dtype
        if not torch.equal(working, have.to(working.dtype)):
            problems.append(f"working {name} is not the rounded master")
    return problems


def _run_grid(rank: int, world_size: int, cases: list[Case]) -> dict[str, list[str]]:
    report = {}
    for case in cases:
        got = _train(case, rank, world_size)
        if rank == 0:
            report[str(asdict(case))] = _compare(case, got)
    return report


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_engine_matches_plain_pytorch(world_size: int) -> None:
    cases = GRID + EXTRA
    report = run_distributed(_run_grid, world_size, cases, timeout=240)[0]
    assert len(report) == len(cases)
    failures = {case: problems for case, problems in report.items() if problems}
    assert not failures, "\n".join(f"{case}: {problems}" for case, problems in failures.items())


def test_reference_sees_the_same_global_batch() -> None:
    """The split of a global batch over ranks covers exactly its rows, for every world size."""
    x, y = global_batch(3, 1, ROWS)
    for world_size in (1, 2, 3):
        parts = [rank_batch(3, 1, ROWS, r, world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
