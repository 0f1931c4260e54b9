"""Small helpers DeepSpeed scripts import from ``deepspeed.utils`` and ``deepspeed.checkpoint.utils``.

The logger (DeepSpeed's is named "DeepSpeed"; Trainer sets its level), ``log_dist`` (log on chosen
ranks only), ``RepeatingLoader`` (restart a loader at its end) and ``clone_tensors_for_torch_save``
(copies that do not drag a whole flat buffer into the file) and ``zero_to_fp32``'s functions over
`runtime.checkpoint.consolidate`. They are ordinary runtime utilities; the
compat package only gives them DeepSpeed's names.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RepeatingLoader",
    "clone_tensors_for_torch_save",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "log_dist",
    "logger",
    "print_rank_0",
]


def _make_logger() -> logging.Logger:
    log = logging.getLogger("DeepSpeed")
    if not log.handlers:  # one handler, even when this module is reloaded
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(
            logging.Formatter(
                "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"
            )
        )
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the listed ranks (None or [-1]: every rank), prefixed with the rank."""
    chosen = list(ranks) if ranks is not None else [-1]
    rank = _rank()
    if -1 in chosen or rank in chosen:
        logger.log(level, f"[Rank {rank}] {message}")


def print_rank_0(message: str) -> None:
    if _rank() == 0:
        print(message, flush=True)


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
            if epoch is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch + 1)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of `item` (tensors inside dicts, lists and tuples) whose tensors own exactly their
    elements on `device`: torch.save of a view writes the whole storage behind it (a flat buffer)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


# -- zero_to_fp32: a checkpoint (ours or DeepSpeed's) as one fp32 state dict (runtime.checkpoint) ----------
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, **_: Any
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint directory (the tag `latest` names unless `tag`): ours,
    DeepSpeed's, or a pipeline root. DeepSpeed's `lazy_mode` is accepted; tensors are always real."""
    from runtime.checkpoint.fp32_state import fp32_state_dict

    return fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Write the fp32 weights as DeepSpeed does: `output_dir`/pytorch_model.bin (model.safetensors with
    safe_serialization), split with an index JSON above max_shard_size; an `output_dir` ending in .bin, .pt,
    .pth or .safetensors is one file. Returns the files written."""
    from runtime.checkpoint.portable_cli import write_state_dict

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    files = write_state_dict(
        state, output_dir, safe_serialization=safe_serialization, max_shard_size=max_shard_size
    )
    return [str(f) for f in files]


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None
) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (on the CPU) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
