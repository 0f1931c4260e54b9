"""What each configuration of the offload benchmark (offload.py) measures, run in that configuration's own
process: the workload and its gpu part of the bound, and the engines (ours in its variants, DeepSpeed).
The parts of the bound that need no model (adam, pcie, devstep) are offload_parts.py's. The
configurations, the bound they make up and the command line are offload.py's; the method is in its
docstring.

DeepSpeed (work_deepspeed) is the real one or none: our compat/ package answers `import deepspeed` in a
checkout where it is installed, and is refused here as not importable. Its JIT-built CPU Adam is cached
in TORCH_EXTENSIONS_DIR, /tmp/dslaunch_torch_extensions unless the caller sets one.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.models import GPT, GPTConfig
from scripts.bench.common import median_time, mfu, real_deepspeed, steady_time, synchronize

LR, WEIGHT_DECAY = 1e-4, 0.01
Spec = dict[str, Any]


# -- the workload -----------------------------------------------------------------------------------------
def model_config(spec: Spec) -> GPTConfig:
    """A named size (spec["size"]) or n_embd/n_head/n_layer (--find_max), long enough for seq_len."""
    if "size" in spec:
        base = GPTConfig.named(spec["size"])
    else:
        base = GPTConfig(n_layer=spec["n_layer"], n_head=spec["n_head"], n_embd=spec["n_embd"])
    return GPTConfig(
        n_layer=base.n_layer,
        n_head=base.n_head,
        n_embd=base.n_embd,
        vocab_size=base.vocab_size,
        max_seq_len=max(base.max_seq_len, spec["seq_len"]),
    )


def _fresh_model(config: GPTConfig, device: torch.device, dtype: torch.dtype | None = None) -> GPT:
    """Seed 0, built on the device (seconds instead of minutes at 1.5B+), in `dtype` where given (torch's
    default, fp32, otherwise)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device):
            return GPT(config)
    finally:
        torch.set_default_dtype(default)


def build_dtype(spec: Spec) -> torch.dtype | None:
    """bf16 for the 16-bit masters (issue 32): no fp32 value of a weight is ever used, and an fp32 build
    would take 4 bytes a parameter of the GPU before the engine offloads anything (20B: 75 GiB, all of an
    H100's); None (fp32) otherwise, the fp32 masters' source."""
    return torch.bfloat16 if spec.get("bf16_masters") or spec.get("bf16_states") else None


