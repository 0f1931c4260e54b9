"""The batch-size arithmetic of the top-level config: train_batch_size = micro x accumulation x world size.

`resolve_batch` owns the three top-level batch keys (train_batch_size, train_micro_batch_size_per_gpu,
gradient_accumulation_steps) and completes them against the data-parallel world size, following
DeepSpeed's rules:

- all three given: the identity must hold exactly;
- two given: the third is derived, and it must come out whole (DeepSpeed floors the division and then
  fails its own identity check; refusing the remainder up front names the term that cannot be derived);
- only train_batch_size or only the micro batch given: gradient_accumulation_steps defaults to 1 and the
  other one is derived;
- neither train_batch_size nor the micro batch given: an error, accumulation steps alone fix nothing.

"auto" on a batch term means "derive it from the others" (unless `auto_values` supplies it), so it is
treated as absent rather than refused; train_batch_size and the micro batch both "auto" gets its own
message, since "neither is given" would be confusing when both keys are plainly there.

Why the errors read the way they do: a batch mismatch is rarely a typo in one number. Usually one term
came from somewhere the user was not looking (the world size from the launcher, an "auto" filled by a
trainer, a default), so every term is printed with its value and where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config.checks import Int
from runtime.config.reader import ConfigError, SectionReader


class BatchSizeError(ConfigError):
    """The three batch keys and the world size do not multiply out."""

    hint = (
        "train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x the "
        'number of data-parallel ranks; give two of the three (or "auto") and the third is derived'
    )


@dataclass(frozen=True)
class _BatchTerm:
    name: str
    value: int | None
    source: str  # where the value came from, for error messages

    def show(self) -> str:
        return f"{self.name} ({self.value}, {self.source})"


def resolve_batch(r: SectionReader, world_size: int) -> tuple[int, int, int]:
    """Complete (train_batch_size, micro, accumulation) from any two; check the identity when all three."""

    def read(name: str) -> _BatchTerm:
        given = r.data.get(name)
        if given == "auto":
            source = "from auto_values" if r.key_path(name) in r.ctx.auto_values else '"auto"'
        else:
            source = "from the config"
        # "auto" batch terms are derived from the others below, so the reader must not refuse them.
        value = r.get(name, Int(1, nullable=True), None, auto=lambda: None)
        return _BatchTerm(name, value, source if given is not None else "")

    tbs, micro, gas = (
        read("train_batch_size"),
        read("train_micro_batch_size_per_gpu"),
        read("gradient_accumulation_steps"),
    )
    ws = _BatchTerm("world_size", world_size, "data-parallel ranks")

    def derive(target: _BatchTerm, total: _BatchTerm, *parts: _BatchTerm) -> int:
        denominator = 1
        for part in parts:
            denominator *= part.value  # type: ignore[operator]
        if total.value % denominator:  # type: ignore[operator]
            shown = " x ".join(p.show() for p in parts)
            raise BatchSizeError(
                target.name,
                f"cannot derive it: {total.show()} is not divisible by {shown} = {denominator}",
            )
        return total.value // denominator  # type: ignore[operator]

    if tbs.value is None and micro.value is None:
        auto = [t.name for t in (tbs, micro) if t.source == '"auto"']
        if len(auto) == 1:  # the other one is missing: "neither is given" would deny what is plainly there
            other = "train_batch_size" if auto[0] != "train_batch_size" else "train_micro_batch_size_per_gpu"
            raise BatchSizeError(
                auto[0],
                f'"auto" is derived from {other}, which is not given; set one of the two to a number',
            )
        if tbs.source == micro.source == '"auto"':
            raise BatchSizeError(
                "train_batch_size",
                '"auto" batch sizes are derived from the others, but train_batch_size and '
                'train_micro_batch_size_per_gpu are both "auto"; set one of them to a number',
            )
        raise BatchSizeError(
            "train_batch_size",
            "set train_batch_size or train_micro_batch_size_per_gpu (or both); neither is given",
        )
    if gas.value is None and (tbs.value is None or micro.value is None):
        gas = _BatchTerm(gas.name, 1, "default" if not gas.source else 'default for "auto"')
    if tbs.value is None:
        tbs = _BatchTerm(tbs.name, micro.value * gas.value * world_size, "derived")  # type: ignore[operator]
    elif micro.value is None:
        micro = _BatchTerm(micro.name, derive(micro, tbs, gas, ws), "derived")
    elif gas.value is None:
        gas = _BatchTerm(gas.name, derive(gas, tbs, micro, ws), "derived")
    product = micro.value * gas.value * world_size  # type: ignore[operator]
    if tbs.value != product:
        raise BatchSizeError(
            "train_batch_size",
            f"train_batch_size ({tbs.value}) != train_micro_batch_size_per_gpu ({micro.value}) x "
            f"gradient_accumulation_steps ({gas.value}) x world_size ({world_size}) = {product}; "
            f"terms: {tbs.show()}, {micro.show()}, {gas.show()}, {ws.show()}",
        )
    return tbs.value, micro.value, gas.value  # type: ignore[return-value]
