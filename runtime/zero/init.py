"""`runtime.zero.Init`: build a model with its parameters sharded as it is built.

    with runtime.zero.Init(config_dict_or_path=ds_config):
        model = GPT(config)                    # never whole on one rank
    engine, *_ = runtime.initialize(model=model, config=ds_config)

How (and why this way): every module initializes its parameters as usual, on the real device, with the
real RNG stream. The moment a finished module is registered as a child of another module (a global
module-registration hook; `__exit__` catches the top-level module), each parameter of its subtree is
sharded: rank r keeps the r-th 1/N slice of the flattened parameter (zero-padded) and the parameter is
released (stage3_param). So at any time a rank holds the shards built so far plus the full parameters of
the one module under construction: the largest module, not the model.

Parents often touch their children's parameters after building them (GPT's `init_weights` re-initializes
every weight, HF models tie weights). Inside the context a TorchFunctionMode catches any torch function
that reaches a sharded parameter, gathers it, runs the function on the full tensor and keeps this rank's
slice of the result. Initializers that overwrite every element (normal_, zeros_, kaiming_uniform_, ...)
skip the gather. Every rank runs the same construction code with the same seed, so all ranks compute the
same full values and keeping a slice needs no communication.

Effect on parity: the values are bit-identical to building the model without Init (same code, same RNG
draws, in the same order, on full tensors); only where they are stored differs. `dtype` (default: keep
the creation dtype) stores the shards in another dtype; the fp32 master weights are then built from the
rounded values, as in DeepSpeed. Code that touches parameters inside the context must run on every rank
(a gather is a collective). With one rank Init does nothing: a shard would be the whole parameter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from runtime.comm import Comm
from runtime.config import read_config_file
from runtime.distributed import current_device, init_distributed
from runtime.zero import stage3_param
from runtime.zero.stage3_param import ShardedParameter, _func_name

_log = logging.getLogger("runtime.zero.init")

# torch functions that overwrite every element of their first tensor argument: no need to gather first
_OVERWRITES = frozenset(
    {
        "normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "trunc_normal_",
        "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_",
        "eye_", "dirac_", "sparse_", "random_",
    }
)  # fmt: skip


@dataclass
class InitShard:
    """This rank's slice of one parameter built under zero.Init."""

    local: torch.Tensor  # ceil(numel / world_size) elements; the tail of the last slice is padding
    numel: int
    comm: Comm
    name: str

    def gather(self) -> torch.Tensor:
        """The full flattened parameter (a collective: every rank must call it)."""
        world_size = self.comm.world_size
        flat = torch.empty(self.local.numel() * world_size, dtype=self.local.dtype, device=self.local.device)
        self.comm.all_gather(flat, self.local)
        return flat[: self.numel]

    def keep_slice_of(self, full: torch.Tensor) -> None:
        """Store this rank's slice of `full` (every rank holds the same full values)."""
        chunk = self.local.numel()
        start = self.comm.rank * chunk
        end = min(start + chunk, self.numel)
        flat = full.detach().reshape(-1)
        with torch.no_grad():
            self.local.zero_()
            if start < end:
                self.local[: end - start].copy_(flat[start:end])


_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # nn.Parameter -> InitShard
_ACTIVE: list[Init] = []  # Init contexts entered and not exited, innermost last


class _InitOwner:
    """stage3_param.ParamOwner for parameters sharded by zero.Init (before the engine adopts them)."""

    def param_name(self, param: nn.Parameter) -> str:
        shard = _SHARDS.get(param)
        return shard.name if shard is not None else "?"

    def touch(self, param: nn.Parameter) -> contextlib.AbstractContextManager[None] | None:
        if not _ACTIVE:
            return None
        return _gathered_for_op([param], overwrite=False)


_OWNER = _InitOwner()


