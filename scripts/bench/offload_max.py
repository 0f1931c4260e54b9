"""--find_max of the offload benchmark (offload.py): the largest GPT that trains on this machine, and what
runtime.estimator.fit predicted for it.

GPT sizes from --sizes (n_embd:n_head:n_layer), micro batch 1 unless --micro_batch, seq --seq_len,
--stage (2; 3 with --offload_param too) with optimizer offload at --ratio (a number, or "auto": the engine
picks the host's share), --accumulation and --activation_checkpointing as given, --trial_steps steps each
(3; timed twice, synchronized and back to back), by --engine (ours, or deepspeed: at ratio 1, since
DeepSpeed has no "auto" and takes a ratio only at ZeRO-3; the records say so:
offload_work.deepspeed_ratio). The walk starts at the first size with at least
--start_params parameters and goes up while the runs succeed, or down until one does; one JSON line per
try and a summary with the largest size that trained.

Every try carries `estimate`: what runtime.estimator.fit.fit_gpt predicts for it on this machine (GPU memory
from the device, the host's available memory, both read once before the first try; the CPU step with 16-bit
landing, which the engine takes where the host is tight; for DeepSpeed 10 more host bytes a parameter, the 24
its own estimator budgets): fits, ratio, gpu_need_gib, host_need_gib. A size whose estimate exceeds the host's
memory is reported as skipped instead of tried, so the kernel's OOM killer never has to choose a victim
(--no_host_guard tries anyway). The summary adds estimated_largest_params, the largest of the same sizes the
estimate says fits, and estimate_error, estimated / trained - 1 (issue 23 asks for 5%).
Without DeepSpeed, --engine deepspeed stops at its first try, skipped, and the run does not fail.

--bf16_masters / --bf16_states (issue 32) go into every trial's config (bf16.bf16_master_weights_and_grads,
bf16.bf16_optimizer_states) and into the estimate as ds_estimate's --bf16_master_weights /
--bf16_optimizer_states do (Workload.master_dtype / state_dtype): 2-byte masters and bf16 moments, 6 bytes a
parameter of host state instead of 12. The summary gives the largest trained size's tokens/s, TFLOP/s, MFU,
setup and wall time, and its first and last loss (its trial's lines), with the flags it ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.estimator.fit import Machine, Workload, fit_gpt
from runtime.models import GPTConfig
from scripts.bench.common import emit, run_isolated
from scripts.bench.offload_work import deepspeed_ratio, model_config

RunWorker = Callable[[str, dict[str, Any], float], dict[str, Any]]
BEST_KEYS = (
    "ratio_achieved",
    "bf16_masters",
    "bf16_states",
    "host_bytes_per_param",
    "host_rss_gib",
    "peak_gpu_gib",
    "step_s",
    "tokens_per_s",
    "mfu",
    "tflops",
    "setup_s",
    "wall_s",
    "loss_first",
    "loss_last",
)

# DeepSpeed's walk: its own estimator (estimate_zero2_model_states_mem_needs) budgets 24 host bytes a
# parameter for ZeRO-2 offload on one GPU, where ours counts 14 (12 of state + 2 of landing). The 2 bytes
# of its fp32 gradient partition alone were not enough: at 6.65B, 16 bytes a parameter estimated 103 GiB of
# 124 GiB, and the kernel killed it during setup (BENCHMARKS.md, issue 23)
DEEPSPEED_EXTRA_HOST_BYTES_PER_PARAM = 24 - 14


def device_memory_bytes() -> int:
    """The GPU's total memory, asked in a child process: a CUDA context in this one would hold GPU memory
    through every trial."""
    code = "import json, torch; print(json.dumps(torch.cuda.mem_get_info(0)))"
    done = run_isolated([sys.executable, "-c", code], 180)
    try:
        return int(json.loads(done.stdout.strip().splitlines()[-1])[1])
    except (IndexError, ValueError, TypeError):
        raise RuntimeError(f"cannot read the GPU's memory: {done.stderr.strip()[-500:]}") from None


@dataclass(frozen=True)
class Estimator:
    """runtime.estimator.fit's verdict for each size of a walk: this machine, measured once before the first
    trial (each trial runs in a process that is gone before the next), and the walk's options."""

    machine: Machine
    work: Workload
    stage: int
    offload_param: bool
    ratio: float | str
    extra_host_per_param: int = 0  # bytes a parameter the engine keeps beyond what fit_gpt counts

    @classmethod
    def for_walk(cls, args: argparse.Namespace) -> Estimator:
        from runtime.memory import host_available_bytes

        host = host_available_bytes()
        # on the CPU the "device" is host memory too: the host side is the one that can run out
        gpu = device_memory_bytes() if args.device == "cuda" else host
        deepspeed = args.engine == "deepspeed"
        return cls(
            machine=Machine(gpu_bytes=gpu, host_bytes=host),
            work=Workload(
                seq_len=args.seq_len,
                micro_batch=args.micro_batch or 1,
                activation_checkpointing=args.activation_checkpointing,
                # as ds_estimate's --bf16_master_weights / --bf16_optimizer_states (fit_cli.run_fit)
                master_dtype="bf16" if args.bf16_masters else "fp32",
                state_dtype="bf16" if args.bf16_states else "fp32",
            ),
            stage=args.stage,
            offload_param=args.offload_param,
            ratio=deepspeed_ratio(vars(args))[0] if deepspeed else args.ratio,
            extra_host_per_param=DEEPSPEED_EXTRA_HOST_BYTES_PER_PARAM if deepspeed else 0,
        )

    def fit(self, config: GPTConfig) -> dict[str, Any]:
        """Does `config` fit: {fits, host_fits, ratio, gpu_need_gib, host_need_gib, reason}."""
        fit = fit_gpt(
            config,
            self.machine,
            self.work,
            stage=self.stage,
            offload_optimizer=True,
            offload_param=self.offload_param,
            ratio=self.ratio,
            # the CPU step with 16-bit landing: the engine's choice wherever host memory is tight (the
            # device step pins 12 bytes a parameter only where 16 are free: runtime/offload/plan.py), so
            # the one that decides where the host runs out
            host_step=True,
        )
        host_need = fit.host_need + self.extra_host_per_param * fit.params
        host_fits = host_need <= self.machine.host_bytes
        reason = fit.reason
        if self.extra_host_per_param:
            reason += f"; +{self.extra_host_per_param} B/param on the host (DeepSpeed's own estimate: 24)"
        return {
            "fits": fit.gpu_need <= self.machine.gpu_bytes and host_fits,
            "host_fits": host_fits,
            "ratio": None if fit.ratio is None else round(fit.ratio, 4),
            "gpu_need_gib": round(fit.gpu_need / 2**30, 1),
            "host_need_gib": round(host_need / 2**30, 1),
            "host_need_bytes": host_need,  # unrounded: small models' differences show
            "reason": reason,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "gpu_gib": round(self.machine.gpu_bytes / 2**30, 1),
            "host_available_gib": round(self.machine.host_bytes / 2**30, 1),
        }


