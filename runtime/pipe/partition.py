"""Which layers each pipeline stage owns: pure functions from layer weights to stage boundaries.

A partition is a list of `num_stages + 1` boundaries: stage s owns layers `parts[s]:parts[s + 1]`. Every
stage owns at least one layer. Methods (the `partition_method` of `PipelineModule`):

- "uniform": equal layer counts (the first `n % stages` stages get one more);
- "parameters": contiguous stages that minimise the largest trainable-parameter count of a stage;
- "type:REGEX": the same over weight 1 for layers whose class name matches REGEX (case-insensitive),
  0 for the rest, so matched layers (e.g. "type:Block") are spread evenly.

With several chunks per stage (interleaved schedules), the layers are cut the same way into
`num_stages * chunks` parts (virtual stages) and stage r holds parts r, r + num_stages, r + 2 * num_stages,
... (`virtual_stages`), the placement torch's interleaved schedules expect.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from runtime.pipe.config import PipelineError

PARTITION_METHODS = ("parameters", "uniform", "type:REGEX")


def _check(num_items: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PipelineError(f"a pipeline needs at least 1 stage, got {num_stages}")
    if num_items < num_stages:
        raise PipelineError(
            f"the pipeline has {num_stages} stages but only {num_items} layers; every stage needs at "
            "least one layer",
            hint="use fewer stages (PipelineModule(num_stages=...), or the topology's num_pp) or more layers",
        )


def partition_uniform(num_items: int, num_stages: int) -> list[int]:
    """Boundaries giving each stage `num_items // num_stages` layers, the first stages one more."""
    _check(num_items, num_stages)
    base, extra = divmod(num_items, num_stages)
    parts = [0]
    for stage in range(num_stages):
        parts.append(parts[-1] + base + (1 if stage < extra else 0))
    return parts


def _feasible(weights: Sequence[int], num_stages: int, bound: int) -> bool:
    """Can the weights be cut into at most `num_stages` contiguous parts of sum <= bound?"""
    parts, total = 1, 0
    for w in weights:
        if w > bound:
            return False
        if total + w > bound:
            parts, total = parts + 1, w
        else:
            total += w
    return parts <= num_stages


def partition_balanced(weights: Sequence[int], num_stages: int) -> list[int]:
    """Contiguous boundaries minimising the heaviest stage's total weight.

    The smallest feasible bound comes from a binary search; then stages are filled from the left up to
    that bound, each leaving at least one layer for every later stage. Ties therefore go left: a
    zero-weight layer joins the stage before it.
    """
    _check(len(weights), num_stages)
    if any(w < 0 for w in weights):
        raise PipelineError(f"layer weights must be non-negative, got {list(weights)}")
    low, high = max(weights, default=0), sum(weights)
    while low < high:
        mid = (low + high) // 2
        if _feasible(weights, num_stages, mid):
            high = mid
        else:
            low = mid + 1
    bound = low
    parts, index, n = [0], 0, len(weights)
    for stage in range(num_stages - 1):
        later = num_stages - stage - 1  # stages after this one, each needing a layer
        total = weights[index]
        index += 1
        while index < n - later and total + weights[index] <= bound:
            total += weights[index]
            index += 1
        parts.append(index)
    parts.append(n)
    return parts


def type_weights(type_names: Sequence[str], pattern: str) -> list[int]:
    """1 for each layer whose class name matches `pattern` (case-insensitive search), else 0."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise PipelineError(
            f"partition_method 'type:{pattern}': not a regular expression ({error})"
        ) from None
    weights = [1 if regex.search(name) else 0 for name in type_names]
    if not any(weights):
        raise PipelineError(
            f"partition_method 'type:{pattern}' matches none of the layer types {sorted(set(type_names))}"
        )
    return weights


def virtual_stages(stage: int, num_stages: int, chunks: int) -> list[int]:
    """The parts (virtual stage indices) pipeline stage `stage` holds, in forward order: one per chunk,
    `num_stages` apart, so a micro-batch visits every stage once per chunk."""
    return [stage + chunk * num_stages for chunk in range(chunks)]


def check_partition_method(method: str) -> None:
    """Raise a clear error for a method that is none of PARTITION_METHODS."""
    if method in ("parameters", "uniform") or method.lower().startswith("type:"):
        return
    raise PipelineError(
        f"unknown partition_method {method!r}; use one of 'parameters', 'uniform' or 'type:REGEX' "
        "(e.g. 'type:TransformerBlock')"
    )


def partition_layers(
    method: str,
    num_stages: int,
    *,
    param_counts: Sequence[int] | None = None,
    type_names: Sequence[str],
) -> list[int]:
    """Stage boundaries for `method` over layers with the given class names (and trainable-parameter
    counts, needed only by "parameters")."""
    check_partition_method(method)
    if method == "uniform":
        return partition_uniform(len(type_names), num_stages)
    if method == "parameters":
        if param_counts is None:
            raise PipelineError("partition_method 'parameters' needs the layers' parameter counts")
        return partition_balanced(param_counts, num_stages)
    return partition_balanced(type_weights(type_names, method.split(":", 1)[1]), num_stages)


__all__ = [
    "PARTITION_METHODS",
    "check_partition_method",
    "partition_balanced",
    "partition_layers",
    "partition_uniform",
    "type_weights",
    "virtual_stages",
]
