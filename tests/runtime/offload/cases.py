"""The offload suites' shared pieces: `OffloadCase` (a tests/support/parity.py case with the optimizer
offloaded), the shrunken internal settings, and `offload_engine`, a small bf16 AdamW engine with offload on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from tests.support.models import make_model, param_groups
from tests.support.parity import ROWS, STEPS, Case

CHUNK = 128  # elements per copy-back chunk in these tests (buckets are 700)
SMALL_CHUNKS = {"transfer_chunk_elems": CHUNK, "device_chunk_elems": CHUNK, "device_slots": 2}
"""Internal offload settings: several chunks a span, and the device step's slots reused."""


def read_weights(engine: Any, stage: int) -> tuple[dict, dict, set]:
    """(the fp32 masters gathered whole, the working weights, their dtypes); under stage 3 the working
    weights are read inside GatheredParameters, as units below the persistence threshold are not gathered
    outside a forward."""
    master = engine.full_state_dict()
    gathered: Any = contextlib.nullcontext()
    if stage == 3:
        from runtime.zero import GatheredParameters

        gathered = GatheredParameters(list(engine.module.parameters()))
    with gathered:
        working = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        dtypes = {str(p.dtype) for p in engine.module.parameters()}
    return master, working, dtypes


@dataclass(frozen=True)
class OffloadCase(Case):
    """A parity case with `offload_optimizer: {device: cpu}` and its keys set by the fields below."""

    adam_without_clip: bool = False
    pin_memory: bool = False
    persistence: int | None = None  # stage3_param_persistence_threshold (0: every unit is gathered on use)
    offload_param: bool = False  # stage 3: the working shards in host memory too
    fp32_landing: bool = False  # grad_transfer "fp32": 16-bit gradients land as fp32 (else "native")
    device_step: bool = False  # update "device": state streams through the "device" (else "host")
    host_share: float = 0.0  # host_share: with the device step, the CPU's share of it

    @property
    def optimizer(self) -> str:
        return "AdamW" if self.clip > 0 or self.adam_without_clip else "SGD"

    def config(self) -> dict:
        cfg = super().config()
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu",
            "pin_memory": self.pin_memory,
            "update": "device" if self.device_step else "host",
            "grad_transfer": "fp32" if self.fp32_landing else "native",
            "host_share": self.host_share,
        }
        if self.persistence is not None:
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = self.persistence
        if self.offload_param:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": self.pin_memory}
        if self.adam_without_clip:  # with one rank the step streams during backward: only without the
            cfg.setdefault("bf16", {})["check_grad_overflow"] = False  # non-finite check (bf16/fp32)
        return cfg


def offload_engine(
    stage: int,
    *,
    bucket: int = 700,
    clip: float = 0.0,
    model=None,
    check: bool = True,
    offload: dict | None = None,
    **sizes: int,
):
    """bf16 AdamW with the optimizer offloaded (`offload`: more offload_optimizer keys); `model` (default:
    a fresh `make_model(0, **sizes)`) may carry hooks of the test's own, registered before the engine's.
    `check=False` turns off the non-finite check (bf16.check_grad_overflow), which a step streamed during
    backward needs."""
    import runtime

    model = make_model(0, **sizes) if model is None else model
    config = {
        "train_batch_size": ROWS,
        "steps_per_print": 0,
        "gradient_clipping": clip,
        "bf16": {"enabled": True, "check_grad_overflow": check},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, **(offload or {})},
        },
    }
    engine, optimizer, _, _ = runtime.initialize(
        model=model, model_parameters=param_groups(model), config=config
    )
    return model, engine, optimizer


def train_and_read(engine: Any, case: Any, rank: int, world_size: int) -> dict:
    """Train `engine` on the parity batches (tests/support/parity.py) and read back what the parity tests
    compare:
    losses, gradient norms, masters, working weights, skipped steps and dtypes."""
    from tests.support.models import train_engine

    losses, norms = train_engine(
        engine, steps=STEPS, accumulation=case.accumulation, rows=ROWS, rank=rank, world_size=world_size
    )
    master, working, dtypes = read_weights(engine, case.stage)
    return {
        "losses": losses,
        "norms": norms,
        "master": master,
        "working": working,
        "skipped": engine.skipped_steps,
        "dtypes": dtypes,
    }