def _host_shortfall(estimate: dict[str, Any], host_bytes: int) -> str | None:
    """Why the estimate says a size cannot fit in the host memory available, or None when it fits."""
    if estimate["host_fits"]:
        return None
    return (
        f"needs about {estimate['host_need_gib']:.1f} GiB of host memory, {host_bytes / 2**30:.1f} GiB "
        "available (runtime.estimator.fit; --no_host_guard tries)"
    )


def find_max(args: argparse.Namespace, spec: dict[str, Any], run_worker: RunWorker) -> int:
    """Walk --sizes (module docstring); `run_worker(name, spec, timeout)` runs one trial in its own
    process (offload.py's). Exit code: 0 when a size trained or the engine is not importable, else 1."""

    def config_of(size: dict[str, int]) -> GPTConfig:
        return model_config({**spec, **size})

    sizes = sorted(args.sizes, key=lambda s: config_of(s).num_params())
    estimator = Estimator.for_walk(args)
    # what the engine is asked for, and for DeepSpeed what it runs with instead and why
    asked: dict[str, Any] = {"engine": args.engine, "ratio": args.ratio}
    if args.engine == "deepspeed":
        asked["ratio"], note = deepspeed_ratio(spec)
        asked.update({"ratio_note": note} if note else {})
    index = next(
        (i for i, s in enumerate(sizes) if config_of(s).num_params() >= args.start_params), len(sizes) - 1
    )
    tried: dict[int, bool] = {}
    best: dict[str, Any] | None = None
    direction = 0
    skipped_engine = None  # DeepSpeed not importable: no size can say anything
    while 0 <= index < len(sizes) and index not in tried:
        size = sizes[index]
        estimate = estimator.fit(config_of(size))
        trial = {**spec, **size, "warmup": 0, "steps": args.trial_steps, "micro_batch": args.micro_batch or 1}
        short = None if args.no_host_guard else _host_shortfall(estimate, estimator.machine.host_bytes)
        if short is not None:  # do not wake the kernel's OOM killer: it may pick another process
            record = {"bench": "offload", "config": "trial", "skipped": short}
        else:
            record = run_worker("trial", trial, args.timeout)
            if args.engine != "ours" and str(record.get("skipped", "")).startswith("not importable"):
                skipped_engine = record["skipped"]
        record.update(size, params=config_of(size).num_params(), **asked, estimate=estimate)
        record["trained"] = "error" not in record and "skipped" not in record
        emit(record, args.out)
        tried[index] = record["trained"]
        if skipped_engine is not None:
            break
        if record["trained"] and (best is None or record["params"] > best["params"]):
            best = record
        step = 1 if record["trained"] else -1
        if direction and step != direction:
            break  # crossed the edge: the largest size that trains is known
        direction = step
        index += step
    fitting = [config_of(s) for s in sizes if estimator.fit(config_of(s))["fits"]]
    estimated = max(fitting, key=lambda c: c.num_params(), default=None)
    measured = None if best is None else best["params"]
    summary = {
        "bench": "offload",
        "config": "find_max_summary",
        **asked,
        "stage": args.stage,
        "offload_param": args.offload_param,
        "accumulation": args.accumulation,
        "bf16_masters": args.bf16_masters,
        "bf16_states": args.bf16_states,
        "trial_dpu": getattr(args, "trial_dpu", None),
        "micro_batch": args.micro_batch or 1,
        "seq_len": args.seq_len,
        "activation_checkpointing": args.activation_checkpointing,
        "largest_trained_params": measured,
        "largest_trained": None if best is None else {k: best[k] for k in ("n_embd", "n_head", "n_layer")},
        # the largest's memory on both sides, speed and loss, as its trial line gives them
        **{key: None if best is None else best.get(key) for key in BEST_KEYS},
        "tried": len(tried),
        # the estimator's answer over the same sizes and options, and how far it is from the walk's
        "estimated_largest_params": None if estimated is None else estimated.num_params(),
        "estimated_largest": None
        if estimated is None
        else {"n_embd": estimated.n_embd, "n_head": estimated.n_head, "n_layer": estimated.n_layer},
        "estimate_error": None
        if estimated is None or not measured
        else round(estimated.num_params() / measured - 1, 4),
        "estimate_machine": estimator.summary(),
    }
    if skipped_engine is not None:
        summary["skipped"] = skipped_engine
    emit(summary, args.out)
    print(json.dumps(summary, indent=1), file=sys.stderr)
    # DeepSpeed absent is not a failure of ours (as in the step mode): only a walk that ran and found
    # nothing is
    return 0 if best is not None or skipped_engine is not None else 1
