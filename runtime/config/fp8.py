"""The `fp8` section (ours; DeepSpeed has none): float8 training of linear layers through torchao.

Owns the section's dataclass, keys and defaults. Which layers the section converts is decided by
`runtime.fp8.select` (a pure rule over the model); that torchao is installed is checked there too, when an
engine is built, so loading a config never imports torchao. That fp8 runs on bf16 working weights is
checked by `runtime.config.load`, which sees both sections.

    "fp8": {
        "enabled": true,
        "recipe": "tensorwise",        # one scale per tensor; "rowwise": per row (more accurate);
                                       # "rowwise_with_gw_hp": rowwise, the weight gradient in bf16
        "exclude_modules": ["*.attn.*"],  # fnmatch patterns on module names kept in bf16
        "min_features": 1024,          # both dims of a converted layer at least this
        "auto_filter_small_kn": true   # keep layers below float8's measured break-even for the recipe,
                                       # unless a sibling reading the same input converts (runtime/fp8.py)
    }
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.config.checks import Bool, Choice, Int
from runtime.config.reader import ConfigError, SectionReader

# torchao's Float8LinearRecipeName values: the last keeps the weight gradient's matmul in bf16 (the recipe
# torchao and torchtitan suggest where rowwise's loss still drifts)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# float8 matmuls (cuBLAS / CUTLASS) need both dims divisible by 16; torchao refuses other shapes
DIM_MULTIPLE = 16
# Below about this size the casts to float8 cost more than the faster matmul saves (torchao's H100
# tables: tensorwise gains nothing for K <= 4096 and N <= 1024)
DEFAULT_MIN_FEATURES = 1024


@dataclass(frozen=True)
class FP8Config:
    enabled: bool = False
    recipe: str = "tensorwise"
    exclude_modules: tuple[str, ...] = ()  # fnmatch patterns matched against each linear's module name
    min_features: int = DEFAULT_MIN_FEATURES
    # keep a linear whose shape torchao's H100 tables show no faster in float8 for the recipe (torchtitan's
    # option of the same name); runtime.fp8.below_break_even holds the thresholds
    auto_filter_small_kn: bool = True


@dataclass(frozen=True)
class StrList:
    """A list of strings (a single string is read as a list of one)."""

    def __call__(self, path: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list of module-name patterns, got {type(value).__name__}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{path}[{i}]", f"expected a non-empty string, got {item!r}")
        return tuple(value)


def read_fp8(r: SectionReader) -> FP8Config:
    cfg = FP8Config(
        enabled=r.get("enabled", Bool(), False),
        recipe=r.get("recipe", Choice(RECIPES), "tensorwise"),
        exclude_modules=r.get("exclude_modules", StrList(), ()),
        min_features=r.get("min_features", Int(DIM_MULTIPLE), DEFAULT_MIN_FEATURES),
        auto_filter_small_kn=r.get("auto_filter_small_kn", Bool(), True),
    )
    r.finish()
    return cfg
