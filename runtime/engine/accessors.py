"""DeepSpeed's engine accessors, as a mixin of `runtime.engine.Engine`.

Trainer, Accelerate and DeepSpeed's examples ask the engine questions by DeepSpeed's names:
``engine.local_rank``, ``engine.fp16_enabled()``, ``engine.zero_optimization_stage()``,
``engine.zero_gather_16bit_weights_on_model_save()``, ``engine._zero3_consolidated_16bit_state_dict()``.
Every answer here is read from the engine's typed config or its parts; nothing is stored twice. Methods
for DeepSpeed features dslaunch lacks raise `runtime.errors.UnsupportedFeature`. Every engine registers
here (`live_engines`), so DeepSpeed's per-parameter functions (`runtime.deepspeed_api.params`) find the
engine that trains a parameter without the engine importing them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from runtime.errors import unsupported
from runtime.tensor_parallel.autotp import full_state_dict
from runtime.zero.gathered import gathered_state_dict

__all__ = ["EngineAccessors", "live_engines"]

_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()


def live_engines() -> list[Any]:
    """The engines of this process still alive, in no order."""
    return list(_ENGINES)


class EngineAccessors:
    """DeepSpeed-named read-only accessors; mixed into `runtime.engine.Engine` (which provides `config`,
    `comm`, `module`, `device`, `optimizer`, `save_16bit_model`, `zero`)."""

    config: Any
    comm: Any
    module: torch.nn.Module
    device: torch.device
    checkpoint_excluded_keys: frozenset[str] = frozenset()  # see excluding_frozen

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _ENGINES.add(self)  # so deepspeed.utils.safe_get_full_fp32_param(p) finds p's engine

    # -- ranks ----------------------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def dp_world_size(self) -> int:
        return self.comm.world_size

    @property
    def mp_world_size(self) -> int:
        return 1  # no model parallelism

    @property
    def seq_dp_world_size(self) -> int:
        return self.comm.world_size

    # -- precision ------------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def amp_enabled(self) -> bool:
        return False  # apex AMP is refused by the config reader

    def fp16_auto_cast(self) -> bool:
        return self.config.fp16.auto_cast

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype)."""
        return self.config.param_dtype, self.config.param_dtype

    def communication_data_type(self) -> torch.dtype:
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        chosen = self.config.communication_data_type
        return names[chosen] if chosen else self.config.param_dtype

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.enabled and self.config.fp16.loss_scale == 0

    # -- ZeRO -----------------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero_optimization.stage >= 3

    def zero_offload_optimizer(self) -> Any:
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The whole model's working-dtype state dict on rank 0 ({} elsewhere); every rank must call it.
        Parameters are gathered unit by unit."""
        state = gathered_state_dict(self.module, rank0_only=True)
        if exclude_frozen_parameters and state:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        return self.save_16bit_model(save_dir, save_filename)  # type: ignore[attr-defined]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in the Hugging Face layout (AutoTP's shards gathered over the model group, the
        fused q|k|v order undone); every rank must call it."""
        self.masters.flush()  # type: ignore[attr-defined]
        return full_state_dict(self.module)

    @contextlib.contextmanager
    def excluding_frozen(self, exclude: bool) -> Iterator[None]:
        """While a save runs: the state-dict keys of the frozen (requires_grad False) parameters, which
        DeepSpeed's ``save_checkpoint(..., exclude_frozen_parameters=True)`` leaves out of the saved
        module (runtime.checkpoint.engine_state reads them). Loading such a checkpoint then needs
        ``load_module_strict=False``, as in DeepSpeed: the frozen parameters keep the model's values."""
        frozen = (n for n, p in self.module.named_parameters() if not p.requires_grad)
        self.checkpoint_excluded_keys = frozenset(frozen) if exclude else frozenset()
        try:
            yield
        finally:
            self.checkpoint_excluded_keys = frozenset()

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    # -- other config answers -------------------------------------------------------------------------
    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def memory_breakdown_enabled(self) -> bool:
        return self.config.memory_breakdown

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    def get_type(self) -> str:
        return type(self).__name__

    def get_mom(self) -> list[Any]:
        if self.optimizer is None:  # type: ignore[attr-defined]
            return []
        groups = self.optimizer.param_groups  # type: ignore[attr-defined]
        return [g.get("betas", g.get("momentum")) for g in groups]

    # -- compiling (runtime.compile owns how) ---------------------------------------------------------
    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """torch.compile the wrapped model in place: at ZeRO 0-2 the whole model, at ZeRO 3 with sharded
        parameters each gather unit's forward, its gather and release hooks outside the graphs
        (`runtime.compile`). DeepSpeed's DeepCompile schedules (``schedule``) and compiled autograd are
        not available. A second call does nothing."""
        if schedule is not None or compiled_autograd_enabled:
            unsupported(
                "DeepCompile (engine.compile(schedule=...) / compiled autograd)",
                "call engine.compile(backend=...) without a schedule (the model is then torch.compile'd)",
            )
        kwargs = dict(compile_kwargs or {})
        if backend is not None:
            kwargs["backend"] = backend
        self._compile_module(kwargs)

    def _compile_module(
        self, kwargs: dict[str, Any], compiler: Any = None, why: str = "engine.compile()"
    ) -> None:
        """Compile the model by runtime.compile's plan, with torch.compile(**kwargs) or `compiler`."""
        if self.is_compiled:
            return
        from runtime.compile import compile_model

        zero = self.zero  # type: ignore[attr-defined]
        hooked = {name for unit in zero.units for name in unit.plan.users} if zero.params_sharded else set()
        self.compile_plan = compile_model(self.module, hooked, kwargs, compiler=compiler)
        self._is_compiled = True
        if self.comm.rank == 0:
            logging.getLogger("runtime.compile").info("%s: %s", why, self.compile_plan.describe())

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_is_compiled", False)

    # -- features dslaunch does not have --------------------------------------------------------------
    def register_post_step_hook(self, hook: Callable[..., Any]) -> None:
        unsupported("engine.register_post_step_hook()", "call your function after engine.step() in the loop")

    def no_sync(self) -> Any:
        unsupported(
            "engine.no_sync()",
            "gradient accumulation is configured by gradient_accumulation_steps; the engine reduces only "
            "at the boundary's step",
        )