class Init:
    """Shard parameters across the data-parallel ranks while modules are built (see module docstring).

    Args:
        module: an already built module to shard now (instead of, or besides, using the context).
        data_parallel_group: the process group to shard over (default: the whole world).
        config_dict_or_path / config: the run's config; it must ask for ZeRO stage 3.
        enabled: False makes this a no-op (build normally).
        dtype: dtype of the shards (default: the dtype each parameter was created with).
        remote_device: None/"none", or "cpu" (DeepSpeed's parameter offload at construction): the
            shards are built on `device` as without it, and the engine moves them to the host when the
            config's zero_optimization.offload_param asks for it; "nvme" is refused.
        pin_memory: accepted with remote_device="cpu" (the engine pins its own host buffers).
        device: where shards live (default: this rank's device); construction also happens there.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        config_dict_or_path: str | os.PathLike | Mapping[str, Any] | None = None,
        config: str | os.PathLike | Mapping[str, Any] | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        remote_device: str | None = None,
        pin_memory: bool = False,
        device: torch.device | str | None = None,
        mpu: Any = None,
    ) -> None:
        self.enabled = enabled
        if not enabled:
            return
        if config_dict_or_path is not None and config is not None:
            raise ValueError("zero.Init got both config_dict_or_path and config; pass one of them")
        _check_config(config_dict_or_path if config_dict_or_path is not None else config)
        if remote_device not in (None, "none", "cpu"):
            raise NotImplementedError(
                f"zero.Init(remote_device={remote_device!r}): only 'cpu' parameter offload is available "
                '(NVMe offload is not); use remote_device="cpu" with offload_param.device "cpu"'
            )
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): model parallelism is not supported")
        if not dist.is_initialized():  # as in DeepSpeed: Init creates the group from the environment
            init_distributed()
        self.comm = Comm(data_parallel_group)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else current_device()
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._stack = contextlib.ExitStack()
        if module is not None:
            self.shard_module(module)

    # -- sharding ---------------------------------------------------------------------------------
    def shard_module(self, module: nn.Module) -> None:
        """Shard every parameter of `module`'s subtree that is not sharded yet."""
        if not self.enabled or self.comm.world_size == 1:
            return
        for name, param in module.named_parameters(remove_duplicate=True):
            self._shard(param, f"{type(module).__name__}.{name}")

    def _shard(self, param: nn.Parameter, name: str) -> None:
        if param in _SHARDS or stage3_param.is_released(param) or stage3_param.owner_of(param) is not None:
            return
        world_size = self.comm.world_size
        dtype = self.dtype or param.dtype
        local = torch.zeros(-(-param.numel() // world_size), dtype=dtype, device=self.device)
        shard = InitShard(local, param.numel(), self.comm, name)
        shard.keep_slice_of(param.detach())
        _SHARDS[param] = shard
        stage3_param.register(param, _OWNER)
        stage3_param.release(param, dtype=dtype, device=self.device)

    # -- the context ------------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled or self.comm.world_size == 1:
            return self
        stack = self._stack
        stack.callback(module_hooks.register_module_module_registration_hook(self._on_child).remove)
        stack.callback(module_hooks.register_module_parameter_registration_hook(self._on_param).remove)
        if self.device.type != "cpu":
            stack.enter_context(torch.device(self.device))
        stack.enter_context(_InitMode())
        _ACTIVE.append(self)
        stack.callback(_ACTIVE.remove, self)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled or self.comm.world_size == 1:
            return
        try:
            if exc[0] is None:  # the top-level modules were never registered as anyone's child
                for module in list(self._modules):
                    self.shard_module(module)
        finally:
            self._stack.close()
            self._modules = weakref.WeakSet()

    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None:  # its __init__ is done: shard its whole subtree
            self.shard_module(child)

    def _on_param(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            self._modules.add(module)


class _InitMode(TorchFunctionMode):
    """Inside zero.Init: torch functions that reach sharded parameters run on gathered full tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, is_setter = _func_name(func)
        if not is_setter and name in stage3_param._METADATA:
            return func(*args, **kwargs)
        params = [a for a in tree_flatten((args, kwargs))[0] if type(a) is ShardedParameter and a in _SHARDS]
        if not params:
            return func(*args, **kwargs)
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        overwrite = name in _OVERWRITES and len(params) == 1 and params[0] is target
        with _gathered_for_op(params, overwrite=overwrite):
            return func(*args, **kwargs)


@contextlib.contextmanager
def _gathered_for_op(params: Iterable[nn.Parameter], *, overwrite: bool) -> Iterator[None]:
    """Gather Init-sharded `params` (or only allocate them when the op overwrites them), run the body,
    then keep this rank's slice of their new values and release them again."""
    done: list[tuple[nn.Parameter, InitShard]] = []
    try:
        for param in params:
            shard = _SHARDS[param]
            if any(param is p for p, _ in done):
                continue
            if overwrite:
                full = torch.empty(param.shape, dtype=shard.local.dtype, device=shard.local.device)
            else:
                full = shard.gather().view(param.shape).clone()
            stage3_param.materialize(param, full)
            done.append((param, shard))
        yield
    finally:
        for param, shard in done:
            if param.numel() != shard.numel:
                raise RuntimeError(
                    f"{shard.name} changed size inside zero.Init ({shard.numel} -> {param.numel()} "
                    "elements); replace the parameter instead of resizing its data"
                )
            shard.keep_slice_of(param.detach())
            stage3_param.release(param)


# -- used by the engine when it adopts a model built under Init -------------------------------------------
def is_init_sharded(param: nn.Parameter) -> bool:
    return param in _SHARDS


def full_value(param: nn.Parameter, device: torch.device) -> torch.Tensor:
    """`param`'s full values on `device`: gathered when Init sharded it (a collective), else its data."""
    shard = _SHARDS.get(param)
    if shard is None:
        return param.detach().to(device)
    return shard.gather().view(param.shape).to(device)


def forget(param: nn.Parameter) -> None:
    """The engine owns `param` now: drop its Init shard."""
    if _SHARDS.pop(param, None) is not None:
        stage3_param.unregister(param)


def materialize_params(params: Iterable[nn.Parameter], comm: Comm | None = None) -> int:
    """Give Init-sharded `params` their full values for good (every rank, in the same order); returns
    how many were gathered. Used for frozen parameters and for stages that do not shard parameters."""
    count = 0
    for param in params:
        shard = _SHARDS.get(param)
        if shard is None:
            continue
        full = shard.gather().view(param.shape).clone()
        forget(param)
        stage3_param.materialize(param, full)
        count += 1
    return count


def shard_comm(param: nn.Parameter) -> Comm | None:
    shard = _SHARDS.get(param)
    return shard.comm if shard is not None else None


def gather_params(params: Iterable[nn.Parameter]) -> None:
    """Give Init-sharded `params` their full values until `release_params` (GatheredParameters)."""
    for param in params:
        shard = _SHARDS[param]
        stage3_param.materialize(param, shard.gather().view(param.shape).clone())


def release_params(params: Iterable[nn.Parameter], *, keep_changes: bool) -> None:
    """Undo `gather_params`; with keep_changes each rank first stores its slice of the current values."""
    for param in params:
        if keep_changes:
            _SHARDS[param].keep_slice_of(param.detach())
        stage3_param.release(param)


def shard_bytes() -> int:
    """Bytes of all Init shards alive in this process (for memory checks)."""
    return sum(s.local.numel() * s.local.element_size() for s in _SHARDS.values())


def _check_config(source: str | os.PathLike | Mapping[str, Any] | None) -> None:
    if source is None:
        return
    if isinstance(source, (str, os.PathLike)):
        source = read_config_file(source)
    zero = source.get("zero_optimization", {}) if isinstance(source, Mapping) else {}
    if not isinstance(zero, Mapping):
        zero = {"stage": int(bool(zero))}
    stage = zero.get("stage", 0)
    if stage != 3:
        raise ValueError(
            f"zero.Init shards parameters for ZeRO stage 3, but the config has zero_optimization.stage "
            f"{stage!r}; build the model without zero.Init or set stage 3"
        )
    offload = zero.get("offload_param") or {}
    # "cpu": the shards are built on the device and the engine moves them to the host when it adopts them
    if isinstance(offload, Mapping) and offload.get("device") not in (None, "none", "cpu"):
        raise NotImplementedError(
            f"zero.Init with zero_optimization.offload_param.device={offload.get('device')!r} is not "
            'available (NVMe offload is not supported); use "cpu"'
        )
