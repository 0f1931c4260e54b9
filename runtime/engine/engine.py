"""The training engine: one object that runs forward, backward and the optimizer step of a ZeRO run.

The engine composes parts and keeps the step's order; it does not implement them:
- `runtime.zero`: flat working buffers, master shards, and a stage strategy that reduces gradients
  during backward and gathers updated weights after the step;
- `runtime.precision`: dtypes, the gradient math of the step (average, unscale, norm, the non-finite
  verdict, clip), and the `StepGuard` that scales the loss and decides what a skipped step does (fp16's
  loss scaler, or bf16/fp32's skip-and-stop; nonfinite.py);
- the optimizer and LR scheduler (from the config via `runtime.optim`, or from the client), built over
  the fp32 master shards.

A step at the accumulation boundary: wait for the reduced gradients -> fp32 master gradients -> global
norm (+ the non-finite verdict: the only host sync; a non-finite step is skipped on every rank, nothing
of it written) -> one multiply (average, unscale, clip) -> optimizer step on this rank's shard ->
scheduler -> working weights written back and all-gathered -> zero grads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runtime import activation_checkpointing
from runtime.comm import Comm
from runtime.config import Config
from runtime.config.combinations import check_data_parallel_engine, check_offload_param
from runtime.distributed import current_device
from runtime.engine import inference as engine_inference
from runtime.engine import python_gc
from runtime.engine.accessors import EngineAccessors
from runtime.engine.log import StepLog, Timers
from runtime.engine.memory import MemoryBreakdown, memory_breakdown
from runtime.engine.oom import explained_oom
from runtime.engine.persistence import EngineCheckpoints
from runtime.engine.takeover import release_training_state
from runtime.fp8 import adopt_converted as adopt_converted_fp8
from runtime.fp8 import convert_model as convert_to_fp8
from runtime.monitor import TrainingMonitor
from runtime.offload import MasterPlacement, build_master_placement, with_auto_ratio
from runtime.optim import build_optimizer, build_scheduler
from runtime.optim.muon import muon_split
from runtime.parallel.plan import ParallelPlan, replicated_squares
from runtime.precision.grad_math import GradMath, pre_reduce_scale
from runtime.precision.loss_scaler import LossScaler
from runtime.precision.master_adam import for_masters
from runtime.precision.mixed import (
    autocast_context,
    autocast_reduced_params,
    cast_floating,
    cast_unmanaged,
    input_dtype_error,
    policy_from_config,
)
from runtime.precision.nonfinite import StepGuard, guard_from_config
from runtime.zero import StageSetup, ZeroStage, build_zero_stage, shards_optimizer_state
from runtime.zero.optimizer import (
    GroupSpec,
    OptimizerSource,
    build_shard_optimizer,
    rebuild_client_optimizer,
    split_muon_specs,
    with_low_dtype,
)

_log = logging.getLogger("runtime.engine")


class Engine(EngineAccessors, EngineCheckpoints, nn.Module):
    """Wraps a model for data-parallel training with ZeRO stage 0, 1, 2 or 3 and mixed precision."""

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        *,
        optimizer: OptimizerSource | None = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        comm: Comm | None = None,
        device: torch.device | None = None,
        parallel: ParallelPlan | None = None,
    ) -> None:
        """`parallel`: the axes beyond data parallelism (runtime.parallel.plan.build_parallel_plan), whose
        data communicator, param-group split, gradient norm and checkpoint folder the engine takes."""
        super().__init__()
        zero_cfg = config.zero_optimization
        inference = engine_inference.is_inference_only(optimizer, config)  # DeepSpeed's kind
        if not inference:  # (parameter offload alone is ZeRO-Inference: fine without an optimizer)
            check_offload_param(zero_cfg)  # the combinations every engine checks (config/combinations)
        self.parallel = plan = parallel or ParallelPlan()
        split_model = plan.model_parallel  # weights split over a model axis
        if not split_model:
            check_data_parallel_engine(config)
        self.config = config
        self.module = model
        self.comm = comm or plan.comm or Comm(emulate_reduce_scatter=not zero_cfg.reduce_scatter)
        self.device = device or current_device()
        # fp8 swaps modules and keeps their Parameters: before ZeRO groups and flattens them. A model that
        # came converted (Accelerate's mixed_precision="fp8") gets its weights back from torchao's wrappers.
        adopt_converted_fp8(model, rank=self.comm.rank, model_parallel=split_model)
        if config.fp8.enabled:
            convert_to_fp8(model, config.fp8, rank=self.comm.rank, model_parallel=split_model)
        self.policy = policy_from_config(config)
        self.guard: StepGuard = guard_from_config(config)
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._step_applied = False
        self._grad_norm: torch.Tensor | None = None
        self._boundary_override: bool | None = None
        self._scale_wrt_gas = True
        self.training_dataloader: Any = None  # set by runtime.initialize; its position is checkpointed
        self._engine_mpu: Any = None  # model-parallel groups this engine lent to checkpointing
        self._replicated_specs: set[int] = set()  # param groups every model rank holds whole
        # a pipeline's tied copies this rank holds but does not own: the norm takes their squares off
        self._tied_copies: Callable[[], torch.Tensor | None] | None = None
        self.mpu, self.mpu_groups, self.mp_size = plan.mpu, plan.groups, plan.model_size
        self.grid, self.tp_size = plan.grid, plan.tp_size

        self.inference_only = inference
        specs = self._param_group_specs(model, optimizer, model_parameters)
        if optimizer is None and config.optimizer is not None and config.optimizer.type == "Muon":
            specs = split_muon_specs(specs, muon_split(model))  # Muon's matrices apart from AdamW's rest
        low = autocast_reduced_params(model, self.policy)  # torch_autocast.lower_precision_safe_modules
        if low and self.policy.autocast_dtype is not None:
            specs = with_low_dtype(specs, low, self.policy.autocast_dtype)
        # "ratio": "auto" becomes a number before the stage splits its groups by it (an inference engine
        # splits nothing: nothing of it is offloaded)
        self.ratio_was_auto = config.zero_optimization.offload_optimizer.ratio is None  # said on OOM
        if not inference:
            dtype = self.policy.param_dtype
            config = self.config = with_auto_ratio(config, model, self.comm, self.device, dtype)
        zero_cfg = config.zero_optimization
        registration = {p: i for i, p in enumerate(model.parameters())}
        sharded = shards_optimizer_state(zero_cfg.stage) and self.comm.world_size > 1
        self._mean_ranks = plan.mean_ranks(self.comm.world_size)  # the data ranks the mean divides by
        self._pre_reduce_scale = pre_reduce_scale(config, self._mean_ranks)
        # The stage owns the grouping (one flat group per param group, or per ZeRO-3 gather unit and param
        # group) and moves the model to the device.
        setup = StageSetup(
            zero=zero_cfg,
            param_dtype=self.policy.param_dtype,
            master_dtype=self.policy.master_dtype,
            reduce_dtype=self.policy.reduce_dtype,
            device=self.device,
            pre_reduce_scale=self._pre_reduce_scale,
            bucket_cap=zero_cfg.offload_optimizer.bucket_cap(self.comm.world_size),
            trains=not inference,  # an inference engine keeps no masters and no gradient buffers
        )
        self.zero: ZeroStage = build_zero_stage(model, specs, self.comm, setup)
        self.groups = self.zero.groups
        self._group_sources = [specs[group.spec_index].source for group in self.groups]
        managed = {p for g in self.groups for p in g.params}
        cast_unmanaged(model, managed, self.policy.param_dtype)
        # where the masters live (device, or host under offload_optimizer); before the optimizer is built
        self.masters: MasterPlacement = build_master_placement(
            config,
            self.groups,
            self.zero,
            self.comm,
            self.device,
            registration=registration,
            trains=setup.trains,
        )
        self.optimizer, self._per_tensor = self._build_optimizer(optimizer, sharded)
        self.masters.bind(self.optimizer)
        self.zero.on_taken_over = lambda: release_training_state(self)
        self._client_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self._timers = Timers(enabled=config.wall_clock_breakdown, device=self.device)
        self._log = StepLog(config.steps_per_print, rank=self.comm.rank)
        self._log.start(self)
        self.monitor = TrainingMonitor.from_config(
            config, rank=self.comm.rank, world_size=self.comm.world_size, device=self.device, model=model
        )
        activation_checkpointing.apply_engine_config(config)
        if plan.model_parallel:  # after the config's section, which would forget an mpu lent before it
            activation_checkpointing.use_engine_mpu(plan.mpu)
            self._engine_mpu = plan.mpu
        self.parameter_offload = engine_inference.parameter_offload(self)
        self._holds_gc = config.disable_python_gc  # the cyclic collector off until destroy()
        if self._holds_gc:
            python_gc.hold()

    def _check_trains(self, what: str) -> None:
        """A training engine whose model another engine took over has no training state left to save or
        load into (runtime/engine/takeover.py): say so rather than write or read a checkpoint of
        nothing."""
        if self.optimizer is not None:
            self.zero.check_owned(what)

    # -- construction helpers -------------------------------------------------------------------------
    def _param_group_specs(
        self, model: nn.Module, optimizer: OptimizerSource | None, model_parameters: Any
    ) -> list[GroupSpec]:
        """The user's param groups (an inference engine's without an optimizer), mapped onto the model's own
        parameters where the plan replaced them, and split by how they are shared (the plan's one split)."""
        optimizer, model_parameters = self.parallel.own_parameters(optimizer, model_parameters)
        specs = engine_inference.group_specs(self, model, optimizer, model_parameters)
        specs, self._replicated_specs = self.parallel.split(specs)
        return specs

    def _build_optimizer(self, source: OptimizerSource | None, sharded: bool) -> tuple[Any, bool]:
        if source is None and self.config.optimizer is None:
            return None, False
        build: Callable[[list[dict[str, Any]]], Any]  # torch param-group dicts -> the optimizer over them
        if isinstance(source, torch.optim.Optimizer):
            if self.config.optimizer is not None:
                _log.warning("both a client optimizer and a config optimizer were given; using the client's")
            build = functools.partial(rebuild_client_optimizer, source)
        elif source is not None:
            build = source
        else:
            build = functools.partial(build_optimizer, self.config.optimizer)

        policy = self.policy
        return build_shard_optimizer(  # bf16 masters: Adam/AdamW becomes precision.MasterAdam
            self.groups,
            lambda groups: for_masters(
                build(groups), policy.master_dtype, policy.state_dtype, policy.stochastic_rounding
            ),
            sharded=sharded,
            allow_untested=self.config.zero_allow_untested_optimizer,
            comm=self.comm,
        )

    def _build_scheduler(self, source: Any) -> Any:
        if source is None:
            if self.config.scheduler is None or self.optimizer is None:
                return None
            return build_scheduler(self.config.scheduler, self.optimizer)
        if callable(source) and not hasattr(source, "step"):
            return source(self.optimizer)
        self._sync_hyperparameters(source)
        return source

    def _sync_hyperparameters(self, scheduler: Any) -> None:
        """A client scheduler built on the client optimizer drives our groups through its param_groups."""
        client, optimizer = self._client_optimizer, self.optimizer
        if getattr(scheduler, "optimizer", None) is not client or client is None or optimizer is None:
            return
        for ours, source in zip(optimizer.param_groups, self._group_sources, strict=True):
            for key, value in client.param_groups[source].items():
                if key != "params":
                    ours[key] = value

    # -- the training loop API ------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.policy.cast_inputs:
            inputs = cast_floating(inputs, self.policy.param_dtype)
            kwargs = cast_floating(kwargs, self.policy.param_dtype)
        self.monitor.observe_inputs(inputs)
        oom = explained_oom(self, "forward")
        with self._timers("forward"), oom, autocast_context(self.policy, self.device):
            try:
                return self.module(*inputs, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as error:
                clear = input_dtype_error(error, (inputs, kwargs), self.policy.param_dtype)
                if clear is None:
                    raise
                raise clear from error

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate `loss` (this rank's micro-batch mean); gradients are reduced as they appear."""
        engine_inference.check_backward(self)
        self.zero.check_owned("backward")  # before anything runs: another engine may own the model now
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {_describe(loss)}")
        boundary = self.is_gradient_accumulation_boundary()
        self._scale_wrt_gas = scale_wrt_gas
        self._log.record_loss(loss)
        self.monitor.record_loss(loss)
        scaled = self.guard.scale(loss)
        with self._timers("backward"), explained_oom(self, "backward"):
            if boundary and self.optimizer is not None:
                # an offloaded update may start as soon as gradients land, when nothing waits on the norm
                self.masters.prepare_step(self.optimizer, self._grad_math(), per_tensor=self._per_tensor)
            self.zero.begin_backward(boundary=boundary)
            self.masters.begin_backward(boundary=boundary)
            with self._timers("backward_inner"):  # autograd, with the overlapped reductions it launches
                self.masters.run_backward(lambda: scaled.backward(retain_graph=retain_graph))
            with self._timers("backward_allreduce"):  # waiting for the reductions still in flight
                self.zero.end_backward(boundary=boundary)
            self.masters.end_backward(boundary=boundary)
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the accumulation boundary: update the weights; otherwise only count the micro-step."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        if self.optimizer is None:
            engine_inference.refuse_step()
        self.zero.check_owned("step")
        with self._timers("step"), explained_oom(self, "step"):
            self._step_applied = self._apply_step(lr_kwargs)
            self.zero.zero_grad()
        self.micro_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._log.after_step(self)
        self.monitor.after_step(self)

    def _grad_math(self) -> GradMath:
        """The gradient arithmetic of the coming step (the norm summed over the plan's pipe and model axes
        too)."""
        accumulation = self.gradient_accumulation_steps() if self._scale_wrt_gas else 1
        math = GradMath(
            # what is left of the mean over ranks and micro-steps after the pre-reduce scaling
            divisor=self._mean_ranks * accumulation * self._pre_reduce_scale,
            loss_scale=self.loss_scale,
            max_norm=self.config.gradient_clipping,
            check_overflow=self.guard.checks,
            want_norm=self._log.wants_norm(self.global_steps + 1) or self.monitor.wants_norm,
            all_reduce_sum=self.comm.all_reduce if self.zero.grads_are_sharded else None,
        )
        return self.parallel.grad_math(
            math, lambda: replicated_squares(self, self._replicated_specs), duplicates=self._tied_copies
        )

    def _apply_step(self, lr_kwargs: dict[str, Any] | None) -> bool:
        math = self._grad_math()
        with self._timers("optimizer_step"):  # norm, clip, the optimizer (on the host under offload)
            result = self.masters.step(self.optimizer, math, per_tensor=self._per_tensor)
        self._grad_norm = result.norm
        step = self.global_steps + 1
        if result.overflow:  # nothing was updated; like DeepSpeed, the scheduler does not advance either
            self.skipped_steps += 1
            self.guard.skipped(step=step, norm=result.norm, log=self._log)
            return False
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
            self._sync_hyperparameters(self.lr_scheduler)
        with self._timers("write_back"):  # updated weights back to the model (offload: copies; all-gathers)
            self.masters.write_back()
        self.guard.applied(step=step)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (step() already does this after every boundary)."""
        self.zero.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force (True/False) or restore (None) the boundary decision of the next backward and step."""
        self._boundary_override = is_boundary

    # -- read-only state ------------------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient norm (before clipping; inf or nan for a skipped step); None when
        it was not computed (no clipping, bf16.check_grad_overflow false, and not a logging step). Reading
        it waits for the device."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def get_lr(self) -> list[float]:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler (its state is checkpointed); None without fp16."""
        return self.guard.loss_scaler

    @property
    def loss_scale(self) -> float:
        return self.guard.loss_scale

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    @property
    def zero_stage(self) -> int:
        return self.config.zero_optimization.stage

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes of working weights, gradients, master weights and optimizer state held by this rank."""
        return memory_breakdown(self)

    def destroy(self) -> None:
        """Remove the engine's gradient hooks from the model; flush and close the monitors; stop lending its
        model-parallel groups to checkpointing and deepspeed.utils.groups."""
        self.zero.close()
        self.masters.close()
        self.monitor.close()
        activation_checkpointing.release_engine_mpu(self._engine_mpu)
        if self._holds_gc:
            self._holds_gc = False
            python_gc.release()

    def collect_python_gc(self) -> int:
        """A full cyclic garbage collection now, where the loop chooses (with `disable_python_gc` the
        collector never starts one by itself); how many unreachable objects it found."""
        return python_gc.collect()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


__all__ = ["Engine", "MemoryBreakdown"]
