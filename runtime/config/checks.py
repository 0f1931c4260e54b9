"""The value checks a config section hands to `SectionReader.get`: Bool, Int, Float, Str, Choice, ...

Each check is a small frozen dataclass called as `check(path, value)`. It returns the value in the form
the dataclasses store (an int from a whole float such as 5e8, a float from an int, the canonical spelling
of a Choice, tuples for pairs and per-group lists) or raises `ConfigError` naming the key path, the
expected type and range, and what was given. The given value is shown with its type ("str '5'" rather
than a bare 5), so that a quoted number does not read like the number it was meant to be.

`SectionReader` takes any such callable and names none of these, and the checks know nothing of sections
or "auto" (the key path is just the text their messages start with): that is the seam with
`runtime.config.reader`. The error type and `describe` stay there, so every part of config reading raises
the one `ConfigError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runtime.config.reader import ConfigError, describe


def _range_text(lo: float | None, hi: float | None, lo_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]" if not lo_open else f" in ({lo}, {hi}]"
    if lo is not None:
        return f" > {lo}" if lo_open else f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


@dataclass(frozen=True)
class Bool:
    nullable: bool = False  # null passes as None (a DeepSpeed key whose default is "decided later")

    def __call__(self, path: str, value: Any) -> bool | None:
        if value is None and self.nullable:
            return None
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {describe(value)}")
        return value


@dataclass(frozen=True)
class Int:
    lo: int | None = None
    hi: int | None = None
    nullable: bool = False

    def __call__(self, path: str, value: Any) -> int | None:
        if value is None and self.nullable:
            return None
        # JSON configs often write sizes as 5e8, which parses as a float: accept whole numbers.
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                path, f"expected an integer{_range_text(self.lo, self.hi, False)}, got {describe(value)}"
            )
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise ConfigError(path, f"expected an integer{_range_text(self.lo, self.hi, False)}, got {value}")
        return value


@dataclass(frozen=True)
class Float:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    nullable: bool = False

    def __call__(self, path: str, value: Any) -> float | None:
        if value is None and self.nullable:
            return None
        return self.number(path, value)

    def number(self, path: str, value: Any) -> float:
        """`value` checked as a number in range (None is refused here, whatever `nullable` says)."""
        want = f"a number{_range_text(self.lo, self.hi, self.lo_open)}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(path, f"expected {want}, got {describe(value)}")
        value = float(value)
        too_low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        if too_low or (self.hi is not None and value > self.hi):
            raise ConfigError(path, f"expected {want}, got {value}")
        return value


@dataclass(frozen=True)
class Str:
    nullable: bool = False

    def __call__(self, path: str, value: Any) -> str | None:
        if value is None and self.nullable:
            return None
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {describe(value)}")
        return value


@dataclass(frozen=True)
class Choice:
    """One of a fixed set of strings, matched case-insensitively; returns the canonical spelling."""

    choices: tuple[str, ...]
    nullable: bool = False

    def __call__(self, path: str, value: Any) -> str | None:
        if value is None and self.nullable:
            return None
        options = ", ".join(repr(c) for c in self.choices)
        if isinstance(value, str):
            for choice in self.choices:
                if choice.lower() == value.lower():
                    return choice
        raise ConfigError(path, f"expected one of {options}, got {describe(value)}")


@dataclass(frozen=True)
class FloatPair:
    """Two numbers in [0, 1), like Adam's betas."""

    def __call__(self, path: str, value: Any) -> tuple[float, float]:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(path, f"expected a list of two numbers in [0, 1), got {describe(value)}")
        check = Float(0.0, 1.0)
        pair = (check.number(f"{path}[0]", value[0]), check.number(f"{path}[1]", value[1]))
        for i, v in enumerate(pair):
            if v >= 1.0:
                raise ConfigError(f"{path}[{i}]", f"expected a number in [0, 1), got {v}")
        return pair


@dataclass(frozen=True)
class FloatOrList:
    """A number, or one number per optimizer param group."""

    item: Float = Float()

    def __call__(self, path: str, value: Any) -> float | tuple[float | None, ...] | None:
        if isinstance(value, (list, tuple)):
            if not value:
                raise ConfigError(path, "expected a number or a non-empty list of numbers, got []")
            return tuple(self.item(f"{path}[{i}]", v) for i, v in enumerate(value))
        return self.item(path, value)