def _batch(config: GPTConfig, spec: Spec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, config.vocab_size, (spec["micro_batch"], spec["seq_len"] + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def engine_config(spec: Spec, offload: bool) -> dict[str, Any]:
    """The DeepSpeed-style config shared by our engine and DeepSpeed. `spec["ratio"]` (a number, or the
    string "auto": the engine picks the share) goes through as offload_optimizer.ratio."""
    zero: dict[str, Any] = {"stage": spec["stage"], "overlap_comm": True, "contiguous_gradients": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if spec.get("ratio", 1.0) != 1.0:  # partial offload: the device keeps the rest of the state
            zero["offload_optimizer"]["ratio"] = spec["ratio"]
    if offload and spec.get("offload_param"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": spec.get("accumulation", 1),
        "gradient_clipping": spec["clip"],  # DeepSpeed 0.19.8 would default to 1.0
        "steps_per_print": 1_000_000,
        "bf16": bf16_section(spec),
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": spec.get("lr", LR),
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": WEIGHT_DECAY,
            },
        },
    }


def bf16_section(spec: Spec) -> dict[str, Any]:
    """The bf16 section of engine_config: `spec["bf16_masters"]` turns on bf16.bf16_master_weights_and_grads
    (2-byte masters, no fp32 copy), `spec["bf16_states"]` bf16.bf16_optimizer_states too (bf16 moments;
    implies the masters, as the config requires). Both keys are DeepSpeed 0.19.8's names."""
    section: dict[str, Any] = {"enabled": True}
    if spec.get("unchecked"):
        section["check_grad_overflow"] = False
    if spec.get("bf16_masters") or spec.get("bf16_states"):
        section["bf16_master_weights_and_grads"] = True
    if spec.get("bf16_states"):
        section["bf16_optimizer_states"] = True
    return section


# -- the parts of the bound -------------------------------------------------------------------------------
def work_gpu(spec: Spec, device: torch.device) -> dict[str, Any]:
    """Forward and backward alone, bf16 weights, no optimizer: T_gpu, a micro-batch's time. With
    accumulation A > 1 the loop accumulates A micro-batches into the gradients before it drops them, as
    any accumulating loop must (autograd adds into .grad after the first), and T_gpu is the mean of the
    window: the floor's (A-1) x T_gpu then holds what plain PyTorch pays for those micro-batches."""
    config = model_config(spec)
    model = _fresh_model(config, device).to(torch.bfloat16)
    x, y = _batch(config, spec, device)
    accumulation = spec.get("accumulation", 1)

    def step() -> None:
        for _ in range(accumulation):
            _, loss = model(x, y)
            loss.backward()
        for p in model.parameters():
            p.grad = None

    median, _ = median_time(step, device, spec["warmup"], spec["steps"])
    steady = steady_time(step, device, spec["steps"])
    median, steady = median / accumulation, steady / accumulation
    flops = config.flops_per_token(spec["seq_len"]) * spec["micro_batch"] * spec["seq_len"] / steady
    return {
        "accumulation": accumulation,
        "step_s": round(steady, 5),
        "step_synced_s": round(median, 5),
        "tflops": round(flops / 1e12, 1),
        "mfu": mfu(flops, device_name(device)),
    }


# -- the engines ------------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str | None:
    """The name the device's peak is looked up by (common.peak_bf16_flops); None on the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _host_rss_gib() -> float | None:
    try:
        import psutil

        return round(psutil.Process().memory_info().rss / 2**30, 2)
    except Exception:  # psutil missing or /proc unreadable: the number is optional
        return None


def _engine_steps(spec: Spec, device: torch.device, make: Callable[[GPT], Any]) -> dict[str, Any]:
    """Time `spec["steps"]` steps of an engine built by `make(model)`: back to back (step_s), then each
    between synchronizations (step_synced_s)."""
    config = model_config(spec)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    setup_start = time.perf_counter()
    model = _fresh_model(config, device, build_dtype(spec))
    if spec.get("checkpointing"):
        from runtime.activation_checkpointing import checkpoint

        model.checkpoint_fn = checkpoint
    engine = make(model)
    synchronize(device)
    setup_s = time.perf_counter() - setup_start
    x, y = _batch(config, spec, device)
    losses: list[torch.Tensor] = []
    accumulation = spec.get("accumulation", 1)

    def micro() -> torch.Tensor:  # one micro-batch (the same batch each time); the last of a step updates
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    def step() -> None:  # one optimizer step: `accumulation` micro-batches, then the update
        for _ in range(accumulation):
            loss = micro()
        losses.append(loss.detach())

    median, times = median_time(step, device, spec["warmup"], spec["steps"])
    steady = steady_time(step, device, spec["steps"])
    split = _split_step(micro, device, accumulation) if accumulation > 1 else {}
    tokens = spec["micro_batch"] * spec["seq_len"] * accumulation
    flops = config.flops_per_token(spec["seq_len"]) * tokens / steady
    result: dict[str, Any] = {
        "params": config.num_params(),
        "accumulation": accumulation,  # micro-batches a step: offload.py's floor depends on it
        "tflops": round(flops / 1e12, 1),
        "mfu": mfu(flops, device_name(device)),
        "setup_s": round(setup_s, 1),
        "step_s": round(steady, 4),
        "step_synced_s": round(median, 4),
        "step_synced_min_s": round(min(times), 4),
        "tokens_per_s": round(tokens / steady, 1),
        "build_dtype": "bfloat16" if build_dtype(spec) is not None else "float32",
        "loss_first": round(float(losses[0]), 4),
        "loss_last": round(float(losses[-1]), 4),
        "host_rss_gib": _host_rss_gib(),
        **split,
    }
    if device.type == "cuda":
        result["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return {"engine": engine, "result": result, "batch": (x, y)}


def _split_step(micro: Callable[[], Any], device: torch.device, accumulation: int) -> dict[str, float]:
    """One more step in two parts: the mean of its first A-1 micro-batches (`micro_s`, held to T_gpu) and
    the last with the update (`boundary_s`): which of the two an engine loses its floor in."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(accumulation - 1):
        micro()
    synchronize(device)
    middle = time.perf_counter()
    micro()
    synchronize(device)
    end = time.perf_counter()
    return {"micro_s": round((middle - start) / (accumulation - 1), 5), "boundary_s": round(end - middle, 4)}


def _phases(run: dict[str, Any], device: torch.device, steps: int = 3) -> dict[str, float]:
    """Medians of forward, backward and step, with a synchronization after each."""
    engine, (x, y) = run["engine"], run["batch"]
    split: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "step_s": []}
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        synchronize(device)
        t1 = time.perf_counter()
        engine.backward(loss)
        synchronize(device)
        t2 = time.perf_counter()
        engine.step()
        synchronize(device)
        t3 = time.perf_counter()
        for key, value in zip(split, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            split[key].append(value)
    return {key: round(statistics.median(values), 4) for key, values in split.items()}


def work_ours(
    spec: Spec, device: torch.device, *, offload: bool = True, dpu: int | None = None, phases: bool = True
) -> dict[str, Any]:
    """Our engine (offload.py's environment variables, set before, pick the update site and landing)."""
    import runtime
    import runtime.offload

    def make(model: GPT) -> Any:
        config: Any = engine_config(spec, offload)
        if "speculate" in spec:  # an internal offload setting (no config key): the loaded config's field
            config = _with_speculate(config, spec["speculate"])
        engine, _, _, _ = runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
        if dpu is not None:
            runtime.offload.enable_delayed_update(engine, after_steps=dpu)
        if spec.get("serial_uploads") and _uploads(engine) is not None:  # the A/B: as before the stream
            _uploads(engine).use_compute_stream()
        return engine

    run = _engine_steps(spec, device, make)
    result, engine = run["result"], run["engine"]
    breakdown = engine.memory_breakdown()
    host_bytes = breakdown.host_bytes + breakdown.host_buffer_bytes
    zero = engine.config.zero_optimization  # what the engine ran, read back from its resolved config
    result["stage"], result["offload_param"] = engine.zero_stage, zero.offload_param.device != "none"
    bf16 = engine.config.bf16  # issue 32's 16-bit masters and states, as the engine resolved them
    result["bf16_masters"] = bf16.bf16_master_weights_and_grads
    result["bf16_states"] = bf16.bf16_optimizer_states
    result["stochastic_rounding"] = bf16.bf16_master_weights_and_grads and bf16.stochastic_rounding
    result["device_state_gib"] = round(breakdown.device_model_state_bytes / 2**30, 2)
    result["host_state_gib"] = round(host_bytes / 2**30, 2)
    result["host_bytes_per_param"] = round(host_bytes / result["params"], 2)
    masters = _host_masters(engine) if offload else None
    if offload:  # the host's share of the optimizer state that the engine chose ("auto") or was given
        split = getattr(engine.masters, "split", None)  # partial offload: the host side is a HostMasters
        whole = 0.0 if masters is None else 1.0
        result["ratio_achieved"] = whole if split is None else round(split.achieved, 3)
    if masters is not None:
        result["pinned_gib"] = round(masters.memory.pinned_bytes / 2**30, 2)
        on_device = masters.update_on_device
        result["update"] = "device" if on_device else "host"
        # the device step lands no gradients (no landing buffers): its own bound (offload.py) counts the
        # state it streams
        landed = "device" if on_device else str(masters.grads.buffers[0].dtype).removeprefix("torch.")
        result["grad_landing"] = landed
        if on_device:
            result["host_share"] = masters.update.host_share
        result["speculative"] = masters.plan.speculate  # a checked step may update during backward
    if _uploads(engine) is not None:
        result.update(_upload_rows(run, device, spec))
    if phases:
        result["phases"] = _phases(run, device)
    engine.destroy()
    return result


def _with_speculate(config: dict[str, Any], speculate: bool) -> Any:
    """`config` loaded for one rank, with offload_optimizer's internal `speculate` setting replaced."""
    from dataclasses import replace

    from runtime.config import load_config

    loaded = load_config(config, world_size=1)
    zero = loaded.zero_optimization
    offload = replace(zero.offload_optimizer, speculate=speculate)
    return replace(loaded, zero_optimization=replace(zero, offload_optimizer=offload))


def _uploads(engine: Any) -> Any:
    """ZeRO-3 offload_param's uploads (runtime/zero/stage3_upload.py), else None."""
    offloaded = engine.config.zero_optimization.offload_param.device != "none"
    return engine.zero.uploads if engine.zero_stage == 3 and offloaded else None


def _upload_rows(run: dict[str, Any], device: torch.device, spec: Spec) -> dict[str, Any]:
    """ZeRO-3 offload_param: the host shards' uploads over `spec["steps"]` more steps, per step: their
    bytes and the upload stream's busy time (CUDA events around each upload), so the upload time can be
    held to bytes / the pcie row's host-to-device bandwidth."""
    engine, (x, y) = run["engine"], run["batch"]
    uploads = _uploads(engine)
    stats = uploads.stats
    steps = spec["steps"]
    synchronize(device)
    stats.reset()
    uploads.timed = True  # only here: two events per upload
    for _ in range(steps * spec.get("accumulation", 1)):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    synchronize(device)
    seconds = stats.seconds()
    uploads.timed = False
    rows = {
        "upload_serial": bool(spec.get("serial_uploads")),
        "uploads_per_step": stats.uploads // steps,
        "upload_bytes_per_step": stats.bytes // steps,
        "upload_s_per_step": round(seconds / steps, 4) if device.type == "cuda" else None,
    }
    if seconds > 0:
        rows["upload_gb_per_s"] = round(stats.bytes / seconds / 1e9, 2)
    return rows


def _host_masters(engine: Any) -> Any:
    """The engine's host side (a HostMasters, alone or in a PartialMasters), or None: at ratio 0 the
    device holds the whole optimizer state."""
    from runtime.offload.host_masters import HostMasters

    masters = getattr(engine.masters, "host", engine.masters)
    return masters if isinstance(masters, HostMasters) else None


# DeepSpeed compiles its CPU Adam on first use; its cache goes here unless the caller names one. Not under
# the repository: the GPU machine's copy of the git-ignored .whl/ is replaced at each call that carries it,
# while /tmp lasts as long as the machine
TORCH_EXTENSIONS_DIR = Path(tempfile.gettempdir()) / "dslaunch_torch_extensions"


def deepspeed_ratio(spec: Spec) -> tuple[float, str | None]:
    """The offload_optimizer.ratio DeepSpeed runs with for `spec`, and why it is not the one asked for
    (None when it is): DeepSpeed has no "auto" and takes a ratio only with ZeRO-3."""
    ratio, stage = spec.get("ratio", 1.0), spec["stage"]
    if ratio == 1.0:
        return 1.0, None
    if ratio == "auto":
        return 1.0, 'DeepSpeed has no "auto" ratio: it runs with the whole optimizer state on the host (1)'
    if stage != 3:
        return 1.0, (
            f"DeepSpeed takes offload_optimizer.ratio only with ZeRO-3: ratio {ratio:g} runs as 1 (the whole "
            f"optimizer state on the host) at stage {stage}"
        )
    return float(ratio), None


def work_deepspeed(spec: Spec, device: torch.device) -> dict[str, Any]:
    """DeepSpeed with the same config (DeepSpeedCPUAdam), where it imports; ImportError where it does not
    (the caller reports the configuration as skipped)."""
    import logging

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))
    ratio, note = deepspeed_ratio(spec)
    spec = {**spec, "ratio": ratio}
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed = real_deepspeed()  # never our compat package under its name
        deepspeed.utils.logger.setLevel(logging.WARNING)

        def make(model: GPT) -> Any:
            engine, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=engine_config(spec, True)
            )
            return engine

        run = _engine_steps(spec, device, make)
    result = run["result"]
    result["deepspeed"] = deepspeed.__version__
    result["ratio"] = ratio
    result.update(_deepspeed_states(spec, run["engine"]))
    if note is not None:
        result["ratio_note"] = note
    # its ZeRO-1/2 offload converts each gradient to fp32 on the GPU and copies it into an fp32 host
    # buffer, so it is held to the same bound as our fp32 landing
    result["grad_landing"] = "float32"
    return result


