"""FP8 training: which linear layers run their matmuls in float8, and the swap through torchao.

Owns the module-selection rule (`select_linears`, a pure function of the model and the `fp8` section) and
`convert_model`, which the engine calls once on the user's model before ZeRO groups and flattens its
parameters. torchao's `Float8Linear` keeps `weight` and `bias` as the same bf16 Parameters the plain
`nn.Linear` had (it casts them to float8 inside each forward, with dynamic scales), so the ZeRO stages, the
optimizer and checkpoints see the same parameters and state-dict keys as without fp8: a checkpoint written
in fp8 training loads into a bf16 run and back.

A model may arrive with torchao's `Float8Linear`s already in it: Accelerate's `mixed_precision="fp8"`
(its torchao backend) converts the model in `accelerator.prepare` before it calls `deepspeed.initialize`.
`adopt_converted` keeps those layers as they are, with one repair: Accelerate asks torchao for FSDP2's
float8 all-gather by default, and torchao then wraps each converted weight in a new Parameter (a tensor
subclass that FSDP2's all-gather hooks into), while the optimizer the user built before `prepare` still
holds the weight it wraps. ZeRO gathers and flattens plain tensors, so the wrapped Parameter goes back in
its place: the optimizer's, as with no conversion. The `fp8` section, if on too, converts only the
layers that are not float8 yet.

The rule (a linear stays in bf16 for the first reason that applies, in this order):

1. `excluded`: its module name matches one of `fp8.exclude_modules` (fnmatch patterns; a pattern also
   matches any module below a matched name, so "blocks.0" keeps all of block 0);
2. `tied to an embedding`: its weight is an `nn.Embedding`'s (a tied LM head: the embedding lookup would
   see the same tensor, and float8 gains nothing there);
3. `output head`: it projects onto a vocabulary (out_features equals an embedding's num_embeddings), or is
   called `lm_head` / `output`: the logits feed a softmax over the whole vocabulary, the layer float8 hurts
   most (torchtitan keeps it in bf16 for the same reason);
4. `dims not divisible by 16`: float8 matmul kernels need both dims multiples of 16;
5. `smaller than min_features`: a dim under `fp8.min_features` costs more in casts than it saves;
6. `below float8's break-even`: with `fp8.auto_filter_small_kn` (on by default), a shape that torchao's
   published H100 tables show no faster in float8 for the recipe (`below_break_even`): with tensorwise
   scales K <= 4096 and N <= 1024 (K the input, N the output features); with rowwise scales N <= 2048,
   K <= 1024, or N <= 4096 with K <= 2048 (`rowwise_with_gw_hp` too: its forward and input gradient are
   rowwise's, its weight gradient bf16 in any layer). Those matmuls are too small for the faster kernel to
   pay for the casts and scale reductions around it. Except: such a layer converts when a sibling does
   (`shares_input`: a linear of the same parent module with the same input width that converts, as the
   query projection is to a grouped-query model's key and value projections, Llama-3.2-3B's 3072 -> 1024).
   Siblings of one width almost always read one input, whose amax and cast compiled code computes once,
   so the small layer pays only for its weight's and its gradient's casts: on the 3B Llama compiled, the
   key and value projections in float8 made a step 0.6% faster and 2 GiB smaller (BENCHMARKS.md, issue
   33). The guess is by shape, not by tracing: an attention's output projection has the hidden width too,
   so it counts as the key and value projections' sibling; where the guess is wrong (a cross-attention's
   keys, or q_proj alone excluded) the layer runs at break-even, neither faster nor much slower.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.config import ConfigError
from runtime.config.fp8 import DIM_MULTIPLE, FP8Config
from runtime.errors import UserError
from runtime.log import ensure_handler

_log = logging.getLogger(__name__)

HEAD_NAMES = frozenset({"lm_head", "output"})
_BELOW = "below float8's"  # rule 6's reason starts so


@dataclass(frozen=True)
class Selection:
    """The rule's answer: module names converted to float8, and those kept in bf16 with the reason."""

    converted: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (module name, reason)
    already: tuple[str, ...] = ()  # Float8Linears the model came with (`adopt_converted`): left as they are

    def summary(self, recipe: str) -> str:
        total = len(self.converted) + len(self.kept) + len(self.already)
        text = f"fp8: {len(self.converted)} of {total} linear layers train in float8 ({recipe} scaling)"
        if self.already:
            text += f", and {len(self.already)} more came converted by torchao (left as they are)"
        if self.kept:
            kept = ", ".join(f"{name} ({why})" for name, why in self.kept)
            text += f"; kept in bf16: {kept}"
        return text


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(prefix, pattern) for pattern in patterns for prefix in prefixes)


def _keep_reason(name: str, module: nn.Linear, cfg: FP8Config, embeddings: list[nn.Embedding]) -> str | None:
    if _matches(name, cfg.exclude_modules):
        return "excluded"
    if any(module.weight is emb.weight for emb in embeddings):
        return "tied to an embedding"
    vocab_sizes = {emb.num_embeddings for emb in embeddings}
    if module.out_features in vocab_sizes or name.rsplit(".", 1)[-1] in HEAD_NAMES:
        return "output head"
    if module.in_features % DIM_MULTIPLE or module.out_features % DIM_MULTIPLE:
        return f"dims not divisible by {DIM_MULTIPLE}"
    if min(module.in_features, module.out_features) < cfg.min_features:
        return f"smaller than min_features={cfg.min_features}"
    if cfg.auto_filter_small_kn and below_break_even(cfg.recipe, module.in_features, module.out_features):
        return f"{_BELOW} {cfg.recipe} break-even (K={module.in_features}, N={module.out_features})"
    return None


