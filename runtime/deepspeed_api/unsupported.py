"""DeepSpeed features dslaunch does not have: one error type, raised by name, with the nearest alternative.

A DeepSpeed user who reaches for a feature we lack must learn that at the call, in words: never an
AttributeError from a missing name, never a silent no-op. `unsupported()` raises; `unsupported_callable()`
and `UnsupportedClass` stand in for functions and classes under DeepSpeed's names, raising when called or
constructed (so importing them, as integrations do at module level, still works).
"""

from __future__ import annotations

from typing import Any, NoReturn

# the error and its raiser are the runtime's (any part may refuse a feature); named here with the stand-ins
from runtime.errors import UnsupportedFeature, unsupported

__all__ = [
    "UnsupportedFeature",
    "UnsupportedName",
    "missing_names",
    "unsupported",
    "unsupported_callable",
    "unsupported_class",
]


def unsupported_callable(name: str, feature: str, alternative: str) -> Any:
    """A function named `name` that raises UnsupportedFeature when called."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        unsupported(feature, alternative)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not supported by dslaunch ({feature}): {alternative}."
    return refuse


def unsupported_class(name: str, feature: str, alternative: str) -> type:
    """A class named `name` whose construction raises UnsupportedFeature (isinstance checks still work)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unsupported(feature, alternative)

    doc = f"Not supported by dslaunch ({feature}): {alternative}."
    return type(name, (), {"__init__": __init__, "__doc__": doc})


class UnsupportedName(UnsupportedFeature, AttributeError):
    """A DeepSpeed module attribute dslaunch does not provide. Also an AttributeError, so ``hasattr`` and
    ``getattr(module, name, default)`` (how integrations probe for optional features) still answer."""


def missing_names(module_name: str, alternative: str) -> Any:
    """A module-level ``__getattr__`` for a compat module: a name DeepSpeed has there but dslaunch does
    not raises UnsupportedName naming it, instead of a bare AttributeError."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # import machinery and tools probe dunders; those stay plain
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        raise UnsupportedName(f"{module_name}.{name}", alternative)

    return __getattr__
