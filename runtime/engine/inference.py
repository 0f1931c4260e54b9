"""The engine without an optimizer: DeepSpeed's inference engine, and ZeRO-3's `parameter_offload`.

`deepspeed.initialize(model=..., config=...)` with no optimizer and no "optimizer" section is how TRL
(`prepare_deepspeed`), Accelerate and Transformers wrap a frozen reference or reward model. DeepSpeed
builds no optimizer then; at ZeRO stage 3 it still shards every parameter, frozen ones included, and
gathers them for forward (its `DeepSpeedZeRoOffload`). Our engine does the same:

- `group_specs`: every parameter is sharded at stage 3 (one group; no optimizer is built over it), the
  trainable ones form the group at stages 0-2, and a model with none is accepted;
- the engine holds the working weights and nothing else (`StageSetup.trains` false): the masters are the
  working buffers themselves (unsharded at stages 1-2, the shards at stage 3), no gradient buffer or
  gradient hook exists, and an `offload_optimizer` section moves nothing (TRL copies the trainer's config
  into the reference model's); `offload_param` alone keeps the stage-3 shards in host memory
  (DeepSpeed's ZeRO-Inference), which a training engine refuses;
- `check_backward` / `refuse_step`: an inference engine with parameters to manage reduces no gradients,
  and no engine without an optimizer steps: both say so in one line, where DeepSpeed fails with an
  AttributeError;
- `parameter_offload`: at stage 3 (any engine) the `runtime.zero.hook_control.ZeroParamOffload` over the
  stage's gather hooks, also set as `optimizer.parameter_offload`, where TRL's remove_hooks/add_hooks
  look for it.

Unlike DeepSpeed, `engine.optimizer` of an inference engine is None (DeepSpeed puts its parameter-offload
object there); the object is `engine.parameter_offload`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from runtime.errors import UserError
from runtime.zero.hook_control import ZeroParamOffload
from runtime.zero.optimizer import GroupSpec, collect_param_groups, inference_param_groups

__all__ = ["check_backward", "group_specs", "is_inference_only", "parameter_offload", "refuse_step"]


def is_inference_only(optimizer: Any, config: Any) -> bool:
    return optimizer is None and config.optimizer is None


def group_specs(engine: Any, model: nn.Module, optimizer: Any, model_parameters: Any) -> list[GroupSpec]:
    """The engine's param groups: the user's (runtime.zero.optimizer), or an inference engine's, where
    `model_parameters` chooses nothing (no optimizer is built; Lightning passes [] for evaluation)."""
    if engine.inference_only:
        return inference_param_groups(model, shard_frozen=engine.config.zero_optimization.stage == 3)
    return collect_param_groups(model, optimizer, model_parameters)


def check_backward(engine: Any) -> None:
    """Refuse backward on an inference engine that manages parameters (every one at stage 3, the trainable
    ones below): it keeps no gradient buffers to reduce their gradients into. With only frozen parameters
    at stages 0-2 backward is plain autograd (gradients with respect to the inputs)."""
    if not (engine.inference_only and engine.groups):
        return
    raise UserError(
        f"engine.backward(): this ZeRO-{engine.zero_stage} engine was built without an optimizer (no "
        'optimizer= and no "optimizer" section), as an inference engine: it keeps no gradient buffers, so '
        "it reduces no gradients and updates nothing",
        hint='to train the model pass optimizer=... or add an "optimizer" section; run an inference '
        "engine's forward under torch.no_grad()",
    )


def refuse_step() -> None:
    raise UserError(
        'engine.step(): this engine was built without an optimizer (no optimizer= and no "optimizer" '
        "section), as an inference engine, so there is nothing to step",
        hint='pass optimizer=... to initialize, or add an "optimizer" section to the config',
    )


def parameter_offload(engine: Any) -> ZeroParamOffload | None:
    """ZeRO-3's `parameter_offload` object for `engine` (None at stages 0-2)."""
    if engine.config.zero_optimization.stage != 3:
        return None
    offload = ZeroParamOffload(engine.module, engine.zero.schedule)
    if engine.optimizer is not None:
        engine.optimizer.parameter_offload = offload
    return offload
