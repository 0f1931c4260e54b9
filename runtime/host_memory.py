"""Host memory for offloaded model states: CPU tensors, page-locked (pinned) where that helps.

A leaf module (it imports only torch) because two parts allocate from it: optimizer offload
(runtime/offload: masters, Adam state, landing buffers) and ZeRO stage 3's parameter offload
(runtime/zero/stage3.py: the working shards); neither imports the other.

Only buffers that a copy engine reads or writes need pinning. With the CPU step that is the gradient
landing buffer (device to host) and whatever the updated weights are copied back from (host to device):
the landing buffer in bf16/fp16 runs with 16-bit landing, the fp32 master in fp32 runs and with fp32
landing (runtime/offload/plan.py); exp_avg and exp_avg_sq never cross PCIe there, so they stay pageable.
When the GPU runs the step (runtime/offload/step/device_step.py) the master and both moments stream both
ways, and all 12 bytes a parameter are pinned.

Pinning registers an ordinary CPU tensor with the CUDA driver (cudaHostRegister, as torch's own
checkpoint stager does) instead of allocating through torch's pinned caching allocator, which rounds
every block up to a power of two (an 18 GB buffer would take 32 GB). If registering fails, the tensor is
copied into the caching allocator's pinned memory instead, and if that fails too it stays pageable with
a warning: slower copies, same results. Nothing is ever pinned without CUDA.

Owns: allocation, pinning, and releasing the registrations (`close`); and the host room the offload plan
asks for before it pins (`PIN_ROOM_BYTES_PER_PARAM`, `HOST_HEADROOM`), here so that the estimator, which
mirrors the plan's choice, reads the same numbers without importing the offload.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

PIN_ROOM_BYTES_PER_PARAM = 16
"""What "auto" wants available per parameter of the shard before it pins the 12 bytes of state: the same
rule as fp32 landing, so a host that gave the CPU step fp32 landing gives the device step room, and the
largest models keep the CPU step, which pins 2 bytes."""
HOST_HEADROOM = 4 << 30
"""Per rank, what the rest of the process keeps under "auto" (CUDA context, pinned staging, checkpoint
buffers), as the offload bench's own host guard assumes."""


def can_pin(device: torch.device) -> bool:
    """Pinned host memory only helps copies to and from a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


class HostMemory:
    """Allocates host tensors for one engine; pinned ones are released by `close()`."""

    def __init__(self, device: torch.device, *, pin: bool) -> None:
        self.device = device
        self.pin = pin and can_pin(device)
        self._registered: list[torch.Tensor] = []  # tensors whose pages we registered with the driver
        self.pinned_bytes = 0
        self.bytes = 0
        # pages stay locked until unregistered, even after the tensor is freed: release them when this
        # object goes away without close() (the finalizer holds the tensors until then)
        self._finalizer = weakref.finalize(self, _unregister, self._registered)

    def empty(self, numel: int, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        """A 1-D host tensor; page-locked when `pinned` and this allocator pins at all."""
        tensor = torch.empty(numel, dtype=dtype)
        if pinned and self.pin and numel > 0:
            tensor = self._pin(tensor)
        self.bytes += numel * tensor.element_size()
        return tensor

    def zeros(self, numel: int, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        # zero_() touches every page now, so a host that is short of memory fails here, at setup,
        # rather than in the middle of the first step
        return self.empty(numel, dtype, pinned=pinned).zero_()

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 1))  # 1 = cudaHostRegisterPortable
        if error == 0:
            self._registered.append(tensor)
            self.pinned_bytes += nbytes
            return tensor
        _clear_cuda_error(self.device)
        try:
            pinned = tensor.pin_memory()
        except RuntimeError as exc:
            warnings.warn(
                f"offload: could not pin {nbytes / 2**30:.2f} GiB of host memory (cudaHostRegister error "
                f"{error}, pin_memory: {exc}); copies to and from the GPU use pageable memory and are slower",
                stacklevel=3,
            )
            return tensor
        self.pinned_bytes += nbytes
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in page-locked memory: torch's own pinned memory, or pages this allocator
        registered (which `Tensor.is_pinned()` need not report: it asks torch's pinned allocator)."""
        if tensor.is_pinned():
            return True
        start = tensor.data_ptr()
        for held in self._registered:
            base = held.data_ptr()
            if base <= start < base + held.numel() * held.element_size():
                return True
        return False

    def close(self) -> None:
        """Unregister what was pinned; its tensors must not be used for copies afterwards."""
        self._finalizer()


def _unregister(tensors: list[torch.Tensor]) -> None:
    if tensors:
        # a copy still queued (the device step's downloads run past engine.step()) must not write into
        # pages that are no longer registered, or that are freed right after
        with contextlib.suppress(RuntimeError):  # at interpreter exit CUDA may be gone already
            torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        for tensor in tensors:
            cudart.cudaHostUnregister(tensor.data_ptr())
    tensors.clear()


def _clear_cuda_error(device: torch.device) -> None:
    """A failed runtime call leaves its error for the next launch check to report; consume it here."""
    try:
        torch.empty(1, device=device).zero_()
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass
