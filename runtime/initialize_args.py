"""What `runtime.initialize` (and the engine's checkpoint calls) accept, checked before anything is built.

Each argument keeps DeepSpeed's accepted forms (`deepspeed.initialize`, 0.19.8): `model` a torch Module;
`optimizer` a torch optimizer or a callable taking the param groups; `model_parameters` an iterable of
tensors or of param-group dicts; `training_data` a dataset (anything indexable with a length, or
iterable, as torch's DataLoader takes it); `lr_scheduler` a scheduler (it has `step`) or a callable taking
the optimizer; the config once, as `config=`, `config_params=` or `args.deepspeed_config`. Anything else
would fail deep inside the engine (a TypeError about `len()` of an int, an AttributeError of a function
with no `.parameters`) or, for a scheduler, be accepted and fail at the first step; here it is one
`InitializeArgumentError` naming the argument, what it got and what it takes.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from runtime.errors import UserError

__all__ = ["InitializeArgumentError", "check_arguments", "checkpoint_dir", "config_source"]


class InitializeArgumentError(UserError, TypeError, ValueError):
    """An argument of runtime.initialize (or of a checkpoint call) of the wrong kind. It stays a TypeError
    and a ValueError, which these failures raised before, for code that catches those."""

    hint = "see runtime.initialize's docstring for the forms each argument takes"


def _what(value: Any) -> str:
    """A short description of what the user passed: its type, and the value itself when it is short."""
    kind = type(value).__name__
    text = repr(value)
    return f"{kind} {text}" if len(text) <= 40 and not text.startswith("<") else kind


def config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The one config the caller gave: `config=`, DeepSpeed's older `config_params=`, or
    `args.deepspeed_config` (`args.deepscale_config`); none, or more than one, is refused."""
    given = []
    if config is not None:
        given.append(("config=", config))
    if config_params is not None:
        given.append(("config_params=", config_params))
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
        if from_args is not None:
            given.append(("args.deepspeed_config", from_args))
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise InitializeArgumentError(
            f"runtime.initialize got a config twice: {names}",
            hint="pass only one of them (config_params is DeepSpeed's older name of config)",
        )
    if not given:
        raise InitializeArgumentError(
            "runtime.initialize needs a config",
            hint="pass config=<dict or path> or --deepspeed_config <path> (parsed into args with "
            "runtime.add_config_arguments)",
        )
    return given[0][1]


def check_arguments(
    model: Any, optimizer: Any, model_parameters: Any, training_data: Any, lr_scheduler: Any
) -> Any:
    """Refuse arguments of a kind initialize does not take; returns `model_parameters` as a list (a
    generator such as `model.parameters()` is read once here, so the engine sees the same items)."""
    if model is None:
        raise InitializeArgumentError(
            "runtime.initialize needs model=<torch.nn.Module>", hint="pass the model to train as model=..."
        )
    if not isinstance(model, nn.Module):
        called = " (a function or class: call it to build the model)" if callable(model) else ""
        raise InitializeArgumentError(
            f"runtime.initialize: model must be a torch.nn.Module, got {_what(model)}{called}",
            hint="pass model=<your torch.nn.Module instance>",
        )
    if optimizer is not None and not (_is_optimizer(optimizer) or callable(optimizer)):
        raise InitializeArgumentError(
            f"runtime.initialize: optimizer must be a torch.optim.Optimizer or a callable taking the param "
            f"groups, got {_what(optimizer)}",
            hint="pass optimizer=torch.optim.AdamW(model.parameters(), lr=...), or leave it out and set "
            'the config\'s "optimizer" section',
        )
    if model_parameters is not None:
        model_parameters = _parameter_list(model_parameters)
    if training_data is not None and not _is_dataset(training_data):
        raise InitializeArgumentError(
            f"runtime.initialize: training_data must be a dataset (indexable with a length, or iterable), "
            f"got {_what(training_data)}",
            hint="pass a torch.utils.data.Dataset (or a datasets.Dataset), or leave training_data out and "
            "build your own DataLoader",
        )
    if lr_scheduler is not None and not (
        callable(lr_scheduler) or callable(getattr(lr_scheduler, "step", 0))
    ):
        raise InitializeArgumentError(
            f"runtime.initialize: lr_scheduler must be a scheduler (with a step() method) or a callable "
            f"taking the optimizer, got {_what(lr_scheduler)}",
            hint="pass lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ...), or leave it "
            'out and set the config\'s "scheduler" section',
        )
    return model_parameters


def _is_optimizer(value: Any) -> bool:
    import torch

    return isinstance(value, torch.optim.Optimizer)


def _is_dataset(value: Any) -> bool:
    if isinstance(value, (str, bytes)):
        return False
    indexable = hasattr(value, "__getitem__") and hasattr(value, "__len__")
    return indexable or hasattr(value, "__iter__")


def _parameter_list(model_parameters: Any) -> list[Any]:
    """`model_parameters` as a list of tensors or of param-group dicts (each with "params")."""
    import torch

    hint = (
        "pass model_parameters=model.parameters(), a list of tensors, or a list of param-group dicts "
        '({"params": [...], "lr": ...})'
    )
    if isinstance(model_parameters, (torch.Tensor, nn.Module, str, bytes)) or not hasattr(
        model_parameters, "__iter__"
    ):
        raise InitializeArgumentError(
            f"runtime.initialize: model_parameters must be an iterable of tensors or of param-group dicts, "
            f"got {_what(model_parameters)}",
            hint=hint,
        )
    items = list(model_parameters)
    for index, item in enumerate(items):
        if isinstance(item, dict):
            if "params" not in item:
                raise InitializeArgumentError(
                    f"runtime.initialize: model_parameters[{index}] is a param-group dict without "
                    f'"params" (it has {sorted(map(str, item))})',
                    hint=hint,
                )
        elif not isinstance(item, torch.Tensor):
            raise InitializeArgumentError(
                f"runtime.initialize: model_parameters[{index}] is {_what(item)}, not a tensor or a "
                "param-group dict",
                hint=hint,
            )
    if any(isinstance(item, dict) for item in items) and not all(isinstance(item, dict) for item in items):
        raise InitializeArgumentError(
            "runtime.initialize: model_parameters mixes tensors and param-group dicts", hint=hint
        )
    return items


def checkpoint_dir(value: Any, argument: str) -> str:
    """`value` as a path for save_checkpoint / load_checkpoint's `argument` ("save_dir", "load_dir")."""
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise InitializeArgumentError(
        f"{argument} must name a directory (a str or os.PathLike), got {_what(value)}",
        hint=f'pass the checkpoint directory as {argument}, e.g. engine.save_checkpoint("checkpoints")'
        if argument == "save_dir"
        else f"pass the directory save_checkpoint was given as {argument}",
    )
