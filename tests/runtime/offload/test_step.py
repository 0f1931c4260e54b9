"""The offloaded step's order and its refusals: gradients landing and updating during backward, what a
second boundary backward or a failed one does, the device step's downloads before any read of the state,
checkpoints resumed under the device step, and the host Adam kernel's chunks against torch's Adam.

On the CPU over gloo (the "device" is host memory), except where a test is marked `gpu`.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.runtime.offload.cases import SMALL_CHUNKS, offload_engine
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, rank_batch, with_offload_settings
from tests.support.parity import ROWS


def _streaming(rank: int, world_size: int, clip: float) -> dict:
    """What had happened on the host when backward produced its last gradient, and after the step."""

    model = make_model(0)
    seen: list[tuple[int, int]] = []
    engines: list = []

    def updates_started() -> int:
        streamed = engines[0].masters._streamed
        return 0 if streamed is None else streamed.updated

    def on_last_gradient(param: torch.nn.Parameter) -> None:
        # backward is held here until the host has updated a span (10 s at most): that happens only if
        # the updates run while backward runs
        landed = sum(engines[0].masters.grads.landed)
        deadline = time.monotonic() + 10
        while landed and updates_started() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append((landed, updates_started()))

    # registered first, so its gradient is the last one backward produces; hooked before the engine's hook
    # on it, so this sees the buckets that landed before that last gradient existed
    first = next(model.parameters())
    first.register_post_accumulate_grad_hook(on_last_gradient)
    _, engine, _ = offload_engine(2, bucket=300, clip=clip, model=model, check=False)
    engines.append(engine)
    x, y = rank_batch(0, 0, ROWS, rank, world_size)
    engine.backward(loss_fn(engine(x), y))
    landed_after = sum(engine.masters.grads.landed)
    engine.step()
    # a second step, so a streamed step also follows a completed one
    x, y = rank_batch(1, 0, ROWS, rank, world_size)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    out = {
        "landed_before_last": seen[0][0],
        "started_before_last": seen[0][1],
        "landed_after": landed_after,
        "spans": len(engine.masters.spans),
        "steps": [float(s["step"]) for s in engine.optimizer.state.values()],
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_gradients_land_and_update_during_backward_with_one_rank(clip: float) -> None:
    got = run_distributed(_streaming, 1, clip, timeout=60)[0]
    assert got["spans"] >= 3
    # earlier buckets were on the host while backward still ran
    assert 1 <= got["landed_before_last"] < got["spans"]
    assert got["landed_after"] == got["spans"]
    if clip == 0.0:
        # nothing waits on the gradient norm: landed buckets were updated while backward still ran
        assert 1 <= got["started_before_last"] <= got["landed_before_last"]
    else:
        # the clipping factor needs every gradient first: the update waits for engine.step()
        assert got["started_before_last"] == 0
    assert got["steps"] and all(step == 2.0 for step in got["steps"])


def _repeated_boundary_backward(rank: int, world_size: int) -> dict:
    _, engine, _ = offload_engine(1, bucket=300, check=False)
    x, y = rank_batch(0, 0, ROWS, rank, world_size)
    engine.backward(loss_fn(engine(x), y))
    try:
        engine.backward(loss_fn(engine(x), y))
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    engine.destroy()
    return {"error": error}


def test_a_second_boundary_backward_before_step_is_refused_once_the_update_started() -> None:
    got = run_distributed(_repeated_boundary_backward, 1, timeout=60)[0]
    assert "before engine.step()" in got["error"] and "checkpoint" in got["error"], got


def _delay_mid_step(rank: int, world_size: int) -> dict:
    from runtime.offload import enable_delayed_update

    _, engine, _ = offload_engine(2, bucket=300, check=False, offload={"update": "device"})
    x, y = rank_batch(0, 0, ROWS, rank, world_size)
    engine.backward(loss_fn(engine(x), y))  # the streamed device step has started
    try:
        enable_delayed_update(engine, after_steps=1)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    engine.step()  # the step the backward started still finishes
    out = {"error": error, "still_on_device": engine.masters.update_on_device}
    enable_delayed_update(engine, after_steps=1)  # between steps it is fine, and takes the CPU step
    out["after"] = engine.masters.update_on_device
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    out["steps"] = [float(s["step"]) for s in engine.optimizer.state.values()]
    engine.destroy()
    return out


def _state_reads_wait(rank: int, world_size: int) -> dict:
    _, engine, optimizer = offload_engine(2, bucket=300, offload={"update": "device"})
    waits = []
    step = engine.masters._split.device_step
    original = step.host_ready
    step.host_ready = lambda: (waits.append("wait"), original())[1]
    x, y = rank_batch(0, 0, ROWS, rank, world_size)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    before = len(waits)
    state = optimizer.state_dict()
    after_read = len(waits)
    optimizer.load_state_dict(state)
    after_load = len(waits)
    engine.destroy()
    return {"before": before, "after_read": after_read, "after_load": after_load}


def test_reading_the_optimizer_state_waits_for_the_device_steps_downloads() -> None:
    """The device step's downloads run past engine.step(): torch's optimizer.state_dict() and
    load_state_dict() wait for them (without a collective, so one rank alone may call them)."""
    got = run_distributed(_state_reads_wait, 1, timeout=60)[0]
    assert got["before"] == 0, got  # engine.step() itself does not wait for the host
    assert got["after_read"] == 1 and got["after_load"] == 2, got


def test_the_delayed_update_is_refused_between_a_boundary_backward_and_its_step() -> None:
    got = run_distributed(_delay_mid_step, 1, timeout=60)[0]
    assert "between engine.backward" in got["error"] and "after the step" in got["error"], got
    assert got["still_on_device"] and not got["after"], got
    assert got["steps"] and all(step == 2.0 for step in got["steps"]), got


class _FailInBackward(torch.autograd.Function):
    """Identity forward; backward raises, before any parameter has its gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def _backward_fails_before_anything_landed(rank: int, world_size: int) -> dict:
    _, engine, _ = offload_engine(2, bucket=300, check=False)
    x, y = rank_batch(0, 0, ROWS, rank, world_size)
    try:
        engine.backward(_FailInBackward.apply(loss_fn(engine(x), y)))
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    before = engine.full_state_dict()  # the fp32 masters
    engine.backward(loss_fn(engine(x), y))  # the retry is an ordinary step
    engine.step()
    after = engine.full_state_dict()
    out = {
        "error": error,
        "steps": [float(state["step"]) for state in engine.optimizer.state.values()],
        "moved": all(not torch.equal(after[n], before[n]) for n in before),
    }
    engine.destroy()
    return out