def below_break_even(recipe: str, k: int, n: int) -> bool:
    """Whether a linear of `k` input and `n` output features runs no faster in float8 than in bf16 under
    `recipe`, by the thresholds of torchao's H100 performance tables (rule 6 of the module docstring)."""
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def select_linears(model: nn.Module, cfg: FP8Config) -> Selection:
    """Which `nn.Linear`s of `model` train in float8 under `cfg` (the rule in the module docstring)."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    already = tuple(float8_linears(model))
    linears = [
        (name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in already
    ]
    reasons = {name: _keep_reason(name, module, cfg, embeddings) for name, module in linears}
    first_pass = {name for name, reason in reasons.items() if reason is None}
    converted: list[str] = []
    kept: list[tuple[str, str]] = []
    for name, module in linears:
        reason = reasons[name]
        below = reason is not None and reason.startswith(_BELOW)
        if below and shares_input(name, module, linears, first_pass):
            reason = None
        if reason is None:
            converted.append(name)
        else:
            kept.append((name, reason))
    return Selection(tuple(converted), tuple(kept), already)


def shares_input(
    name: str, module: nn.Linear, linears: list[tuple[str, nn.Linear]], converted: set[str]
) -> bool:
    """Whether a converted linear beside `name` (same parent module, same input width) likely reads the
    same input (rule 6's exception)."""
    parent = name.rpartition(".")[0]
    return any(
        other != name and other.rpartition(".")[0] == parent and m.in_features == module.in_features
        for other, m in linears
        if other in converted
    )


def float8_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The torchao `Float8Linear`s in `model` by name; none when torchao was never imported (no model
    can hold one then, and this never imports it)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    cls = getattr(module, "Float8Linear", None)
    if cls is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, cls)}


def adopt_converted(model: nn.Module, *, rank: int = 0, model_parallel: bool = False) -> int:
    """Take a model that came with torchao's `Float8Linear`s (module docstring): put back each weight that
    torchao wrapped for FSDP2's float8 all-gather, in place, and turn the all-gather off in the layer's
    config. Returns how many float8 layers the model holds; logs them once (rank 0). Refused on a
    model-parallel engine, as `convert_model` is."""
    layers = float8_linears(model)
    if layers and model_parallel:
        raise UserError(
            f"the model holds {len(layers)} torchao Float8Linear layers, and float8 training is not "
            "supported with tensor_parallel, an mpu or pipeline parallelism yet",
            hint="train data-parallel only (ZeRO 0-3), or in bf16 (Accelerate: mixed_precision=bf16)",
        )
    unwrapped = 0
    for layer in layers.values():
        inner = getattr(layer.weight, "_tensor", None)  # torchao's WeightWithDynamicFloat8CastTensor
        if isinstance(inner, torch.Tensor) and type(layer.weight) is not nn.Parameter:
            layer.weight = inner if isinstance(inner, nn.Parameter) else nn.Parameter(inner)
            unwrapped += 1
        config: Any = getattr(layer, "config", None)  # torchao's Float8LinearConfig, a frozen dataclass
        if getattr(config, "enable_fsdp_float8_all_gather", False):
            layer.config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
    if layers and rank == 0:
        ensure_handler()
        text = f"fp8: the model came with {len(layers)} linear layers converted to torchao's Float8Linear"
        text += " (as Accelerate's mixed_precision='fp8' does); they train in float8 as they are"
        if unwrapped:
            text += f", {unwrapped} weights unwrapped from FSDP2's float8 all-gather (ZeRO gathers bf16)"
        _log.info(text)
    return len(layers)


def _torchao_float8() -> tuple[Any, Any]:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # type: ignore[import-untyped]
    except ImportError as error:
        raise UserError(
            f"fp8.enabled needs torchao's float8 training, which did not import ({error})",
            hint="install the fp8 extra: pip install 'dslaunch[fp8]' (torchao==0.18.0)",
        ) from None
    return Float8LinearConfig, convert_to_float8_training


def convert_model(
    model: nn.Module, cfg: FP8Config, *, rank: int = 0, model_parallel: bool = False
) -> Selection:
    """Swap the selected linears of `model` for torchao's Float8Linear, in place; logs the selection once
    (rank 0). A model with nothing to convert is left as it is, and the log says why. Refused on a
    model-parallel engine (AutoTP, an mpu, pipeline stages): AutoTP has already sharded its linears and
    hooked them for communication by then, and a swapped module would drop those hooks."""
    if model_parallel:
        raise ConfigError(
            "fp8.enabled",
            "float8 training is not supported with tensor_parallel, an mpu or pipeline parallelism yet",
            hint='train data-parallel only (ZeRO 0-3), or leave "fp8" out',
        )
    float8_config_cls, convert = _torchao_float8()
    selection = select_linears(model, cfg)
    if rank == 0:
        ensure_handler()  # the engine's own reports set it up later; this line comes first
        _log.info(selection.summary(cfg.recipe))
    if selection.converted:
        chosen = set(selection.converted)
        convert(
            model,
            config=float8_config_cls.from_recipe_name(cfg.recipe),
            module_filter_fn=lambda _module, fqn: fqn in chosen,
        )
    return selection
