"""DeepSpeed's accelerator object: one place that answers "which device, which backend, how much memory".

DeepSpeed's examples and Hugging Face's integration call ``get_accelerator().device_name(local_rank)``,
``.communication_backend_name()``, ``.current_device_name()``, ``.empty_cache()`` and similar instead of
naming CUDA. This module gives them one object per device kind, chosen like the rest of the runtime
(`runtime.distributed.accelerator`: ``DS_ACCELERATOR`` = cuda | cpu, else CUDA when torch sees a GPU).
Both kinds share one class: the CUDA answers come from ``torch.cuda``, the CPU answers are what a host
has (one device, gloo, no streams, memory from psutil).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import psutil
import torch

from runtime.distributed import accelerator as _chosen_kind

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]


class Accelerator:
    """DeepSpeed's ``DeepSpeedAccelerator`` interface for "cuda" or "cpu"."""

    def __init__(self, kind: str) -> None:
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"accelerator kind {kind!r}: dslaunch supports 'cuda' and 'cpu'")
        self._name = kind
        self._communication_backend = "nccl" if kind == "cuda" else "gloo"

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"

    # -- identity -------------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """ "cuda" / "cuda:N", or "cpu" (a host is one device whatever the index)."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def device(self, device_index: int | None = None) -> Any:
        """The torch device module's device context (``torch.cuda.device``), or a null context on CPU."""
        return torch.cuda.device(device_index) if self._cuda else contextlib.nullcontext()

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        # DeepSpeed's CPU accelerator counts NUMA nodes as devices; a worker per local rank is what the
        # launcher starts, so the local world size is the honest answer, else one.
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def is_synchronized_device(self) -> bool:
        """True when work runs in program order (CPU): no streams or events to wait for."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def communication_backend_name(self) -> str:
        return self._communication_backend

    def is_triton_supported(self) -> bool:
        return False

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- synchronization, streams, RNG ------------------------------------------------------------------
    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def Stream(self, *args: Any, **kwargs: Any) -> Any:
        if self._cuda:
            return torch.cuda.Stream(*args, **kwargs)
        return None

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def Event(self, **kwargs: Any) -> Any:
        return torch.cuda.Event(**kwargs) if self._cuda else None

    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    # -- memory ---------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        return psutil.Process().memory_info().rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return self.memory_allocated()

    def memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_reserved(device_index)
        return self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.memory_allocated()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            free, _total = torch.cuda.mem_get_info(device_index)
            return free
        return psutil.virtual_memory().available

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index) if self._cuda else {}

    # -- tensor types DeepSpeed code builds with (get_accelerator().FloatTensor(...)) -----------------
    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self._name

        def make(*args: Any) -> torch.Tensor:
            if not args:
                return torch.empty(0, dtype=dtype)
            if len(args) > 1:  # as torch.tensor itself answers
                raise TypeError(f"tensor() takes 1 positional argument but {len(args)} were given")
            return torch.tensor(args[0], dtype=dtype, device=device)

        return make

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.float16)

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.bfloat16)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.int64)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.int32)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.uint8)

    # -- ops: DeepSpeed builds C++/CUDA ops through the accelerator; we have none to build ------------
    def create_op_builder(self, class_name: str) -> Any:
        from runtime.deepspeed_api.unsupported import unsupported

        unsupported(
            f"op builder {class_name!r}",
            "dslaunch compiles no DeepSpeed ops; its CPU Adam and fused Adam are in runtime.ops",
        )

    get_op_builder = create_op_builder

    def op_builder_dir(self) -> str:
        return "runtime.ops"


_current: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """This process's accelerator, chosen once: DS_ACCELERATOR=cuda|cpu, else CUDA when torch sees it."""
    global _current
    if _current is None:
        _current = Accelerator(_chosen_kind())
    return _current


def set_accelerator(accel: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's ``set_accelerator``)."""
    global _current
    if not isinstance(accel, Accelerator):
        raise TypeError(
            "set_accelerator expects a runtime.deepspeed_api.accelerator.Accelerator, "
            f"got {type(accel).__name__}"
        )
    _current = accel