def test_a_backward_that_fails_before_any_gradient_landed_can_be_retried() -> None:
    got = run_distributed(_backward_fails_before_anything_landed, 1, timeout=60)[0]
    assert got["error"] == "backward failed on purpose"  # the error of the backward thread, unchanged
    assert got["steps"] and all(step == 1.0 for step in got["steps"]), got  # counted once, not twice
    assert got["moved"], "the retried step did not update the weights"


def _device_step_resume(rank: int, world_size: int, root: str, on_cpu: bool) -> dict:
    """bf16 GPT with the device step: 3 steps and a checkpoint; 6 steps straight, then that checkpoint
    loaded into the same engine (its last downloads possibly still running) and steps 3-5 again; a new
    engine that loads it (on CUDA its moments arrive in pageable memory and are pinned again) and steps
    3-5. `on_cpu`: the "device" is host memory, with small chunks and two slots, so that slots are
    reused within a step and across steps."""
    import runtime
    from runtime.models import GPT, GPTConfig

    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig.named("tiny"))
        config = {
            "train_batch_size": 4,
            "steps_per_print": 0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        }
        if on_cpu:  # asked for: on a CPU the engine would take the host step
            config["zero_optimization"]["offload_optimizer"]["update"] = "device"
            config = with_offload_settings(config, world_size=world_size, **SMALL_CHUNKS)
        engine, *_ = runtime.initialize(model=model, config=config)
        assert engine.masters.update_on_device, engine.masters.update.reason
        return engine

    def train(engine, steps: range) -> None:
        for step in steps:
            tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(step))
            tokens = tokens.to(engine.device)
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    engine = build()
    train(engine, range(3))
    engine.save_checkpoint(root, tag="mid")
    engine.destroy()
    engine = build()
    train(engine, range(6))
    straight = engine.full_state_dict()
    engine.load_checkpoint(root, tag="mid")
    train(engine, range(3, 6))
    again = engine.full_state_dict()
    engine.destroy()
    engine = build()
    engine.load_checkpoint(root, tag="mid")
    train(engine, range(3, 6))
    moments = [t for s in engine.optimizer.state.values() for k, t in s.items() if k.startswith("exp_avg")]
    memory = engine.masters.memory
    pinned = bool(moments) and all(memory.is_pinned(t) for t in moments)
    seen = [(tuple(t.shape), t.is_pinned(), memory.is_pinned(t), memory.pinned_bytes) for t in moments]
    resumed = engine.full_state_dict()
    engine.destroy()
    return {"equal": same(straight, resumed), "again": same(straight, again), "pinned": pinned, "seen": seen}


