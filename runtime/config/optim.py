"""The `optimizer` and `scheduler` sections: type names, their DeepSpeed parameter names and defaults.

The checked parameters are stored complete (every default filled in), so `runtime.optim` builds from
them without its own defaults and the resolved config in the log shows exactly what ran.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.config.checks import Bool, Choice, Float, FloatOrList, FloatPair, Int, Str
from runtime.config.reader import ConfigError, FrozenDict, ReadContext, SectionReader, freeze


@dataclass(frozen=True)
class OptimizerConfig:
    type: str  # canonical: "Adam" | "AdamW" | "Lamb" | "SGD" | "Muon"
    params: Mapping[str, Any] = field(default_factory=FrozenDict)  # read-only


@dataclass(frozen=True)
class SchedulerConfig:
    type: str  # "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" | "OneCycle"
    params: Mapping[str, Any] = field(default_factory=FrozenDict)  # read-only


OPTIMIZER_TYPES = ("Adam", "AdamW", "Lamb", "SGD", "Muon")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")

# DeepSpeed (and the torch.optim fallback DeepSpeed offers) names we recognise but do not implement.
_UNSUPPORTED_OPTIMIZERS = (
    "Adagrad",
    "Lion",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    "Adadelta",
    "Adafactor",
    "Adamax",
    "ASGD",
    "LBFGS",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SparseAdam",
)
_UNSUPPORTED_SCHEDULERS = (
    "LRRangeTest",
    "StepLR",
    "MultiStepLR",
    "ExponentialLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "OneCycleLR",
    "LambdaLR",
    "LinearLR",
    "ConstantLR",
    "PolynomialLR",
    "ReduceLROnPlateau",
)


def _canonical_type(
    r: SectionReader, supported: tuple[str, ...], unsupported: tuple[str, ...], what: str
) -> str:
    path = r.key_path("type")
    name = r.get("type", Str(), None)
    if name is None:
        raise ConfigError(path, f"missing; the {what} type is one of {', '.join(supported)}")
    by_lower = {s.lower(): s for s in supported}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    if name.lower() in {u.lower() for u in unsupported}:
        raise ConfigError(path, f'{what} "{name}" is not supported yet; supported: {", ".join(supported)}')
    guess = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f'did you mean "{by_lower[guess[0]]}"? ' if guess else ""
    raise ConfigError(path, f'unknown {what} "{name}"; {hint}supported: {", ".join(supported)}')


def _refuse_max_grad_norm(p: SectionReader) -> None:
    if "max_grad_norm" in p.data:
        raise ConfigError(
            p.key_path("max_grad_norm"),
            'gradient clipping is the top-level "gradient_clipping" key, not an optimizer parameter',
        )


def _adam_params(p: SectionReader, type_name: str) -> dict[str, Any]:
    params = {
        "lr": p.get("lr", Float(0.0), 1e-3),
        "betas": p.get("betas", FloatPair(), (0.9, 0.999)),
        "eps": p.get("eps", Float(0.0), 1e-8),
        "weight_decay": p.get("weight_decay", Float(0.0), 0.0),
        "amsgrad": p.get("amsgrad", Bool(), False),
        # DeepSpeed's default: "Adam" applies decoupled weight decay (AdamW) unless adam_w_mode is false.
        "adam_w_mode": p.get("adam_w_mode", Bool(), True),
        "torch_adam": p.get("torch_adam", Bool(), False),  # always torch here; accepted for compatibility
    }
    if type_name == "AdamW" and not params["adam_w_mode"]:
        raise ConfigError(
            p.key_path("adam_w_mode"), 'false contradicts type "AdamW"; use type "Adam" for L2 decay'
        )
    p.default_only("bias_correction", True, "Adam without bias correction")
    return params


def _lamb_params(p: SectionReader) -> dict[str, Any]:
    params = {
        "lr": p.get("lr", Float(0.0), 1e-3),
        "betas": p.get("betas", FloatPair(), (0.9, 0.999)),
        "eps": p.get("eps", Float(0.0), 1e-8),
        "weight_decay": p.get("weight_decay", Float(0.0), 0.0),
        "bias_correction": p.get("bias_correction", Bool(), True),
        "max_coeff": p.get("max_coeff", Float(0.0), 10.0),
        "min_coeff": p.get("min_coeff", Float(0.0), 0.01),
        "eps_inside_sqrt": p.get("eps_inside_sqrt", Bool(), False),
    }
    if params["min_coeff"] > params["max_coeff"]:
        raise ConfigError(
            p.key_path("min_coeff"), f"{params['min_coeff']} is larger than max_coeff ({params['max_coeff']})"
        )
    p.default_only("amsgrad", False, "AMSGrad for Lamb")
    return params


def _sgd_params(p: SectionReader) -> dict[str, Any]:
    params = {
        "lr": p.get("lr", Float(0.0), 1e-3),
        "momentum": p.get("momentum", Float(0.0), 0.0),
        "dampening": p.get("dampening", Float(0.0), 0.0),
        "weight_decay": p.get("weight_decay", Float(0.0), 0.0),
        "nesterov": p.get("nesterov", Bool(), False),
    }
    if params["nesterov"] and (params["momentum"] <= 0 or params["dampening"] != 0):
        raise ConfigError(p.key_path("nesterov"), "Nesterov momentum needs momentum > 0 and dampening 0")
    return params


def _muon_params(p: SectionReader) -> dict[str, Any]:
    """Muon's keys (DeepSpeed's names; `muon_lr` is DeepSpeed's other name for `lr`) and the AdamW keys of
    the parameters Muon does not update (runtime/optim/muon.py says which)."""
    lr = p.get("lr", Float(0.0), None)
    muon_lr = p.get("muon_lr", Float(0.0), None)
    if lr is not None and muon_lr is not None and lr != muon_lr:
        raise ConfigError(p.key_path("muon_lr"), f"{muon_lr} contradicts lr ({lr}); give one of them")
    lr = muon_lr if muon_lr is not None else (0.02 if lr is None else lr)
    return {
        "lr": lr,
        "momentum": p.get("momentum", Float(0.0, 1.0), 0.95),
        "weight_decay": p.get("weight_decay", Float(0.0), 0.0),
        "nesterov": p.get("nesterov", Bool(), True),
        "ns_steps": p.get("ns_steps", Int(1, 99), 5),
        "adjust_lr_fn": p.get("adjust_lr_fn", Choice(("original", "match_rms_adamw")), "original"),
        "adam_lr": p.get("adam_lr", Float(0.0), 1e-3),
        "betas": p.get("betas", FloatPair(), (0.9, 0.999)),
        "eps": p.get("eps", Float(0.0), 1e-8),
    }


def read_optimizer(r: SectionReader) -> OptimizerConfig:
    type_name = _canonical_type(r, OPTIMIZER_TYPES, _UNSUPPORTED_OPTIMIZERS, "optimizer")
    p = r.section("params")
    _refuse_max_grad_norm(p)
    if type_name in ("Adam", "AdamW"):
        params = _adam_params(p, type_name)
    elif type_name == "Lamb":
        params = _lamb_params(p)
    elif type_name == "Muon":
        params = _muon_params(p)
    else:
        params = _sgd_params(p)
    p.finish()
    r.ignored("legacy_fusion", False, "no fused legacy path")
    r.finish()
    return OptimizerConfig(type_name, freeze(params))


# ---------------------------------------------------------------------------------------------------------
# Schedulers


def _required(p: SectionReader, key: str, value: Any, why: str) -> Any:
    path = p.key_path(key)
    if value is None and not any(path == u for u, _ in p.ctx.unresolved_auto):
        raise ConfigError(path, f"required: {why}")
    return value


def _warmup_params(p: SectionReader) -> dict[str, Any]:
    def min_lr_auto() -> float:
        p.ctx.note(f'{p.key_path("warmup_min_lr")}: "auto" resolved to 0.0 (as HF Trainer fills it)')
        return 0.0

    def max_lr_auto() -> None:
        p.ctx.note(f'{p.key_path("warmup_max_lr")}: "auto" resolved to the optimizer\'s lr')

    return {
        "warmup_min_lr": p.get("warmup_min_lr", FloatOrList(Float(0.0)), 0.0, auto=min_lr_auto),
        # None = the optimizer's lr (DeepSpeed 0.19.8's WarmupLR default).
        "warmup_max_lr": p.get(
            "warmup_max_lr", FloatOrList(Float(0.0, nullable=True)), None, auto=max_lr_auto
        ),
        "warmup_num_steps": p.get("warmup_num_steps", Int(1), 1000),
        "warmup_type": p.get("warmup_type", Choice(("log", "linear")), "log"),
        "last_batch_iteration": p.get("last_batch_iteration", Int(-1), -1),
    }


def _check_total_after_warmup(p: SectionReader, params: dict[str, Any]) -> None:
    total, warmup = params["total_num_steps"], params["warmup_num_steps"]
    if total is not None and total < warmup:
        raise ConfigError(
            p.key_path("total_num_steps"),
            f"{total} is less than warmup_num_steps ({warmup}); the decay would never run",
        )


def _one_cycle_params(p: SectionReader) -> dict[str, Any]:
    params = {
        "cycle_min_lr": p.get("cycle_min_lr", Float(0.0), None),
        "cycle_max_lr": p.get("cycle_max_lr", Float(0.0), None),
        "decay_lr_rate": p.get("decay_lr_rate", Float(0.0), 0.0),
        "cycle_first_step_size": p.get("cycle_first_step_size", Int(1), 2000),
        "cycle_second_step_size": p.get("cycle_second_step_size", Int(1, nullable=True), None),
        "cycle_first_stair_count": p.get("cycle_first_stair_count", Int(0), 0),
        "cycle_second_stair_count": p.get("cycle_second_stair_count", Int(0, nullable=True), None),
        "decay_step_size": p.get("decay_step_size", Int(0), 0),
        "cycle_momentum": p.get("cycle_momentum", Bool(), True),
        "cycle_min_mom": p.get("cycle_min_mom", Float(0.0, 1.0), 0.8),
        "cycle_max_mom": p.get("cycle_max_mom", Float(0.0, 1.0), 0.9),
        "decay_mom_rate": p.get("decay_mom_rate", Float(0.0), 0.0),
        "last_batch_iteration": p.get("last_batch_iteration", Int(-1), -1),
    }
    _required(
        p, "cycle_min_lr", params["cycle_min_lr"], "the learning rate at the start and end of the cycle"
    )
    _required(p, "cycle_max_lr", params["cycle_max_lr"], "the learning rate at the top of the cycle")
    lo, hi = params["cycle_min_lr"], params["cycle_max_lr"]
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(p.key_path("cycle_min_lr"), f"{lo} is larger than cycle_max_lr ({hi})")
    if params["cycle_min_mom"] > params["cycle_max_mom"]:
        raise ConfigError(
            p.key_path("cycle_min_mom"),
            f"{params['cycle_min_mom']} is larger than cycle_max_mom ({params['cycle_max_mom']})",
        )
    return params


def read_scheduler(r: SectionReader) -> SchedulerConfig:
    type_name = _canonical_type(r, SCHEDULER_TYPES, _UNSUPPORTED_SCHEDULERS, "scheduler")
    p = r.section("params")
    if type_name == "OneCycle":
        params = _one_cycle_params(p)
    elif type_name == "WarmupCosineLR":
        params = {
            "total_num_steps": p.get("total_num_steps", Int(1), None),
            "warmup_min_ratio": p.get("warmup_min_ratio", Float(0.0, 1.0), 0.0),
            "warmup_num_steps": p.get("warmup_num_steps", Int(1), 1000),
            "cos_min_ratio": p.get("cos_min_ratio", Float(0.0, 1.0), 1e-4),
            "warmup_type": p.get("warmup_type", Choice(("log", "linear")), "log"),
            "last_batch_iteration": p.get("last_batch_iteration", Int(-1), -1),
        }
        _required(
            p, "total_num_steps", params["total_num_steps"], "WarmupCosineLR decays to cos_min_ratio by then"
        )
        _check_total_after_warmup(p, params)
    else:
        params = _warmup_params(p)
        if type_name == "WarmupDecayLR":
            params["total_num_steps"] = p.get("total_num_steps", Int(1), None)
            _required(
                p, "total_num_steps", params["total_num_steps"], "WarmupDecayLR reaches lr 0 at that step"
            )
            _check_total_after_warmup(p, params)
            if "warmup_max_lr" not in p.data:
                p.ctx.note(
                    f"{p.key_path('warmup_max_lr')}: not set, using the optimizer's lr "
                    "(DeepSpeed's WarmupDecayLR uses 0.001 here)"
                )
    p.finish()
    r.finish()
    return SchedulerConfig(type_name, freeze(params))


# ---------------------------------------------------------------------------------------------------------
# Standalone checks, for configs built in code rather than loaded


def _standalone(kind: str, type_name: str, params: Mapping[str, Any]) -> SectionReader:
    ctx = ReadContext()
    return SectionReader({"type": type_name, "params": dict(params)}, kind, ctx)


def resolve_optimizer_config(config: OptimizerConfig) -> OptimizerConfig:
    """Check an OptimizerConfig made in code and fill in its defaults (idempotent on loaded ones)."""
    r = _standalone("optimizer", config.type, config.params)
    out = read_optimizer(r)
    r.ctx.raise_pending()
    return out


def resolve_scheduler_config(config: SchedulerConfig) -> SchedulerConfig:
    """Check a SchedulerConfig made in code and fill in its defaults (idempotent on loaded ones)."""
    r = _standalone("scheduler", config.type, config.params)
    out = read_scheduler(r)
    r.ctx.raise_pending()
    return out
