"""`PipelineEngine`: DeepSpeed's `train_batch` / `eval_batch` over `torch.distributed.pipelining`.

One `train_batch(data_iter)` is one global batch: `gradient_accumulation_steps` micro-batches go through
the stages under a schedule from `torch.distributed.pipelining` (1F1B by default, so at most `stages`
micro-batches of activations are alive on a stage; GPipe as an option; with several chunks per stage,
interleaved 1F1B by default, looped BFS as an option, each chunk its own `PipelineStage` with its
virtual stage index), gradients accumulate in the
engine's flat buffers, and then the data-parallel part is the ordinary ZeRO step of `runtime.Engine`
(this class extends it) over the grid's data group: tied gradients summed over their stages -> reduction
over data (ZeRO stage 0 or 1) -> the gradient norm over the whole grid (each tied weight counted once) ->
clip -> optimizer step on this rank's shard.

The grid is a parallel plan like any other engine's (`runtime.parallel.pipe_plan.build_pipeline_plan`:
the data communicator, AutoTP over the model axis, the param-group split, the norm across pipe and model,
the checkpoint folder per stage); this class keeps the schedules, the tied weights (`runtime.pipe.tied`)
and `train_batch` / `eval_batch`.

The data-iterator contract is DeepSpeed's: each `next(data_iter)` is one micro-batch `(inputs, labels)`;
the first stage reads inputs and the last stage labels (middle stages do not touch the iterator, which
may be None there). `runtime.pipe.data` reads them before any compute and makes every rank agree they
are all there, of the micro-batch size, so bad data is an error before training, not a hang. As in
DeepSpeed, an iterator given to `train_batch` is kept for the next call, and one built from
`initialize(training_data=...)` is read when none is given.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from runtime.config import Config, read_config_file
from runtime.distributed import current_device
from runtime.engine import Engine
from runtime.engine.oom import explained_oom
from runtime.parallel.pipe_plan import build_pipeline_plan
from runtime.parallel.plan import ParallelPlan, PipeAxis
from runtime.pipe.config import MULTI_CHUNK_SCHEDULES, PipelineError, check_schedule
from runtime.pipe.data import RepeatingLoader, read_micro_batches, stage_tensors
from runtime.pipe.module import PipelineModule, check_every_stage_trains
from runtime.pipe.tied import (
    all_reduce_tied_grads,
    broadcast_tied_weights,
    build_ties,
    duplicate_grad_squares,
)

_SCHEDULES: dict[str, Any] = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
}
_PARTS_KEY = "_pipeline_layer_boundaries"  # in each stage's client state: the partition it was saved with


def _read_config(config: Any) -> dict[str, Any] | Config:
    if isinstance(config, (str, os.PathLike)):
        return dict(read_config_file(config))
    if isinstance(config, (dict, Config)):
        return config
    raise PipelineError(
        f"PipelineEngine needs the config as a dict or a file path, got {type(config).__name__}"
    )


class PipelineEngine(Engine):
    """Trains a `PipelineModule`: `train_batch(data_iter)` and `eval_batch(data_iter)`."""

    module: PipelineModule

    def __init__(
        self,
        module: PipelineModule,
        config: Any,
        *,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        parallel: ParallelPlan | None = None,
    ) -> None:
        """`parallel`: the module's plan (`build_pipeline_plan`, which `runtime.initialize` builds with the
        config loaded for it); without it, built here from `config` (a dict or a file path)."""
        if not isinstance(module, PipelineModule):
            raise PipelineError(f"PipelineEngine trains a PipelineModule, got {type(module).__name__}")
        if parallel is None:  # refusals first, then AutoTP over the grid's model axis where it has one
            parallel, config = build_pipeline_plan(module, _read_config(config))
        pipe = parallel.pipe
        if pipe is None or not isinstance(config, Config):
            raise PipelineError(
                "PipelineEngine(parallel=...) takes the plan and the Config that "
                "runtime.parallel.pipe_plan.build_pipeline_plan returned"
            )
        cfg = config
        if cfg.pipeline.activation_checkpoint_interval is not None:
            module.activation_checkpoint_interval = cfg.pipeline.activation_checkpoint_interval
        device = current_device()
        # ties first: the engine copies the weights into its flat buffers and master shards
        ties = build_ties(module)
        broadcast_tied_weights(ties, device)
        if optimizer is None and model_parameters is None:
            check_every_stage_trains(module, device)
        super().__init__(
            module,
            cfg,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            device=device,
            parallel=parallel,
        )
        self.pipeline = cfg.pipeline
        self.pipe: PipeAxis = pipe
        self.ties = ties
        if ties:  # the norm counts each tied weight once: the copies this stage does not own come off
            self._tied_copies = lambda: self._duplicate_squares
        self.num_stages = module.num_stages
        self.stage_id = module.stage_id
        self.micro_batches = cfg.gradient_accumulation_steps
        self._last_stage_rank = module.grid.stage_to_global(self.num_stages - 1)
        self._duplicate_squares: torch.Tensor | None = None
        self.schedule_name = check_schedule(
            cfg.pipeline, self.num_stages, module.chunks_per_stage, self.micro_batches
        )
        # scale_grads=False: the ZeRO step divides by micro-batches x data-parallel ranks once
        self._schedule = self._make_schedule(self._torch_stages(), loss_fn=self._scaled_loss)
        # Evaluation runs its own torch stages over the same chunks (built on first use): a stage infers
        # its receive buffers on its first run, and buffers inferred under no_grad would then serve
        # training too (torch 2.11's interleaved runtime sent None input gradients after an eval_batch).
        self._eval: dict[tuple[bool, int], Any] = {}  # (compute_loss, micro-batches) -> schedule
        self._eval_stages: list[PipelineStage] | None = None
        self._losses: list[torch.Tensor] = []
        self.data_iterator: Iterator[Any] | None = None  # what train_batch() reads without an iterator

    def _torch_stages(self) -> list[PipelineStage]:
        """One torch stage per chunk, with its virtual stage index (r, r + p, ...) out of p * chunks."""
        total = self.module.num_virtual_stages
        return [
            PipelineStage(chunk, chunk.virtual_stage, total, self.device, group=self.pipe.group)
            for chunk in self.module.chunks
        ]

    def _make_schedule(
        self, stages: list[PipelineStage], loss_fn: Any, micro_batches: int | None = None, name: str = ""
    ) -> Any:
        """The configured torch schedule (or `name`) over `stages` (a single-chunk schedule takes the
        one), for `micro_batches` (default: gradient_accumulation_steps)."""
        name = name or self.schedule_name
        chosen: Any = stages if name in MULTI_CHUNK_SCHEDULES else stages[0]
        count = micro_batches or self.micro_batches
        return _SCHEDULES[name](chosen, count, loss_fn=loss_fn, scale_grads=False)

    def _eval_schedule(self, compute_loss: bool, micro_batches: int) -> Any:
        key = (compute_loss, micro_batches)
        if key not in self._eval:
            if self._eval_stages is None:
                self._eval_stages = self._torch_stages()
            loss_fn = self._scaled_loss if compute_loss else None
            name = self.schedule_name
            if micro_batches != self.micro_batches:  # the schedule that runs this count (GPipe below p)
                name = check_schedule(
                    self.pipeline, self.num_stages, self.module.chunks_per_stage, micro_batches
                )
            self._eval[key] = self._make_schedule(self._eval_stages, loss_fn, micro_batches, name)
        return self._eval[key]

    # -- stages ----------------------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # -- data ------------------------------------------------------------------------------------------
    def set_dataloader(self, loader: Any) -> None:
        """Train from `loader` (first and last stage): `train_batch()` and `eval_batch()` without an
        iterator draw from one iterator over it, kept between batches and restarted at the end of the
        data (DeepSpeed's method; a checkpoint saves the loader's position)."""
        self.training_dataloader = loader
        reads = self.is_first_stage() or self.is_last_stage()
        self.data_iterator = RepeatingLoader(loader) if reads else None

    def set_dataiterator(self, iterator: Iterator[Any] | None) -> None:
        """Train from `iterator`: later `train_batch()` calls without one continue it (DeepSpeed's)."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def _read_micro_batches(
        self, data_iter: Iterator[Any] | None, micro_batch_size: int | None = None, count: int = 0
    ) -> tuple[tuple[Any, ...], Any]:
        """This batch's (stage inputs, labels) as whole batches for the schedule to split (first and last
        stage; `runtime.pipe.data` checks them on every rank first)."""
        first, last = self.is_first_stage(), self.is_last_stage()
        batches = read_micro_batches(
            data_iter,
            count=count or self.micro_batches,
            reads=first or last,
            stage_id=self.stage_id,
            device=self.device,
            micro_batch_size=micro_batch_size,
        )
        if not (first or last):
            return (), None
        cast = self.policy.param_dtype if self.policy.cast_inputs else None
        return stage_tensors(batches, first=first, last=last, device=self.device, cast=cast)

    def _next_iterator(self, data_iter: Iterator[Any] | None) -> Iterator[Any] | None:
        """The iterator a batch reads: the one given, else the engine's (from set_dataiterator or the
        loader that runtime.initialize(training_data=...) built)."""
        if data_iter is not None:
            return data_iter
        if self.data_iterator is None and self.training_dataloader is not None:
            self.set_dataloader(self.training_dataloader)
        return self.data_iterator

    # -- training --------------------------------------------------------------------------------------
    def _scaled_loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        module = self.module
        if module.loss_fn is None:
            raise PipelineError("the last stage needs a loss: PipelineModule(..., loss_fn=...)")
        loss = module.loss_fn(outputs, labels)
        self._losses.append(loss.detach().float())
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Run one global batch through the pipeline and step; returns the loss averaged over the
        micro-batches and data-parallel ranks, on every rank."""
        if self.optimizer is None:
            raise PipelineError(
                "train_batch: no optimizer",
                hint='configure one (the config\'s "optimizer" section) or pass optimizer= to initialize',
            )
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        micro = self.config.train_micro_batch_size_per_gpu
        inputs, targets = self._read_micro_batches(self._next_iterator(None), micro)
        self._losses = []
        with explained_oom(self, "forward and backward"):  # the schedule interleaves the micro-batches
            self._schedule.step(*inputs, target=targets, return_outputs=False)
        all_reduce_tied_grads(self.ties)
        math = self._grad_math()
        self._duplicate_squares = None
        if math.needs_norm:
            self._duplicate_squares = duplicate_grad_squares(
                self.ties,
                dp_group=self.comm.group,
                dp_size=self.comm.world_size,
                scale=self._pre_reduce_scale,
                device=self.device,
            )
        # every micro-batch's backward is done: reduce over data once, as at an accumulation boundary
        self.zero.begin_backward(boundary=True)
        self.zero.end_backward(boundary=True)
        loss = self._batch_loss()
        self._log.record_loss(loss)
        self.set_gradient_accumulation_boundary(True)
        try:
            self.step()
        finally:
            self.set_gradient_accumulation_boundary(None)
        self.micro_steps += self.micro_batches - 1  # step() counted one
        return loss

    def _batch_loss(self) -> torch.Tensor:
        """The mean loss of the batch (over micro-batches and data ranks), sent from the last stage."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            # the schedule's first step also runs the loss once on placeholder tensors, to learn the
            # shapes of the gradients: the batch's own losses are the last ones
            loss = torch.stack(self._losses[-self.micro_batches :]).mean().to(self.device)
            if self.comm.world_size > 1:
                dist.all_reduce(loss, group=self.comm.group)
                loss /= self.comm.world_size
        if self.num_stages > 1:
            dist.broadcast(loss, self._last_stage_rank, group=self.pipe.group)
        return loss

    # -- evaluation ------------------------------------------------------------------------------------
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward `gradient_accumulation_steps` micro-batches. Returns the loss (reduce_output="avg": the
        mean over micro-batches and data ranks; None: one value per micro-batch, averaged over data ranks)
        on every rank, or None without compute_loss; with return_logits, (loss, outputs) where outputs are
        the last stage's (None on other stages). Without `data_iter`, the micro-batches come from the
        engine's training iterator (ours: DeepSpeed's eval_batch needs one), which they advance.
        `num_micro_batches`: how many to read instead (DeepSpeed's keyword); `bcast_loss` is accepted, and
        every rank gets the loss either way."""
        if reduce_output not in ("avg", None):
            raise PipelineError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        count = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        if count < 1:
            raise PipelineError(f"eval_batch(num_micro_batches={num_micro_batches}): must be at least 1")
        self.module.eval()
        inputs, targets = self._read_micro_batches(self._next_iterator(data_iter), count=count)
        self._losses = []
        with torch.no_grad():
            schedule = self._eval_schedule(compute_loss, count)
            outputs = schedule.eval(*inputs, target=targets) if compute_loss else schedule.eval(*inputs)
        self.module.train()
        loss = None
        if compute_loss:
            loss = torch.zeros(count, dtype=torch.float32, device=self.device)
            if self.is_last_stage():
                loss = torch.stack(self._losses[-count:]).to(self.device)
                if self.comm.world_size > 1:
                    dist.all_reduce(loss, group=self.comm.group)
                    loss /= self.comm.world_size
            if self.num_stages > 1:
                dist.broadcast(loss, self._last_stage_rank, group=self.pipe.group)
            if reduce_output == "avg":
                loss = loss.mean()
        if return_logits:
            return loss, outputs if self.is_last_stage() else None
        return loss

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Save this stage's training state under save_dir/pipe_stage_SS_of_NN/<tag>; every rank must call
        it. Returns this stage's tag directory."""
        state = dict(client_state or {})
        state[_PARTS_KEY] = list(self.module.parts)
        return super().save_checkpoint(save_dir, tag, state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, dict[str, Any]]:
        """Resume from a pipeline checkpoint saved at the same pipeline degree and partition."""
        path, state = super().load_checkpoint(
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        state = dict(state or {})
        parts = state.pop(_PARTS_KEY, None)
        if parts is not None and list(parts) != list(self.module.parts):
            raise PipelineError(
                f"the checkpoint's stages hold layers {parts} (boundaries) but this module's hold "
                f"{list(self.module.parts)}: build the PipelineModule with the same partition_method"
            )
        return path, state

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise PipelineError("a PipelineEngine runs whole batches: call train_batch() or eval_batch()")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a PipelineEngine runs whole batches: call train_batch(), not backward()")


__all__ = ["PipelineEngine"]
