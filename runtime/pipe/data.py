"""The pipeline's data: DeepSpeed's data-iterator contract, checked on every rank, and the loader that
`runtime.initialize(training_data=...)` builds for a `PipelineModule`.

Each `next(data_iter)` is one micro-batch `(inputs, labels)` of `train_micro_batch_size_per_gpu` samples
(of this data-parallel rank); a batch reads `gradient_accumulation_steps` of them. Only the first stage
(inputs) and the last (labels) read; middle stages may have no iterator. Everything is read before any
compute, and one all-reduce tells every rank whether the readers got it all (a missing iterator, one
that runs out, a micro-batch of another size, something that is not a pair): each rank then raises the
same `PipelineError` instead of waiting forever for a stage that failed alone.

The loader is DeepSpeed's (`PipelineEngine._build_data_iter`): a sampler over the grid's DATA-parallel
ranks (the stages of one pipeline read the same samples), in order (no shuffle), batches of the micro-batch
size, repeating at the end of the data (the engine reads it through a `RepeatingLoader`, defined here, a new
epoch each time; the loader itself is what checkpoints save the position of). Ours drops a short last
micro-batch of an epoch, which a pipeline cannot run (its stages' buffers have the micro-batch's shape),
where DeepSpeed's drops it only with "dataloader_drop_last".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from runtime.checkpoint.data_position import ResumableDataLoader, ResumableSampler
from runtime.pipe.config import PipelineError


def read_micro_batches(
    data_iter: Iterator[Any] | None,
    *,
    count: int,
    reads: bool,
    stage_id: int,
    device: torch.device,
    micro_batch_size: int | None = None,
) -> list[Any]:
    """`count` micro-batches from `data_iter` where this rank `reads`, after every rank has learnt that
    the readers got all of them (and, with `micro_batch_size`, all of that size); a collective."""
    batches: list[Any] = []
    problem = ""
    wrong_size = 0  # the first micro-batch size that is not micro_batch_size
    if reads:
        if data_iter is None:
            problem = (
                "no data iterator: pass train_batch(data_iter) / eval_batch(data_iter) on the first and "
                "last stage, or give runtime.initialize(training_data=...)"
            )
        elif not hasattr(data_iter, "__next__"):
            # DeepSpeed calls next() on it too; a list or a DataLoader would start over at every batch
            what = type(data_iter).__name__
            problem = (
                f"the data iterator is a {what}, not an iterator: pass iter(...) of it (each next() is one "
                "micro-batch), or deepspeed.utils.RepeatingLoader(...) to go round it again"
            )
        else:
            for _ in range(count):
                try:
                    batches.append(next(data_iter))
                except StopIteration:
                    break
            try:
                wrong_size = _wrong_size(batches, micro_batch_size)
            except PipelineError as error:  # told to every rank below, so none waits for this one
                problem = str(error)
    status = torch.tensor(  # on the device: NCCL reduces only device tensors
        [-1 if problem else len(batches) if reads else count, -wrong_size], dtype=torch.int64, device=device
    )
    dist.all_reduce(status, op=dist.ReduceOp.MIN)  # every rank learns it before any compute starts
    read, wrong_size = int(status[0]), -int(status[1])
    if problem:
        raise PipelineError(f"stage {stage_id}: {problem}")
    if read < 0:
        raise PipelineError(
            "the first or the last stage could not read this batch's micro-batches (its rank says why: no "
            "data iterator, or not (inputs, labels) pairs)"
        )
    if read < count:
        raise PipelineError(
            f"the data iterator ran out after {read} of {count} micro-batches (gradient_accumulation_steps) "
            "of this batch",
            hint="give every batch all of its micro-batches (deepspeed.utils.RepeatingLoader restarts a "
            "loader at its end)",
        )
    if wrong_size:
        raise PipelineError(
            f"the data iterator gave a micro-batch of {wrong_size} samples, but "
            f"train_micro_batch_size_per_gpu is {micro_batch_size}",
            hint="make each next(data_iter) one micro-batch of train_micro_batch_size_per_gpu samples per "
            'data-parallel rank (a DataLoader\'s batch_size; "dataloader_drop_last": true drops a short '
            "last one)",
        )
    return batches


def stage_tensors(
    batches: list[Any], *, first: bool, last: bool, device: torch.device, cast: torch.dtype | None
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """(inputs for the first stage, labels for the last) as whole batches the schedule splits back into
    micro-batches; floating-point inputs cast to `cast` where given."""
    inputs, labels = zip(*(split_batch(b) for b in batches), strict=True)
    stage_inputs: tuple[torch.Tensor, ...] = ()
    if first:
        stage_inputs = concat(inputs, device)
        if cast is not None:
            stage_inputs = tuple(t.to(cast) if t.is_floating_point() else t for t in stage_inputs)
    targets: Any = concat(labels, device) if last else None
    if targets is not None and len(targets) == 1:
        targets = targets[0]
    return stage_inputs, targets


def split_batch(batch: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A micro-batch as (inputs, labels), each a tuple of tensors."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise PipelineError(
            f"each micro-batch must be a pair (inputs, labels), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    inputs, labels = batch
    as_tuple = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x,)  # noqa: E731
    return as_tuple(inputs), as_tuple(labels)


def _wrong_size(batches: list[Any], micro_batch_size: int | None) -> int:
    """The first dim-0 size among the micro-batches' tensors that is not `micro_batch_size` (0: none);
    checks that each micro-batch is a pair."""
    for batch in batches:
        inputs, labels = split_batch(batch)
        sizes = {t.shape[0] for t in inputs + labels if isinstance(t, torch.Tensor) and t.dim()}
        if micro_batch_size is not None and sizes - {micro_batch_size}:
            return min(sizes - {micro_batch_size})
    return 0


def concat(parts: tuple[tuple[torch.Tensor, ...], ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Micro-batches -> one batch per tensor position (the schedule splits it back into equal chunks)."""
    sizes = {t.shape[0] for part in parts for t in part}
    if len(sizes) > 1:
        raise PipelineError(f"micro-batches must have the same size along dim 0, got sizes {sorted(sizes)}")
    return tuple(torch.cat(column).to(device) for column in zip(*parts, strict=True))


