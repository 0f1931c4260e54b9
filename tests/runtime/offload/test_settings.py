"""The `zero_optimization.offload_optimizer` keys (`update`, `host_share`, `grad_transfer`): each is checked
like every config key, reads into `OffloadSettings` (runtime/config/offload.py), and reaches the offloaded
step; the DSLAUNCH_OFFLOAD_* variables override them for benchmarks only, and say so.

On the CPU over gloo; the numerics of every setting are tests/runtime/offload/test_parity.py's.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime.offload.cases import offload_engine
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, rank_batch
from tests.support.parity import ROWS


def _offload_config(**keys) -> dict:
    offload = {"device": "cpu", **keys}
    return {"train_batch_size": ROWS, "zero_optimization": {"stage": 2, "offload_optimizer": offload}}


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("update", "gpu", "expected one of 'auto', 'host', 'device', got str 'gpu'"),
        ("update", 1, "expected one of 'auto', 'host', 'device', got int 1"),
        ("grad_transfer", "bf32", "expected one of 'auto', 'fp32', 'native', got str 'bf32'"),
        ("host_share", 1.5, "expected a number in [0.0, 1.0], got 1.5"),
        ("host_share", -0.1, "expected a number in [0.0, 1.0], got -0.1"),
        ("host_share", "half", "expected a number in [0.0, 1.0], got str 'half'"),
    ],
)
def test_a_bad_offload_key_names_the_key_and_what_it_takes(key: str, value, allowed: str) -> None:
    from runtime.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config(_offload_config(**{key: value}), world_size=1)
    assert str(caught.value) == f"zero_optimization.offload_optimizer.{key}: {allowed}"


def test_offload_keys_read_into_the_settings_and_auto_is_left_to_the_engine() -> None:
    """Values are matched case-insensitively; "auto" and null leave the choice to the engine (None, so
    the resolved config holds no "auto"); the internal settings are no config keys and stay out of the
    resolved config, which loads back to the same settings; the keys belong to offload_optimizer only."""
    from runtime.config import ConfigError, load_config
    from runtime.config.offload import OffloadSettings

    cfg = load_config(_offload_config(update="DEVICE", grad_transfer="fp32", host_share=0.25), world_size=1)
    settings = cfg.zero_optimization.offload_optimizer
    assert settings == OffloadSettings(device="cpu", update="device", grad_transfer="fp32", host_share=0.25)
    auto = load_config(_offload_config(update="auto", grad_transfer=None, host_share="auto"), world_size=1)
    assert auto.zero_optimization.offload_optimizer == OffloadSettings(device="cpu")
    resolved = cfg.to_dict()["zero_optimization"]["offload_optimizer"]
    assert resolved == {"device": "cpu", "pin_memory": False, "ratio": 1.0, "update": "device",
                        "host_share": 0.25, "grad_transfer": "fp32"}  # fmt: skip
    assert load_config(cfg.to_dict(), world_size=1) == cfg
    with pytest.raises(ConfigError) as typo:
        load_config(_offload_config(updte="host"), world_size=1)
    assert str(typo.value) == 'zero_optimization.offload_optimizer.updte: unknown key; did you mean "update"?'
    param = {"stage": 3, "offload_param": {"device": "cpu", "update": "host"}}
    with pytest.raises(ConfigError) as misplaced:
        load_config({"train_batch_size": ROWS, "zero_optimization": param}, world_size=1)
    assert str(misplaced.value).startswith("zero_optimization.offload_param.update: unknown key")
    moot = {"train_batch_size": ROWS, "zero_optimization": {"offload_optimizer": {"update": "host"}}}
    notes = load_config(moot, world_size=1).notes
    assert notes == ("zero_optimization.offload_optimizer.update: 'host' has no effect (device is \"none\")",)


def test_benchmark_overrides_replace_their_keys_and_say_so() -> None:
    from runtime.config.offload import OffloadSettings, with_overrides

    configured = OffloadSettings(device="cpu", update="device", host_share=0.5)
    environ = {
        "DSLAUNCH_OFFLOAD_UPDATE": " HOST ",
        "DSLAUNCH_OFFLOAD_GRAD_TRANSFER": "native",
        "DSLAUNCH_OFFLOAD_HOST_SHARE": "",  # empty: not set
    }
    settings, notes = with_overrides(configured, environ)
    assert settings == OffloadSettings(device="cpu", update="host", host_share=0.5, grad_transfer="native")
    assert notes == [
        "DSLAUNCH_OFFLOAD_UPDATE=HOST overrides zero_optimization.offload_optimizer.update (the config says "
        "'device'); the variable is a benchmark override: set the key in the config instead",
        "DSLAUNCH_OFFLOAD_GRAD_TRANSFER=native overrides zero_optimization.offload_optimizer.grad_transfer "
        "(the config says auto); the variable is a benchmark override: set the key in the config instead",
    ]
    assert with_overrides(configured, {}) == (configured, [])
    assert with_overrides(configured, {"DSLAUNCH_OFFLOAD_UPDATE": "auto"})[0].update is None
    for name, bad, allowed in (
        ("DSLAUNCH_OFFLOAD_UPDATE", "gpu", "expected one of auto, host, device"),
        ("DSLAUNCH_OFFLOAD_GRAD_TRANSFER", "bf32", "expected one of auto, fp32, native"),
        ("DSLAUNCH_OFFLOAD_HOST_SHARE", "lots", "expected the fraction"),
    ):
        with pytest.raises(ValueError, match=f"{name}='{bad}': {allowed}"):
            with_overrides(configured, {name: bad})


def test_the_overrides_are_read_once_with_the_config_and_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    # the environment is read where the config is (runtime/config/offload.py), never in runtime/offload:
    # the settings carry the override and its line, which the run log's config notes show too
    from runtime.config import load_config

    monkeypatch.setenv("DSLAUNCH_OFFLOAD_UPDATE", "host")
    cfg = load_config(_offload_config(update="device"), world_size=1)
    settings = cfg.zero_optimization.offload_optimizer
    line = (
        "DSLAUNCH_OFFLOAD_UPDATE=host overrides zero_optimization.offload_optimizer.update (the config says "
        "'device'); the variable is a benchmark override: set the key in the config instead"
    )
    assert (settings.update, settings.overrides) == ("host", (line,))
    assert line in cfg.notes
    assert "overrides" not in cfg.to_dict()["zero_optimization"]["offload_optimizer"]  # not a config key


def _settings_reach_the_step(rank: int, world_size: int) -> dict:
    """One engine per setting; what its offload chose, and what its first step did."""
    import logging
    import os

    class Notes(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    notes = Notes()
    logging.getLogger("runtime.offload").addHandler(notes)
    out = {}
    for name, keys, environ in (
        ("auto", {}, {}),
        ("host", {"update": "host"}, {}),
        ("device", {"update": "device"}, {}),
        ("shared", {"update": "device", "host_share": 0.5}, {}),
        ("fp32", {"update": "host", "grad_transfer": "fp32"}, {}),
        ("overridden", {"update": "device"}, {"DSLAUNCH_OFFLOAD_UPDATE": "host"}),
    ):
        os.environ.update(environ)
        _, engine, _ = offload_engine(2, bucket=300, offload=keys)
        for variable in environ:
            del os.environ[variable]
        before = engine.full_state_dict()
        x, y = rank_batch(0, 0, ROWS, rank, world_size)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        after = engine.full_state_dict()
        out[name] = {
            "on_device": engine.masters.update_on_device,
            "staging": engine.masters.device_buffer_bytes(),  # the device step's slots
            "host_share": engine.masters.update.host_share,
            "landed": sorted({str(t.dtype) for t in engine.masters.grads.buffers}),  # the host's part
            "reason": engine.masters.update.reason,
            "updated": all(not torch.equal(after[n], before[n]) for n in before),
        }
        engine.destroy()
    out["log"] = notes.lines
    return out


def test_the_offload_keys_reach_the_step() -> None:
    """update "host" runs the CPU step, "device" the device step (the CPU's "device" here), host_share
    splits each span, grad_transfer picks what lands; "auto" on a CPU-only machine is the CPU step; a
    benchmark override beats the config, and rank 0 logs it."""
    got = run_distributed(_settings_reach_the_step, 1, timeout=120)[0]
    assert all(run["updated"] for run in got.values() if isinstance(run, dict)), got
    device = got["device"]  # all of every span through the slots: nothing lands on the host
    assert device["on_device"] and device["staging"] > 0 and device["landed"] == [], device
    for name in ("auto", "host", "fp32", "overridden"):
        assert not got[name]["on_device"] and got[name]["staging"] == 0, (name, got[name])
    assert got["auto"]["reason"] == "the CPU runs the Adam step (no GPU)"
    assert got["host"]["reason"] == 'the CPU runs the Adam step (offload_optimizer.update: "host")'
    assert got["host"]["landed"] == ["torch.bfloat16"] and got["fp32"]["landed"] == ["torch.float32"]
    shared = got["shared"]  # the GPU's head and the CPU's tail of every span
    assert shared["on_device"] and shared["staging"] == device["staging"] and shared["host_share"] == 0.5
    assert shared["landed"] == ["torch.bfloat16"], shared  # only the CPU's tails land
    assert got["log"] == [
        "offload: DSLAUNCH_OFFLOAD_UPDATE=host overrides zero_optimization.offload_optimizer.update (the "
        "config says 'device'); the variable is a benchmark override: set the key in the config instead"
    ]
