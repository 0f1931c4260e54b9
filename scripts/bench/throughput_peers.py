"""The configurations train_throughput.py measures: how each peer (plain PyTorch, our engine, FSDP2,
DeepSpeed, and the compiled loops) builds its training step on one shared Workload. The measuring, the
order of the runs and the command line are train_throughput.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.models import GPT, GPTConfig
from scripts.bench.common import real_deepspeed

PEERS = ("torch", "ours", "fsdp2", "deepspeed")
COMPILED_PEERS = ("torch-compiled", "ours-compiled")  # measured only when asked for
ALL_PEERS = PEERS[:2] + COMPILED_PEERS + PEERS[2:]  # measuring order
LR, WEIGHT_DECAY = 1e-4, 0.01

StepFn = Callable[[], torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """What every configuration of one model trains on."""

    config: GPTConfig
    micro_batch: int
    seq_len: int
    device: torch.device
    compile: bool
    ds_torch_adam: bool
    activation_checkpointing: bool = False
    compile_backend: str = "inductor"  # of the *-compiled peers

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len


def engine_config(work: Workload, stage: int) -> dict[str, Any]:
    """The DeepSpeed-style config shared by our engine and DeepSpeed."""
    return {
        "train_micro_batch_size_per_gpu": work.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19.8 would default to 1.0
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WEIGHT_DECAY},
        },
    }


def fresh_model(work: Workload) -> GPT:
    torch.manual_seed(0)
    with torch.device(work.device):  # initialise on the device: seconds instead of minutes for 1.5B
        model = GPT(work.config)
    if work.activation_checkpointing:
        from runtime.activation_checkpointing import checkpoint

        model.checkpoint_fn = checkpoint  # every block recomputed in backward
    if work.compile:
        for block in model.blocks:
            block.compile()  # per block, in place, so hooks on module boundaries keep working
    return model


def setup_torch(work: Workload, batch: Batch, stage: int | None, compiled: bool = False) -> StepFn:
    model = fresh_model(work)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if compiled:
        # the optimizer was built on the same parameters: the compiled wrapper shares them
        model = torch.compile(model, backend=work.compile_backend)
    return module_step(model, optimizer, batch, autocast=work.device.type)


def module_step(model: Any, optimizer: Any, batch: Batch, *, autocast: str | None = None) -> StepFn:
    """One plain training step of `model` with `optimizer` on `batch`; under bf16 autocast on the device
    type `autocast` names (None: the model's own dtypes, as FSDP2's mixed-precision policy sets them)."""
    x, y = batch

    def step() -> torch.Tensor:
        context = torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def setup_ours(work: Workload, batch: Batch, stage: int | None, compiled: bool = False) -> StepFn:
    import runtime

    if not hasattr(runtime, "initialize"):
        raise RuntimeError("runtime.initialize does not exist yet in this checkout")
    model = fresh_model(work)
    engine, _, _, _ = runtime.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(work, stage or 0)
    )
    if compiled:
        engine.compile(backend=work.compile_backend)
    return engine_step(engine, batch)


def engine_step(engine: Any, batch: Batch) -> StepFn:
    """One training step of a DeepSpeed-style engine (ours or DeepSpeed's) on `batch`."""
    x, y = batch

    def step() -> torch.Tensor:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def setup_fsdp2(work: Workload, batch: Batch, stage: int | None) -> StepFn:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = fresh_model(work)
    mesh = init_device_mesh(work.device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return module_step(model, optimizer, batch)


def setup_deepspeed(work: Workload, batch: Batch, stage: int | None) -> StepFn:
    import logging

    deepspeed = real_deepspeed()  # never our compat package under its name
    deepspeed.utils.logger.setLevel(logging.WARNING)  # keep stdout for our JSON lines
    config = engine_config(work, stage or 0)
    if work.ds_torch_adam:  # torch.optim.AdamW inside DeepSpeed: no FusedAdam JIT build
        config["optimizer"]["params"]["torch_adam"] = True
    model = fresh_model(work)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine_step(engine, batch)


SETUPS: dict[str, Callable[[Workload, Batch, int | None], StepFn]] = {
    "torch": setup_torch,
    "ours": setup_ours,
    "torch-compiled": lambda work, batch, stage: setup_torch(work, batch, stage, compiled=True),
    "ours-compiled": lambda work, batch, stage: setup_ours(work, batch, stage, compiled=True),
    "fsdp2": setup_fsdp2,
    "deepspeed": setup_deepspeed,
}
