"""What a ZeRO-3 parameter looks like while its values live only as shards across ranks.

A *released* parameter keeps its Python object, shape, dtype, device and requires_grad, but holds no
memory: its data is a stride-0 view of one shared NaN element, and its class is switched to
`ShardedParameter` (a subclass of `nn.Parameter`). The class does three things:

- metadata (shape, numel, dtype, device, requires_grad, grad, hooks, ...) keeps working, so code that only
  counts or inspects parameters is unaffected;
- any computation on it asks the parameter's *owner* (the engine's gather unit, or `zero.Init`) whether it
  can be gathered right here (inside a module forward driven by the engine, or inside zero.Init); if not,
  it raises `ParamNotGathered` with the parameter's name and what to do, instead of computing on empty
  data (DeepSpeed users get silently empty saved weights and shape-[0] surprises there);
- `module.to(...)`, `.cpu()`, `.float()`... that change neither dtype nor device keep the parameter as it
  is (Lightning's precision plugin and teardown apply them to every model); one that would change them is
  refused in one line: the shards keep the dtype and device they were made with.

Gathering switches the class back and points the data at the real values. Owners are kept in a
weak-identity dictionary (parameter -> owner), not as attributes stuck on the tensor. If code somehow
reads a released parameter's data without going through torch functions, it reads NaN, never freed memory.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's `param.ds_status`, which RL code reads (TRL gathers a head only when it is not
    AVAILABLE): kept on every parameter that `release` or `materialize` touched."""

    AVAILABLE = 1  # gathered: the full tensor is here
    NOT_AVAILABLE = 2  # sharded: only this rank's slice is here
    INFLIGHT = 3  # being gathered


class ParamNotGathered(RuntimeError):
    """A ZeRO-3 sharded parameter was used where its values are not available."""


class ParamOwner(Protocol):
    """Whoever holds a released parameter's shards."""

    def param_name(self, param: nn.Parameter) -> str: ...

    def touch(self, param: nn.Parameter) -> contextlib.AbstractContextManager[None] | None:
        """A context in which `param` is gathered for one operation, or None when that is not possible
        here (the caller then raises ParamNotGathered)."""
        ...


_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # nn.Parameter -> weakref to its ParamOwner
_CLASSES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # nn.Parameter -> its class while gathered
_SENTINELS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

# Tensor attributes and methods that read metadata only; everything else needs the values.
_METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mps", "is_xpu", "names",
        "output_nr", "_version", "_base", "itemsize", "nbytes", "_backward_hooks",
        "_post_accumulate_grad_hooks", "__dict__", "__class__",
        "size", "dim", "numel", "nelement", "ndimension", "element_size", "is_floating_point",
        "is_complex", "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "_is_view", "data_ptr", "untyped_storage", "storage_offset", "stride", "is_contiguous",
        "__hash__", "__len__", "__format__", "_typed_storage", "is_shared", "is_pinned",
        "_has_compatible_shallow_copy_type",
    }
)  # fmt: skip
_METADATA_SETTERS = frozenset({"requires_grad", "grad", "_backward_hooks", "_post_accumulate_grad_hooks"})


def _func_name(func: Callable[..., Any]) -> tuple[str, bool]:
    """(name, is_setter) of a torch function; property accessors report the property's name."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name), name != "__get__"
    return name, False


# Tensor conversions that nn.Module.to / .cpu / .float (and Lightning's precision plugin) apply to every
# parameter, and the dtype each implies.
_CONVERSIONS = {
    "to": None, "cpu": None, "float": torch.float32, "double": torch.float64, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}  # fmt: skip
_NOT_A_CONVERSION = object()


def _conversion(name: str, is_setter: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A conversion of a sharded parameter that changes nothing returns the parameter itself, and
    nn.Module._apply's `param.data = param` that follows is a no-op; one that changes the dtype or device
    is refused in one line (the shards keep the dtype and device they were made with)."""
    param = args[0] if args else None
    if type(param) is not ShardedParameter:
        return _NOT_A_CONVERSION
    if is_setter:  # `param.data = value`
        return None if len(args) == 2 and args[1] is param else _NOT_A_CONVERSION
    device, dtype = param.device, _CONVERSIONS[name]
    if name == "to":
        with torch._C.DisableTorchFunctionSubclass():
            parsed_device, parsed_dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        if parsed_device is not None:
            device = torch.device(parsed_device)
        dtype = parsed_dtype
    elif name == "cpu":
        device = torch.device("cpu")
    same_device = device.type == param.device.type and device.index in (None, param.device.index)
    if same_device and dtype in (None, param.dtype):
        return param
    raise ParamNotGathered(
        f"{describe(param)} is sharded by ZeRO stage 3 (zero.Init or the engine) as {param.dtype} on "
        f"{param.device}; converting it to {dtype or param.dtype} on {device} after sharding is not "
        "supported: build the model in the dtype you train in (zero.Init(dtype=...), or the config's "
        "bf16/fp16 section, which the engine applies), on the engine's device"
    )


