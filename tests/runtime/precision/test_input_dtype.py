"""Inputs in another dtype than the working weights fail with an error that says what to change.

fp16 runs cast floating-point inputs only with `fp16.auto_cast` (DeepSpeed's behaviour); without it a
float32 batch used to fail deep inside the model ("mat1 and mat2 must have the same dtype"). The engine's
forward now raises `InputDtypeError` naming the input, its dtype and shape, with the hint to set
`fp16.auto_cast` or cast the inputs; other errors of the model pass through untouched. One rank, in a
fresh process (the engine initializes a process group).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import make_model


def _error_of(fn: Any) -> tuple[str, str, str | None, str | None]:
    try:
        fn()
    except Exception as error:
        cause = type(error.__cause__).__name__ if error.__cause__ is not None else None
        return type(error).__name__, str(error), getattr(error, "hint", None), cause
    raise AssertionError("no error")


def _engine(**precision: Any) -> Any:
    import runtime

    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **precision}
    engine, _, _, _ = runtime.initialize(model=make_model(0), config=config)
    return engine


def _cases(rank: int, world_size: int) -> dict:
    x = torch.randn(2, 13)
    out: dict = {}
    fp16 = _engine(fp16={"enabled": True})
    out["fp16_positional"] = _error_of(lambda: fp16(x))
    out["fp16_keyword"] = _error_of(lambda: fp16(x=x))
    out["fp16_wrong_shape"] = _error_of(lambda: fp16(torch.randn(2, 7).half()))  # not a dtype problem
    out["fp16_half_input"] = str(fp16(x.half()).dtype)
    fp16.destroy()
    cast = _engine(fp16={"enabled": True, "auto_cast": True})
    out["fp16_auto_cast"] = str(cast(x).dtype)
    cast.destroy()
    fp32 = _engine()
    out["fp32_half_input"] = _error_of(lambda: fp32(x.half()))
    fp32.destroy()
    return out


@pytest.fixture(scope="module")
def cases() -> dict:
    return run_distributed(_cases, 1, timeout=120)[0]


def test_fp16_with_fp32_inputs_says_to_set_auto_cast(cases: dict) -> None:
    kind, message, hint, cause = cases["fp16_positional"]
    assert kind == "InputDtypeError" and cause == "RuntimeError"
    assert message == (
        "engine forward: the model's weights are fp16 but argument 0 is a float32 tensor of shape (2, 13), "
        "and the model failed on the mismatch: mat1 and mat2 must have the same dtype, but got Float and Half"
    )
    assert hint == (
        'set "fp16": {"enabled": true, "auto_cast": true} so the engine casts floating-point inputs to fp16, '
        "or cast them yourself (x.half())"
    )
    kind, message, _, _ = cases["fp16_keyword"]
    assert kind == "InputDtypeError" and "but keyword argument 'x' is a float32 tensor" in message


def test_matching_or_cast_inputs_run(cases: dict) -> None:
    assert cases["fp16_half_input"] == "torch.float16"
    assert cases["fp16_auto_cast"] == "torch.float16"


def test_other_model_errors_pass_through(cases: dict) -> None:
    kind, message, hint, _ = cases["fp16_wrong_shape"]
    assert kind == "RuntimeError" and "shapes cannot be multiplied" in message and hint is None


def test_fp32_weights_with_half_inputs_say_to_cast_them(cases: dict) -> None:
    kind, message, hint, _ = cases["fp32_half_input"]
    assert kind == "InputDtypeError"
    assert message.startswith(
        "engine forward: the model's weights are fp32 but argument 0 is a float16 tensor"
    )
    assert hint.startswith("cast the inputs to float32 (x.float())")
