"""The `torch_autocast` section and the refusals of 16-bit model-state combinations.

Owns `TorchAutocastConfig` (DeepSpeed's keys: `enabled`, `dtype`, `lower_precision_safe_modules`) and
`check_low_precision`, which looks at the bf16, fp16, torch_autocast, zero and optimizer sections at once
and refuses, with the key path first, what DeepSpeed refuses or what we do not build:

- bf16 masters or bf16 optimizer states without `bf16.enabled` (they are 16-bit copies of bf16 weights);
- bf16 optimizer states with fp32 masters (the moments follow the masters' dtype or are fp32, as in
  DeepSpeed, where the moments of fp32 masters are fp32);
- bf16 masters at ZeRO stage 0 (DeepSpeed builds them in its ZeRO optimizers only);
- stochastic rounding for an optimizer other than Adam/AdamW and Muon (the remedy lives in their updates),
  and fp32 states for one other than Adam/AdamW (torch's optimizers, and Muon's momentum, keep their
  state in the parameters' dtype);
- torch_autocast in another dtype than the fp16 or bf16 section's (DeepSpeed runs autocast beside
  either section since its low-precision master states), and autocast to float16 without the fp16
  section (it needs that section's loss scaler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.config.checks import Bool, Choice
from runtime.config.reader import ConfigError, SectionReader, describe

# DeepSpeed's default: the module types whose matmuls autocast runs in the low dtype anyway
DEFAULT_SAFE_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
}


@dataclass(frozen=True)
class TorchAutocastConfig:
    enabled: bool = False
    dtype: str = "bfloat16"  # the torch dtype's name
    lower_precision_safe_modules: tuple[str, ...] = DEFAULT_SAFE_MODULES


def read_torch_autocast(r: SectionReader) -> TorchAutocastConfig:
    dtype = r.get("dtype", Choice(tuple(_DTYPES)), "bfloat16")
    cfg = TorchAutocastConfig(
        enabled=r.get("enabled", Bool(), False),
        dtype=_DTYPES[dtype],
        lower_precision_safe_modules=r.get(
            "lower_precision_safe_modules", _ModuleNames(), DEFAULT_SAFE_MODULES
        ),
    )
    r.finish()
    return cfg


@dataclass(frozen=True)
class _ModuleNames:
    """A list of dotted class names ("torch.nn.Linear"); whether each imports is checked by the engine."""

    def __call__(self, path: str, value: Any) -> tuple[str, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(
                path, f'expected a list of module class names like "torch.nn.Linear", got {describe(value)}'
            )
        return tuple(value)


def check_low_precision(
    bf16: Any, fp16: Any, autocast: TorchAutocastConfig, zero_stage: int, optimizer_type: str | None
) -> None:
    """Refuse the 16-bit state and autocast combinations above (each a one-line ConfigError)."""
    masters, states = bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states
    for key, on in (("bf16_master_weights_and_grads", masters), ("bf16_optimizer_states", states)):
        if on and not bf16.enabled:
            raise ConfigError(
                f"bf16.{key}",
                "keeps 16-bit copies of bf16 weights and needs bf16.enabled true",
                hint='set "bf16": {"enabled": true, ...} or remove the key',
            )
    if states and not masters:
        raise ConfigError(
            "bf16.bf16_optimizer_states",
            "needs bf16.bf16_master_weights_and_grads true too: fp32 master weights keep fp32 moments",
            hint='add "bf16_master_weights_and_grads": true to the bf16 section',
        )
    if masters and zero_stage == 0:
        raise ConfigError(
            "bf16.bf16_master_weights_and_grads",
            "needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0), as in DeepSpeed",
            hint='set "zero_optimization": {"stage": 1} or higher',
        )
    adam = optimizer_type in (None, "Adam", "AdamW")  # None: a client optimizer, checked at build
    if masters and bf16.stochastic_rounding and not (adam or optimizer_type == "Muon"):
        raise ConfigError(
            "bf16.stochastic_rounding",
            f"is built into the Adam/AdamW and Muon updates only, not {optimizer_type}",
            hint=f'set "stochastic_rounding": false to step {optimizer_type} on bf16 masters with '
            "round-to-nearest (small updates are lost), or use AdamW or Muon",
        )
    if masters and not states and not adam:
        raise ConfigError(
            "bf16.bf16_optimizer_states",
            f"false, but {optimizer_type} keeps its state in its parameters' dtype, bf16 with bf16 masters "
            "(only Adam/AdamW keep fp32 moments beside bf16 masters here)",
            hint='set "bf16_optimizer_states": true, or use AdamW',
        )
    if not autocast.enabled:
        return
    # DeepSpeed (since its low-precision master states) runs autocast beside a bf16 or fp16 section: the
    # weights are 16-bit and autocast keeps its fp32 ops (softmax, norms, losses) in fp32; the dtypes agree
    for name, section, dtype in (("bf16", bf16, "bfloat16"), ("fp16", fp16, "float16")):
        if section.enabled and autocast.dtype != dtype:
            raise ConfigError(
                "torch_autocast.dtype",
                f"{autocast.dtype!r} with {name}.enabled: autocast must run in the weights' dtype, {dtype!r}",
                hint=f'set "dtype": "{dtype}", or turn torch_autocast off',
            )
    if fp16.enabled:
        return  # fp16's loss scaler scales the autocast forward's loss
    if autocast.dtype != "bfloat16":
        raise ConfigError(
            "torch_autocast.dtype",
            f"{autocast.dtype!r} is not supported: float16 autocast needs a loss scaler that dslaunch's "
            "autocast runs without the fp16 section do not have",
            hint='use "bfloat16", or enable the fp16 section too (its loss scaler then scales the loss)',
        )