def pipeline_dataloader(
    dataset: torch.utils.data.Dataset,
    config: Any,
    grid: Any,
    *,
    collate_fn: Callable[..., Any] | None = None,
) -> Any:
    """DeepSpeed's pipeline loader over `dataset`: this data-parallel rank's samples in order, micro-batch
    sized (a `ResumableDataLoader`, whose position checkpoints save; the engine repeats it)."""
    sampler = ResumableSampler(
        dataset,
        num_replicas=grid.get_data_parallel_world_size(),
        rank=grid.get_data_parallel_rank(),
        shuffle=False,
        drop_last=config.dataloader_drop_last,
    )
    loader = ResumableDataLoader(
        dataset,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=True,
    )
    if len(loader) == 0:
        raise PipelineError(
            f"training_data has {len(dataset)} samples: too few for one micro-batch of "  # type: ignore[arg-type]
            f"{config.train_micro_batch_size_per_gpu} on each of {grid.get_data_parallel_world_size()} "
            "data-parallel ranks"
        )
    return loader


class RepeatingLoader:
    """Iterate over `loader` forever, starting it again (a new epoch) each time it runs out."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            sampler = getattr(self.loader, "sampler", None)
            epoch = getattr(sampler, "epoch", None)
            set_epoch = getattr(sampler, "set_epoch", None)
            if epoch is not None and set_epoch is not None:
                set_epoch(epoch + 1)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


__all__ = [
    "RepeatingLoader",
    "concat",
    "pipeline_dataloader",
    "read_micro_batches",
    "split_batch",
    "stage_tensors",
]