class ShardedParameter(nn.Parameter):
    """The class of a parameter whose values are sharded across ranks and not gathered here."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, is_setter = _func_name(func)
        if (name in _METADATA and not is_setter) or (is_setter and name in _METADATA_SETTERS):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in _CONVERSIONS or (name == "data" and is_setter):
            converted = _conversion(name, is_setter, args, kwargs)
            if converted is not _NOT_A_CONVERSION:
                return converted
        released = [a for a in tree_flatten((args, kwargs))[0] if type(a) is ShardedParameter]
        with contextlib.ExitStack() as stack:
            for param in released:
                if type(param) is not ShardedParameter:  # gathered by an earlier one (same unit)
                    continue
                owner = owner_of(param)
                context = owner.touch(param) if owner is not None else None
                if context is None:
                    if name == "detach" and len(released) == 1:
                        # module.state_dict() detaches every parameter; code that only wants the keys
                        # and shapes (Transformers' from_pretrained under ZeRO-3) gets the parameter
                        # itself, still sharded: reading its values, or saving it, still raises.
                        return param
                    raise ParamNotGathered(not_gathered_message(param, f"torch operation {name!r}"))
                stack.enter_context(context)
            return func(*args, **kwargs)

    # nn.Parameter's own __repr__ already drops Tensor's keyword-only argument: the stubs disagree
    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ShardedParameter({describe(self)}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            "not gathered: values are sharded across ranks by ZeRO stage 3)"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        owner = owner_of(self)
        context = owner.touch(self) if owner is not None else None
        if context is None:
            raise ParamNotGathered(not_gathered_message(self, "copy.deepcopy"))
        with context:
            return _gathered_class(self).__deepcopy__(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ParamNotGathered(not_gathered_message(self, "pickling/torch.save"))


def describe(param: nn.Parameter) -> str:
    owner = owner_of(param)
    return f"parameter {owner.param_name(param)!r}" if owner is not None else "a parameter"


def not_gathered_message(param: nn.Parameter, action: str) -> str:
    return (
        f"{describe(param)} (shape {tuple(param.shape)}) is sharded across ranks by ZeRO stage 3 and is not "
        f"gathered here, so {action} cannot read its values. Modules gather their own parameters when "
        "called; to read or change parameters outside a forward use `with "
        "runtime.zero.GatheredParameters(params, modifier_rank=...)` (all ranks), and to save the model "
        "use engine.full_state_dict() or engine.save_16bit_model() (all ranks)"
    )


def _gathered_class(param: nn.Parameter) -> type[nn.Parameter]:
    return _CLASSES.get(param, nn.Parameter)


def sentinel(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` that holds no memory of its own: every element is one shared NaN (or 0)."""
    key = (dtype, device)
    base = _SENTINELS.get(key)
    if base is None:
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        base = torch.full((1,), fill, dtype=dtype, device=device)
        _SENTINELS[key] = base
    return base.expand(shape) if len(shape) else base.view(())


def register(param: nn.Parameter, owner: ParamOwner) -> None:
    """Make `owner` responsible for gathering `param` when it is touched while released. The registry
    holds the owner weakly: owners keep their parameters alive, so a strong reference would keep every
    model ever wrapped alive."""
    _OWNERS[param] = weakref.ref(owner)


def unregister(param: nn.Parameter) -> None:
    _OWNERS.pop(param, None)


def owner_of(param: torch.Tensor) -> ParamOwner | None:
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


def is_released(param: torch.Tensor) -> bool:
    return type(param) is ShardedParameter


def release(
    param: nn.Parameter, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> None:
    """Drop `param`'s values (they live on as shards elsewhere): NaN view, ShardedParameter class.
    `dtype`/`device` are what the parameter reports from now on (default: unchanged)."""
    if type(param) is ShardedParameter:
        return
    if type(param) is not nn.Parameter:
        _CLASSES[param] = type(param)
    param.data = sentinel(param.shape, dtype or param.dtype, device or param.device)
    param.__class__ = ShardedParameter
    set_ds_attributes(param, ds_status=ZeroParamStatus.NOT_AVAILABLE)


def materialize(param: nn.Parameter, data: torch.Tensor) -> None:
    """Point `param` at real values (`data` has its shape) and give it its normal class back."""
    if type(param) is ShardedParameter:
        param.__class__ = _gathered_class(param)  # type: ignore[assignment]  # a class switch, by design
    param.data = data
    set_ds_attributes(param, ds_status=ZeroParamStatus.AVAILABLE)


def set_ds_attributes(target: nn.Module | torch.Tensor, **attributes: object) -> None:
    """Set DeepSpeed's `ds_*` attributes on a parameter or module: names DeepSpeed-facing code reads
    (`ds_status`, `ds_id`, ...; runtime.zero.hook_control), which no torch type declares."""
    for name, value in attributes.items():
        setattr(target, name, value)


@contextlib.contextmanager
def guard_disabled() -> Iterator[None]:
    """Let our own code read released parameters' metadata through any torch function."""
    with torch._C.DisableTorchFunctionSubclass():
        yield
