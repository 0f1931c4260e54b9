"""Where optimizer offload keeps its bytes: fp32 masters and Adam state on the host and none on the device,
parameter offload's shards on the host outside a forward, and one rank's small gradient buckets.

On the CPU over gloo, at the world sizes named per test; the numbers are the engine's own memory
breakdown checked against the tensors' storages.
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import ConfigError
from tests.runtime.offload.cases import offload_engine
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch, with_offload_settings
from tests.support.parity import ROWS


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _measure(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (1, 2):
        # wide enough that alignment padding is a few percent of the parameters
        model, engine, optimizer = offload_engine(stage, bucket=20_000, hidden=256, width=250)
        x, y = rank_batch(0, 0, ROWS, rank, world_size)
        engine.backward(loss_fn(engine(x), y))
        engine.step()  # creates the optimizer state
        breakdown = engine.memory_breakdown()
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        device_side = _storages(
            list(model.parameters()) + [t for ps in engine.zero.grad_pieces() for t in ps]
        )
        host_side = _storages(masters + states)
        out[stage] = {
            "numel": sum(p.numel() for p in model.parameters()),
            "shard_numel": sum(g.layout.shard_numel for g in engine.groups),
            "breakdown": breakdown,
            "state_bytes": sum(t.numel() * t.element_size() for t in states),
            "master_bytes": sum(p.numel() * p.element_size() for p in masters),
            "shared_with_device": len(host_side & device_side),
            "master_dtypes": {str(p.dtype) for p in masters},
            "pinned": any(t.is_pinned() for t in masters + states),
            "optimizer": type(optimizer).__name__,
            "state_keys": [sorted(state) for state in optimizer.state.values()],
            "steps": [float(state["step"]) for state in optimizer.state.values()],
        }
        engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [2])
def test_device_holds_no_fp32_master_or_optimizer_state(world_size: int) -> None:
    results = run_distributed(_measure, world_size, timeout=120)
    for rank, per_stage in enumerate(results):
        for stage, got in per_stage.items():
            where = f"rank {rank}, stage {stage}"
            b = got["breakdown"]
            # every fp32 master and optimizer-state byte is reported on the host ...
            assert got["master_dtypes"] == {"torch.float32"}, where
            assert b.master_bytes == got["master_bytes"] > 0, where
            assert b.optimizer_bytes == got["state_bytes"] > 0, where
            assert b.host_bytes == b.master_bytes + b.optimizer_bytes, where
            # ... and none of it shares memory with the working weights or gradients the model uses
            assert got["shared_with_device"] == 0, where
            # what stays on the device is the bf16 working weights and the stage's bf16 gradients
            assert b.device_model_state_bytes == b.param_bytes + b.grad_bytes, where
            per_param = b.device_model_state_bytes / got["numel"]
            expected = 4.0 if stage == 1 else 2 + 2 / world_size  # bytes/param: ZeRO-Offload's 2 + 2(/N)
            assert abs(per_param - expected) <= 0.1 * expected, f"{where}: {per_param:.2f} B/param on device"
            # host: 12 bytes of fp32 state per shard element, plus one bf16 landing buffer
            assert b.host_buffer_bytes == 2 * got["shard_numel"], where
            assert abs(b.host_bytes / got["shard_numel"] - 12.0) < 0.01, where
            assert not got["pinned"], f"{where}: host memory pinned without CUDA"
            # torch's AdamW state layout (so checkpoints move between offloaded and on-device runs)
            assert got["optimizer"] == "AdamW", where
            assert got["state_keys"] == [["exp_avg", "exp_avg_sq", "step"]] * 2, where
            assert got["steps"] == [1.0, 1.0], where


def _measure_param_offload(rank: int, world_size: int) -> dict:
    """Stage 3 with offload_param + offload_optimizer: where the bytes are outside and inside a forward."""
    import runtime

    model = make_model(0, hidden=256, width=250)
    config = {
        "train_batch_size": ROWS,
        "steps_per_print": 0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,  # every unit is gathered on use, released after
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
    }
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    zero = engine.zero
    inside: list[dict] = []

    def during_forward(module, args) -> None:  # after the engine's pre-hook: this unit is gathered now
        b = engine.memory_breakdown()
        inside.append({"device_params": b.param_bytes - zero.host_param_bytes(), "gathered": gathered()})

    def gathered() -> int:
        return sum(u.working_bytes() for u in zero.units)

    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    handle = linear.register_forward_pre_hook(during_forward)
    x, y = rank_batch(0, 0, ROWS, rank, world_size)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    handle.remove()
    b = engine.memory_breakdown()
    segments = [s for u in zero.units for s in u.segments]
    out = {
        "breakdown": b,
        "inside": inside,
        "gathered_after": gathered(),
        "offloaded": all(s.offloaded and s.shard.device.type == "cpu" for s in segments),
        "shares_working": any(
            s.shard.untyped_storage().data_ptr() == s.group.working.untyped_storage().data_ptr()
            for s in segments
        ),
        "shard_bytes": sum(s.shard.numel() * s.shard.element_size() for s in segments),
        "shard_numel": sum(s.group.layout.shard_numel for s in segments),
        "pinned": any(s.shard.is_pinned() for s in segments),
    }
    engine.destroy()
    # parameter offload alone is refused with a message that names the key and the missing setting
    del config["zero_optimization"]["offload_optimizer"]
    try:
        runtime.initialize(model=make_model(0), config=config)
    except ConfigError as error:
        out["refusal"] = str(error)
    return out


@pytest.mark.parametrize("world_size", [1, 2])  # 1: the single-GPU case offload_param exists for
def test_offloaded_params_leave_only_gathered_units_on_the_device(world_size: int) -> None:
    results = run_distributed(_measure_param_offload, world_size, timeout=120)
    for rank, got in enumerate(results):
        b = got["breakdown"]
        # the working shards live in host memory, apart from the working buffers the gathers fill
        assert got["offloaded"] and not got["shares_working"], rank
        assert got["shard_bytes"] == 2 * got["shard_numel"] > 0, rank  # bf16 shards
        # ... and count as host bytes: fp32 master + Adam state (12 B) + the bf16 shard (2 B) per element
        assert b.host_bytes == b.master_bytes + b.optimizer_bytes + got["shard_bytes"], rank
        assert abs(b.host_bytes / got["shard_numel"] - 14.0) < 0.01, rank
        # outside a forward nothing is gathered: the device holds no weights at all, only gradient shards
        assert got["gathered_after"] == 0, rank
        assert b.device_model_state_bytes == b.grad_bytes, rank
        # inside a forward the device holds exactly the gathered units' full buffers, no shard
        assert got["inside"] and all(i["device_params"] == i["gathered"] > 0 for i in got["inside"]), rank
        assert not got["pinned"], f"rank {rank}: host memory pinned without CUDA"
        refusal = got.get("refusal", "")
        assert refusal.startswith("zero_optimization.offload_param.device: "), refusal
        assert 'offload_optimizer = {"device": "cpu"}' in refusal, refusal


def _bucket_sizes(rank: int, world_size: int) -> dict:
    import runtime

    out = {}
    for offload in (True, False):
        model = make_model(0)
        zero = {"stage": 2, "reduce_bucket_size": 10**9}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {"train_batch_size": ROWS, "steps_per_print": 0, "optimizer": {"type": "AdamW"}}
        config["zero_optimization"] = zero
        # the cap (16M elements) shrunk to this model's scale (its offload settings; no effect without)
        config = with_offload_settings(config, world_size=world_size, one_rank_bucket_numel=256)
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        out[offload] = [[b.numel for b in g.layout.buckets] for g in engine.groups]
        out["largest_param"] = max(p.numel() for p in model.parameters())
        engine.destroy()
    return out


def test_one_rank_offload_streams_gradients_in_small_buckets_whatever_reduce_bucket_size_says() -> None:
    """With one rank there is nothing to reduce, so a bucket only decides how soon the offloaded step can
    start: capped (the offload settings' one_rank_bucket_numel), while without offload reduce_bucket_size
    stands."""
    got = run_distributed(_bucket_sizes, 1)[0]
    assert all(len(buckets) == 1 for buckets in got[False]), got[False]  # 10**9 holds every group whole
    assert sum(len(buckets) for buckets in got[True]) >= 4, got[True]
    # a bucket takes whole parameters: at most the cap, or one parameter larger than it (plus alignment)
    limit = max(256, got["largest_param"]) + 64
    assert all(n <= limit for buckets in got[True] for n in buckets), got[True]
