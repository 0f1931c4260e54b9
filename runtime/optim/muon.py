"""Muon for 2-D hidden weights and AdamW for every other parameter, as one optimizer (DeepSpeed's "Muon").

Which parameters Muon updates (`muon_split`): a parameter's own `use_muon` attribute when it has one (True
or False, as DeepSpeed tags them), else every 2-D parameter that is neither an `nn.Embedding`'s weight nor
named like an embedding or the output head ("embed", "wte", "wpe", "lm_head" in its name). Everything else
(embeddings, the head, norms, biases) gets AdamW with the section's `adam_lr`, `betas`, `eps`.

The Muon update is torch.optim.Muon's, term for term (its Newton-Schulz iteration and learning-rate
adjustment are reused): momentum `buf.lerp_(g, 1 - momentum)`, the Nesterov blend `g.lerp(buf, momentum)`,
the orthogonalized matrix O, decoupled decay `p *= 1 - lr * weight_decay`, `p -= adjusted_lr * O`.
Everything but O is elementwise, so it runs on whatever tensor holds the parameter: a 2-D parameter, or a
flat ZeRO master shard. O needs the whole matrix; a param group's `Orthogonalizer` (installed per group by
ZeRO, runtime/zero/muon_shards.py) says where each matrix's O comes from. Without one, a Muon parameter must
be 2-D and is its own matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from runtime.errors import UserError
from runtime.precision.master_adam import MasterAdam

MUON_NAME_EXCLUDES = ("embed", "wte", "wpe", "lm_head")
"""Names of 2-D parameters that stay on AdamW by default: embeddings and the output head."""


class MuonSplitError(UserError, ValueError):
    """Muon cannot be applied to this model as asked."""

    hint = 'use type "AdamW", or mark 2-D hidden weights with param.use_muon = True'


NewtonSchulz = Callable[[torch.Tensor], torch.Tensor]
# One piece of an orthogonalized update: (offset into the flat tensor, numel, O's elements, matrix shape).
UpdatePiece = tuple[int, int, torch.Tensor, torch.Size]


class Orthogonalizer(Protocol):
    def __call__(self, update: torch.Tensor, newton_schulz: NewtonSchulz) -> list[UpdatePiece]:
        """O for every matrix element held in `update` (this rank's flat shard of a group's momentum
        update), as pieces of that flat tensor; every rank of the group calls it together."""
        ...


def uses_muon(name: str, param: torch.Tensor, embedding_weights: set[int]) -> bool:
    """The split rule (module docstring); `embedding_weights` holds the ids of nn.Embedding weights."""
    tagged = getattr(param, "use_muon", None)
    if tagged is not None:
        return bool(tagged)
    if param.ndim != 2 or id(param) in embedding_weights:
        return False
    return not any(part in name.lower() for part in MUON_NAME_EXCLUDES)


def muon_split(model: nn.Module) -> dict[nn.Parameter, bool]:
    """Each trainable parameter of `model` -> whether Muon updates it; refuses a model with no Muon
    parameter, and a parameter tagged `use_muon` that is not 2-D."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out: dict[nn.Parameter, bool] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        muon = uses_muon(name, param, embedding)
        if muon and param.ndim != 2:
            raise MuonSplitError(
                f"optimizer.type Muon: parameter {name} is tagged use_muon but has shape "
                f"{tuple(param.shape)}; Muon orthogonalizes 2-D matrices only",
                hint=f"set {name}.use_muon = False (AdamW then updates it) or reshape it to 2-D",
            )
        if muon and (
            getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
        ):
            raise MuonSplitError(
                f"optimizer.type Muon: parameter {name} is split over the model-parallel group, and Muon "
                "orthogonalizes whole matrices",
                hint=f"set {name}.use_muon = False (AdamW updates it) or train without model parallelism",
            )
        out[param] = muon
    if out and not any(out.values()):
        raise MuonSplitError(
            "optimizer.type Muon: the model has no 2-D hidden weight for Muon to update (every trainable "
            "parameter is 1-D, an embedding or the output head)"
        )
    return out


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon on the param groups with `use_muon: True`, AdamW on the others (module docstring)."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        ns_eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        adam_lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
    ) -> None:
        groups = list(params)
        for group in groups:
            if "use_muon" not in group:
                raise ValueError("MuonWithAuxAdam: every param group needs a use_muon entry")
            if not group["use_muon"]:
                # the AdamW groups carry their own lr; torch's AdamW reads these keys from each group
                group.setdefault("lr", adam_lr)
                group.setdefault("weight_decay", weight_decay)
                group.update({k: v for k, v in _ADAMW_KEYS.items() if k not in group})
                group.setdefault("betas", tuple(betas))
                group.setdefault("eps", eps)
                group.setdefault("fused", fused)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            ns_eps=ns_eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(groups, defaults)
        # group index -> where its matrices' O comes from (ZeRO shards); not state: rebuilt with the engine
        self.orthogonalizers: dict[int, Orthogonalizer] = {}
        # where an unsharded matrix is orthogonalized (None: where it is): the training device when the
        # masters live in host memory (offload_optimizer); the sharded ones' orthogonalizers do the same
        self.newton_schulz_device: torch.device | None = None
        self.stochastic_rounding = False  # bf16 masters: round_masters
        self._steps = 0  # the noise key's step where no AdamW state counts them
        # steps our AdamW groups over our state (with bf16 masters and stochastic rounding: MasterAdam)
        self._adam: torch.optim.Adam = torch.optim.AdamW([torch.zeros(1)])
        self._rounder: MasterAdam | None = None  # that MasterAdam, whose rounding the Muon update uses

    def round_masters(self, state_dtype: torch.dtype, stochastic_rounding: bool) -> None:
        """bf16 masters (bf16.bf16_master_weights_and_grads): with stochastic rounding, each Muon update is
        computed in fp32 and rounded stochastically into the bf16 master (runtime.precision.master_adam's
        rounding, so updates below half a bf16 ulp survive on average), and the AdamW groups step with
        `MasterAdam` (moments in `state_dtype`); without it, torch's updates round to nearest."""
        if not stochastic_rounding:
            return
        self.stochastic_rounding = True
        self._adam = self._rounder = MasterAdam(
            [torch.zeros(1, dtype=torch.bfloat16)], state_dtype=state_dtype
        )

    def state_keys(self, group_index: int) -> tuple[str, ...]:
        """The state tensors a param group keeps (checkpoint loading reads only these for it)."""
        if self.param_groups[group_index]["use_muon"]:
            return ("momentum_buffer",)
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adam_groups:
            self._adam.param_groups = adam_groups
            self._adam.state = self.state
            self._adam.step()
        self._steps = self._step_count(adam_groups)
        for index, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._muon_group(index, group)
        return loss

    def _step_count(self, adam_groups: list[dict[str, Any]]) -> int:
        """This step's number: the AdamW state's count where there is one (checkpointed, so a resumed run
        rounds as the unbroken one), else one more than the last."""
        for group in adam_groups:
            for param in group["params"]:
                step = self.state.get(param, {}).get("step")
                if torch.is_tensor(step):
                    return int(step.item())
        return self._steps + 1

    def _muon_group(self, index: int, group: dict[str, Any]) -> None:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        orthogonalize = self.orthogonalizers.get(index)

        def newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
            return _zeropower_via_newtonschulz(
                matrix, group["ns_coefficients"], group["ns_steps"], group["ns_eps"]
            )

        for position, param in enumerate(group["params"]):
            # (ZeRO attaches a gradient to a group's master on every rank or on none, as partial offload's
            # two sides step their own groups: the orthogonalizer's collectives stay in step)
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buf = state["momentum_buffer"]
            grad = param.grad
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            if orthogonalize is not None:
                pieces = orthogonalize(update.reshape(-1), newton_schulz)
            else:
                if param.ndim != 2:
                    raise ValueError(f"Muon updates 2-D parameters only, got shape {tuple(param.shape)}")
                device = self.newton_schulz_device or update.device
                ortho = newton_schulz(update.to(device)).to(update.device)
                pieces = [(0, param.numel(), ortho.reshape(-1), param.shape)]
            if self.stochastic_rounding and param.dtype == torch.bfloat16:
                # the noise key: Muon's parameters after the AdamW ones (keyed by their own positions)
                self._rounded_update(
                    param, 1 - lr * decay, pieces, group, (1 << 20) + (index << 12) + position
                )
                continue
            param.mul_(1 - lr * decay)
            flat = param.view(-1)
            for offset, numel, ortho, shape in pieces:
                flat.narrow(0, offset, numel).add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))

    def _rounded_update(
        self, param: torch.Tensor, keep: float, pieces: list[UpdatePiece], group: dict[str, Any], key: int
    ) -> None:
        """`param * keep - adjusted lr * O` in fp32, rounded stochastically into the bf16 `param`, one
        chunk at a time (the fp32 temporaries stay chunk-sized whatever the shard's size)."""
        flat = param.view(-1)
        size = 1 << 16 if param.device.type == "cpu" else 1 << 24
        for chunk, start in enumerate(range(0, flat.numel(), size)):
            end = min(flat.numel(), start + size)
            work = flat[start:end].float().mul_(keep)
            for offset, numel, ortho, shape in pieces:
                low, high = max(offset, start), min(offset + numel, end)
                if low < high:
                    alpha = -_adjust_lr(group["lr"], group["adjust_lr_fn"], shape)
                    work[low - start : high - start].add_(ortho[low - offset : high - offset], alpha=alpha)
            assert self._rounder is not None  # round_masters set it with stochastic_rounding
            self._rounder.round_into(flat[start:end], work, self._steps, key, chunk)


_ADAMW_KEYS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "decoupled_weight_decay": True,
}