# DeepSpeed 0.19.8's engine asserts both bf16 keys need ZeRO stage 1, 2 or 3 (and the states the masters);
# whether its offload path keeps the moments in bf16 depends on the CPU Adam it builds. The row says what
# was asked and what its optimizer reports, where it has the attributes, rather than assume either.
DEEPSPEED_STATES_NOTE = (
    "DeepSpeed 0.19.8: bf16_master_weights_and_grads and bf16_optimizer_states at ZeRO stages 1-3 only "
    "(asserted by its engine); ds_* fields are what its optimizer reports (null: no such attribute)"
)


def _deepspeed_states(spec: Spec, engine: Any) -> dict[str, Any]:
    """The 16-bit state keys a DeepSpeed row asked for and what its ZeRO optimizer says it holds."""
    if not (spec.get("bf16_masters") or spec.get("bf16_states")):
        return {"bf16_masters": False, "bf16_states": False}
    optimizer = getattr(engine, "optimizer", None)
    reported = {
        name: getattr(optimizer, attr, None)
        for name, attr in (
            ("ds_bf16_masters", "bf16_master_weights_and_gradients"),
            ("ds_bf16_states", "bf16_optimizer_states"),
            ("ds_fp32_optimizer_states", "fp32_optimizer_states"),
        )
    }
    cpu_adam = getattr(optimizer, "optimizer", None)  # ZeRO wraps the (CPU) Adam it steps
    if reported["ds_fp32_optimizer_states"] is None and cpu_adam is not None:
        reported["ds_fp32_optimizer_states"] = getattr(cpu_adam, "fp32_optimizer_states", None)
    flags = {k: v if v is None or isinstance(v, bool) else str(v) for k, v in reported.items()}
    states = bool(spec.get("bf16_states"))
    return {"bf16_masters": True, "bf16_states": states, **flags, "bf16_note": DEEPSPEED_STATES_NOTE}
