"""The optimizer's side of ZeRO: which parameters form which group, and an optimizer over master shards.

`collect_param_groups` reads the user's grouping (a client optimizer's param_groups, `model_parameters`
as tensors or torch param-group dicts, or all trainable parameters of the model) into `GroupSpec`s.
`build_shard_optimizer` then builds the optimizer over the flat fp32 master shards, one tensor per group
with the group's options (weight decay etc.) preserved: from the config, from a callable, or by
rebuilding a client optimizer instance with the same class, defaults and per-group options.

Limits: a client optimizer's *state* is not carried over (it is normally empty before training), and
its constructor must accept its own `defaults` as keyword arguments (true for torch.optim classes).
Elementwise optimizers (Adam, AdamW, SGD, ...) give the same result on a flat shard as on the original
tensors. Per-tensor ones (Lamb, Adafactor) would see one flat tensor per group: with an unsharded master
(stage 0 or one rank) they get one view per parameter instead, and with sharding they are refused unless
the config sets zero_allow_untested_optimizer.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn

from runtime.comm import Comm
from runtime.errors import UserError
from runtime.zero.flat import FlatGroup
from runtime.zero.muon_shards import install_orthogonalizers

# Optimizers whose update of an element depends only on that element's history: stepping a flat shard
# equals stepping the original tensors.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
)

OptimizerSource = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class ParameterGroupError(UserError, ValueError):
    """The optimizer's (or model_parameters') groups do not fit the model: a tensor the model does not
    own, one tensor in two groups, nothing to train. Still a ValueError, as it was."""

    hint = "build the optimizer from the model passed to runtime.initialize"


@dataclass
class GroupSpec:
    """One param group before flattening."""

    params: list[nn.Parameter]
    options: dict[str, Any] = field(default_factory=dict)
    source: int = 0  # index of the user's group it came from (groups without trainable params are dropped)
    # torch_autocast.lower_precision_safe_modules: the gradients of `low_params` are reduced in `low_dtype`
    # (the others in the stage's reduce dtype: the weights' or communication_data_type). The stage keeps
    # them in flat groups of their own under this same param group, so checkpoints and the optimizer's
    # hyperparameters see one group, as without the key
    low_params: frozenset[nn.Parameter] = frozenset()
    low_dtype: torch.dtype | None = None

    def wire_parts(self, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
        """`params` (some of this group's, in layout order) as the low-dtype part and the rest, each in
        the same order; empty parts left out."""
        if not self.low_params:
            return [list(params)] if params else []
        low = [p for p in params if p in self.low_params]
        rest = [p for p in params if p not in self.low_params]
        return [part for part in (low, rest) if part]

    def wire_dtype(self, part: Sequence[nn.Parameter]) -> torch.dtype | None:
        """The dtype a part from `wire_parts` is reduced in (None: the stage's)."""
        return self.low_dtype if part and part[0] in self.low_params else None


def collect_param_groups(
    model: nn.Module,
    optimizer: OptimizerSource | None = None,
    model_parameters: Iterable[Any] | None = None,
) -> list[GroupSpec]:
    """The param groups to flatten, with frozen parameters dropped and duplicates refused."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raw = [
            GroupSpec(list(g["params"]), {k: v for k, v in g.items() if k != "params"})
            for g in optimizer.param_groups
        ]
    elif model_parameters is not None:
        items = list(model_parameters)
        if items and all(isinstance(item, dict) for item in items):
            raw = [
                GroupSpec(_as_list(d["params"]), {k: v for k, v in d.items() if k != "params"}) for d in items
            ]
        elif all(isinstance(item, torch.Tensor) for item in items):
            raw = [GroupSpec(items)]
        else:
            raise TypeError(
                "model_parameters must be an iterable of tensors or of param-group dicts, not a mix"
            )
    else:
        raw = [GroupSpec([p for p in model.parameters() if p.requires_grad])]

    owned = {p for p in model.parameters()}
    seen: set[nn.Parameter] = set()
    groups: list[GroupSpec] = []
    for index, spec in enumerate(raw):
        params = []
        for param in spec.params:
            if param not in owned:
                given = (
                    "the optimizer's" if isinstance(optimizer, torch.optim.Optimizer) else "model_parameters'"
                )
                raise ParameterGroupError(
                    f"{given} param group {index} holds a tensor of shape {tuple(param.shape)} that is not "
                    "a parameter of the model given to runtime.initialize",
                    hint="build the optimizer (or model_parameters) from the same model object you pass as "
                    "model=, e.g. torch.optim.AdamW(model.parameters()), after any change that replaces "
                    "its layers",
                )
            if param in seen:
                raise ParameterGroupError(
                    f"a parameter of shape {tuple(param.shape)} appears in more than one param group",
                    hint="list each parameter in one param group only",
                )
            seen.add(param)
            if param.requires_grad:
                params.append(param)
        if params:
            groups.append(GroupSpec(params, spec.options, index))
    left_out = [p for p in model.parameters() if p.requires_grad and p not in seen]
    if left_out:
        warnings.warn(
            f"{len(left_out)} trainable parameters of the model are in no param group: the engine will not "
            "update them (set requires_grad=False on them, or include them)",
            stacklevel=3,
        )
    if not groups:
        raise ParameterGroupError(
            "no trainable parameters: every parameter has requires_grad=False or none were given",
            hint="set requires_grad=True on the parameters to train (a frozen reference model needs no "
            'optimizer: leave optimizer and the config\'s "optimizer" section out)',
        )
    return groups


def split_muon_specs(specs: Sequence[GroupSpec], split: Mapping[nn.Parameter, bool]) -> list[GroupSpec]:
    """Each param group as a Muon group and an AdamW group (`use_muon` in the options; an empty one left
    out), so that ZeRO flattens them apart and every flat group has one kind of update."""
    out: list[GroupSpec] = []
    for spec in specs:
        for muon in (True, False):
            chosen = [p for p in spec.params if split.get(p, False) == muon]
            if chosen:
                out.append(GroupSpec(chosen, {**spec.options, "use_muon": muon}, spec.source))
    return out


def with_low_dtype(specs: Sequence[GroupSpec], low: set[nn.Parameter], dtype: torch.dtype) -> list[GroupSpec]:
    """`specs` with the parameters in `low` marked to reduce their gradients in `dtype` (the stage then
    flattens them apart: `GroupSpec.wire_parts`), so every flat group, and so every bucket, has one wire
    dtype."""
    out = []
    for spec in specs:
        mine = frozenset(p for p in spec.params if p in low)
        out.append(replace(spec, low_params=mine, low_dtype=dtype if mine else None))
    return out


def inference_param_groups(model: nn.Module, *, shard_frozen: bool) -> list[GroupSpec]:
    """The groups of an engine built without an optimizer (DeepSpeed's inference engine: a frozen
    reference model through `initialize(model=..., config=...)`). At ZeRO stage 3 (`shard_frozen`) every
    parameter, frozen or not, is sharded and gathered for forward, as DeepSpeed does; at stages 0-2 the
    trainable ones form one group and frozen ones stay plain tensors on the device. No optimizer is
    built over them, so an empty list (all frozen, stages 0-2) is fine here."""
    params = list(model.parameters())  # each shared parameter once
    chosen = params if shard_frozen else [p for p in params if p.requires_grad]
    return [GroupSpec(chosen)] if chosen else []


def _as_list(params: Any) -> list[nn.Parameter]:
    """A param group's "params": one tensor, or any iterable of them (torch accepts both)."""
    if isinstance(params, torch.Tensor):
        return [cast(nn.Parameter, params)]
    return list(params)


def master_param_groups(groups: Sequence[FlatGroup], *, per_tensor: bool) -> list[dict[str, Any]]:
    """torch param-group dicts over the master shards: one flat tensor per group, or one view per parameter
    (per_tensor, only for unsharded masters)."""
    out = []
    for group in groups:
        if per_tensor:
            params = [
                _master_view(group, param, slot.offset, slot.numel)
                for param, slot in zip(group.params, group.layout.slots, strict=True)
            ]
        else:
            params = [group.master]
        out.append({"params": params, **group.options})
    return out


def _master_view(group: FlatGroup, param: nn.Parameter, offset: int, numel: int) -> nn.Parameter:
    return nn.Parameter(group.master.data.narrow(0, offset, numel).view(param.shape))


def rebuild_client_optimizer(
    client: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A new optimizer of the client's class, defaults and per-group options, over `groups`."""
    cls = type(client)
    if client.state:
        warnings.warn(
            f"the client {cls.__name__} already has state (was it stepped?); "
            "the engine rebuilds it on the fp32 "
            "master shards and starts with empty state",
            stacklevel=3,
        )
    try:
        return cls(groups, **_constructor_kwargs(cls, client.defaults))
    except TypeError as error:
        raise TypeError(
            f"cannot rebuild the client optimizer {cls.__name__} on the ZeRO master shards with "
            f"{cls.__name__}(param_groups, **defaults): {error}. Pass a callable optimizer=lambda params: "
            f"{cls.__name__}(params, ...) or configure the optimizer in the config instead"
        ) from error


def _constructor_kwargs(cls: type[Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults the constructor takes (torch's AdamW records decoupled_weight_decay but refuses it)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, ELEMENTWISE_OPTIMIZERS)


def build_shard_optimizer(
    groups: Sequence[FlatGroup],
    build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    *,
    sharded: bool,
    allow_untested: bool,
    comm: Comm | None = None,
) -> tuple[torch.optim.Optimizer, bool]:
    """Build the optimizer over the master shards; returns it and whether it got per-parameter views.
    `comm` (the ranks the shards split over) lets Muon orthogonalize whole matrices from shards."""
    optimizer = build(master_param_groups(groups, per_tensor=False))
    if is_elementwise(optimizer):
        return optimizer, False
    if not sharded:
        per_tensor = build(master_param_groups(groups, per_tensor=True))
        if hasattr(per_tensor, "newton_schulz_device") and groups:
            # Muon over offloaded masters: Newton-Schulz on the training device, not the host's cores
            per_tensor.newton_schulz_device = groups[0].working.device
        return per_tensor, True
    if comm is not None and hasattr(optimizer, "orthogonalizers"):  # Muon: runtime/zero/muon_shards.py
        install_orthogonalizers(optimizer, groups, comm)
        return optimizer, False
    if allow_untested:
        return optimizer, False
    raise ValueError(
        f"{type(optimizer).__name__} is not an elementwise optimizer, so stepping it on flat ZeRO "
        "shards changes its results (it computes per-tensor quantities); use stage 0, an elementwise "
        'optimizer (Adam, AdamW, SGD, ...), or set "zero_allow_untested_optimizer": true to accept that'
    )
