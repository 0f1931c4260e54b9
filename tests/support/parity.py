"""One parity check for every engine suite: a `Case`, its plain-PyTorch reference, `compare`, `run_grid`.

The ZeRO stage 0-2 suite (tests/runtime/zero/test_zero_parity.py), the stage-3 suite
(tests/runtime/zero/test_zero3.py) and the
offload suite (tests/runtime/offload/test_parity.py) all train the same way: one spawn per world size runs a
grid
of cases, rank 0 also runs the single-process reference (tests/support/models.py's `reference_train`) on the
same global batches, and the differences come back as one list of problems per case. Checked per case: every
micro-step's loss (mean over ranks), the global gradient norm where the engine computed one, the fp32
master weights gathered with `engine.full_state_dict()`, and, where the suite read them, the working
weights of the model.

Why these tolerances: fp32 must match to 1e-5 relative. bf16/fp16 reduce and accumulate in 16 bits in a
different order than the reference (per-rank partial sums), so they are compared by the relative error
of the weight *update*. Clipping-on cases use AdamW with two param groups (decay / no decay) and a clip
that is active on some steps; clipping-off cases use SGD with momentum, whose update is proportional to
the gradient, so any error in averaging over ranks or micro-steps shows up in the weights (Adam would
hide it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tests.support.dist import run_distributed
from tests.support.models import RefResult, reference_train

STEPS = 10
ROWS = 12  # global rows per micro-step: divisible by 1, 2 and 3
LR = {"AdamW": 3e-3, "SGD": 0.05}
CLIP = 0.5
FP16_SCALE_POWER = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """One engine configuration of the grid (a ZeRO stage 0-2 run unless a suite's subclass says more)."""

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
        cfg.update(precision_config(self.dtype))
        if self.reduce_dtype:
            cfg["communication_data_type"] = self.reduce_dtype
        return cfg


def precision_config(dtype: str) -> dict:
    """The config keys of a run in `dtype` ("fp32", "bf16" or "fp16" with a fixed initial loss scale)."""
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": FP16_SCALE_POWER}}
    return {}


def reference(case: Any, *, steps: int = STEPS, model: Callable[[int], nn.Module] | None = None) -> RefResult:
    """The plain-PyTorch run `case` must equal (`case`: anything with dtype, accumulation, clip and
    optimizer, like `Case`); `model`: the model factory (tests/support/models.py's `make_model` by
    default)."""
    return reference_train(
        steps=steps,
        accumulation=case.accumulation,
        rows=ROWS,
        param_dtype=DTYPES[case.dtype],
        optimizer=case.optimizer,
        lr=LR[case.optimizer],
        clip=case.clip,
        loss_scale=2.0**FP16_SCALE_POWER if case.dtype == "fp16" else 1.0,
        model=model,
    )


def update_error(got: torch.Tensor, want: torch.Tensor, initial: torch.Tensor) -> float:
    """|(got - initial) - (want - initial)| / |want - initial| over one tensor."""
    delta = (want.float() - initial).norm()
    return float((got.float() - want.float()).norm() / max(float(delta), 1e-12))


def compare(case: Any, got: dict, ref: RefResult) -> list[str]:
    """What differs between the engine's run `got` (losses, norms, master, skipped; dtypes and working
    when the suite read them) and the reference `ref`; empty when they agree."""
    problems = []
    if got["skipped"]:
        problems.append(f"{got['skipped']} steps skipped")
    if "dtypes" in got and got["dtypes"] != {str(DTYPES[case.dtype])}:
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
        if have.dtype != torch.float32 or have.shape != want.shape:
            problems.append(f"master {name} is {have.dtype} {tuple(have.shape)}")
        elif exact:
            if not torch.allclose(have, want, rtol=1e-5, atol=1e-6):
                problems.append(f"master {name}: max abs diff {float((have - want).abs().max()):.3e}")
        elif (err := update_error(have, want, ref.initial[name])) > 0.05:
            problems.append(f"master {name}: update error {err:.3f}")
        if "working" in got:
            working = got["working"][name]
            # the working weights are the masters rounded to the working dtype
            if not torch.equal(working, have.to(working.dtype)):
                problems.append(f"working {name} is not the rounded master")
    return problems


Train = Callable[[Any, int, int], dict]
"""train(case, rank, world_size) -> the run's results, as `compare` reads them."""


def run_grid(rank: int, world_size: int, cases: Sequence[Any], train: Train) -> dict[str, list[str]]:
    """On every rank of a spawned group: train each case; on rank 0, compare it with its reference."""
    report = {}
    for case in cases:
        got = train(case, rank, world_size)
        if rank == 0:
            report[str(asdict(case))] = compare(case, got, reference(case))
    return report


def assert_grid_matches(world_size: int, cases: Sequence[Any], train: Train, *, timeout: float = 240) -> None:
    """Spawn `world_size` ranks, run the grid, and fail with every case that differs (and its problems)."""
    report = run_distributed(run_grid, world_size, list(cases), train, timeout=timeout)[0]
    assert len(report) == len(cases)
    failures = {case: problems for case, problems in report.items() if problems}
    assert not failures, "\n".join(f"{case}: {problems}" for case, problems in failures.items())