def test_device_step_resumes_exactly_also_into_an_engine_that_trained_on() -> None:
    """On gloo: loading a checkpoint into an engine that has trained with the device step (its slots hold
    the state the load replaces) trains on from the loaded state, bitwise like a new engine."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(_device_step_resume, 1, root, True, timeout=240)[0]
    assert got["equal"], "the resumed run ended with other weights than the straight one"
    assert got["again"], "the engine that loaded the checkpoint in place trained on from other weights"


@pytest.mark.gpu
def test_cuda_device_step_resumes_from_a_checkpoint_exactly(tmp_path) -> None:
    """The host state the device step streams is current when a checkpoint is saved (flush waits for the
    downloads), and a resumed run streams the loaded state (pinned again) to the same weights, in a new
    engine and in one that trained on (the load waits for its last downloads first)."""
    got = run_distributed(_device_step_resume, 1, str(tmp_path), False, timeout=240, device="cuda")[0]
    assert got["equal"], "the resumed run ended with other weights than the straight one"
    assert got["again"], "the engine that loaded the checkpoint in place trained on from other weights"
    assert got["pinned"], f"the loaded moments were not pinned for the device step: {got['seen']}"


@pytest.mark.parametrize("optimizer_kind", ["torch_adamw", "cpu_adam_l2"])
def test_host_adam_chunks_equal_torch_adam_on_the_whole_tensor(optimizer_kind: str) -> None:
    """Chunked updates from bf16 gradients with the scale in the kernel and bf16 weights written over the
    gradient equal torch's AdamW/Adam on the whole fp32 tensor with the gradient pre-divided."""
    from runtime.offload.io.spans import plan_chunks
    from runtime.offload.step.host_adam import HostAdam, supports
    from runtime.ops.adam import CPUAdam

    gen = torch.Generator().manual_seed(0)
    n = 5000
    ours = torch.nn.Parameter(torch.randn(n, generator=gen))
    ref = torch.nn.Parameter(ours.detach().clone())
    if optimizer_kind == "torch_adamw":
        opt = torch.optim.AdamW([ours], lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    else:
        opt = CPUAdam([ours], lr=1e-2, weight_decay=0.1, adamw_mode=False)
        ref_opt = torch.optim.Adam([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    assert supports(opt)
    host = HostAdam(opt, [ours])
    scale = 4.0
    for _ in range(4):
        grad = torch.randn(n, generator=gen).bfloat16()
        landing = grad.clone()
        host.begin_step()
        for offset, numel in plan_chunks(n, 1024):
            chunk = landing.narrow(0, offset, numel)
            host.update(0, offset, chunk, chunk, torch.tensor(scale))
        ref.grad = grad.float() / scale
        ref_opt.step()
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(landing, ours.detach().bfloat16())  # the copy-back buffer holds the new weights
    assert float(opt.state[ours]["step"]) == 4.0
    assert not supports(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], amsgrad=True))
    assert not supports(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1))
