"""Small helpers DeepSpeed scripts import from ``deepspeed.utils``, ``deepspeed.runtime.utils`` and
``deepspeed.checkpoint.utils``.

The logger (DeepSpeed's is named "DeepSpeed"; Trainer sets its level), ``log_dist`` (log on chosen
ranks only), ``set_random_seed`` (Python's, numpy's and torch's generators at once, as DeepSpeed seeds
them; it lives in `runtime.parallel.rng`, beside the random streams), ``RepeatingLoader`` (restart a
loader at its end; `runtime.pipe.data`, the pipeline's loader) and ``clone_tensors_for_torch_save``
(copies that do not drag a whole flat buffer into the file); ``zero_to_fp32``'s functions live in
`runtime.checkpoint.fp32_state`. They are ordinary runtime utilities; the compat package only gives them
DeepSpeed's names.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

# where they live (seeding beside the random streams, the loader with the pipeline's data); named here for
# deepspeed.utils and deepspeed.runtime.utils
from runtime.parallel.rng import set_random_seed
from runtime.pipe.data import RepeatingLoader

__all__ = [
    "RepeatingLoader",
    "clone_tensors_for_torch_save",
    "log_dist",
    "logger",
    "print_rank_0",
    "set_random_seed",
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
