"""Do the offload modes train the same model as no offload? Per-step losses of our engine in each mode, held
to the same engine without offload, on the same model and batch.

    python scripts/bench/offload_losses.py --size 5120:40:4 --modes none,full,r0.68,r0.68+ckpt,full+ckpt

Every mode runs in its own subprocess (offload.py's workload: a GPT of runtime.models, bf16, ZeRO
--stage, AdamW at --lr, one micro batch of --seq_len tokens repeated every step, so the loss falls fast
and any difference in the update shows). A mode is `none` (no offload), `full` (offload_optimizer, ratio
1), `rX` (ratio X) or `auto` (ratio "auto"), with `+ckpt` (every block recomputed in backward) and
`+param` (stage 3 with offload_param) as suffixes. The baseline is the first mode (`none` by default);
the summary line gives each mode's largest |loss - baseline| over the steps. On a GPU with bf16 the modes
may differ in the last bits (the fp32 paths of the CPU and GPU steps round differently); a mode that
diverges is a bug, not noise. Output: JSON lines (common.py's provenance), `--out` as in offload.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from scripts.bench.common import (  # noqa: E402
    add_out_argument,
    emit,
    environment,
    init_single_process_group,
    out_file,
    run_isolated,
)


def parse_mode(mode: str) -> dict[str, Any]:
    """`full+ckpt` -> the spec fields offload_work.engine_config and the worker read."""
    base, *flags = mode.split("+")
    unknown = [f for f in flags if f not in ("ckpt", "param")]
    if unknown or not (base in ("none", "full", "auto") or base.startswith("r")):
        raise argparse.ArgumentTypeError(f"mode {mode!r}: none|full|auto|rX, then +ckpt, +param")
    ratio: float | str = 1.0
    if base == "auto":
        ratio = "auto"
    elif base.startswith("r"):
        try:
            ratio = float(base[1:])
        except ValueError:
            raise argparse.ArgumentTypeError(f"mode {mode!r}: rX needs a number X") from None
    return {
        "offload": base != "none",
        "ratio": ratio,
        "checkpointing": "ckpt" in flags,
        "offload_param": "param" in flags,
    }


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One mode in this process: the losses of `spec["steps"]` steps."""
    import os

    import torch

    import runtime
    from scripts.bench.offload_work import _batch, _fresh_model, engine_config, model_config

    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    os.environ["DS_ACCELERATOR"] = device.type
    init_single_process_group(device)
    config = model_config(spec)
    model = _fresh_model(config, device)
    if spec["checkpointing"]:
        from runtime.activation_checkpointing import checkpoint

        model.checkpoint_fn = checkpoint
    stage = 3 if spec["offload_param"] else spec["stage"]
    ds_config = engine_config({**spec, "stage": stage}, spec["offload"])
    engine, *_ = runtime.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    x, y = _batch(config, spec, device)
    losses = []
    for _ in range(spec["steps"]):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(round(float(loss), 5))
    ratio = engine.config.zero_optimization.offload_optimizer.ratio
    engine.destroy()
    return {"losses": losses, "ratio": ratio if spec["offload"] else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="5120:40:4", help="n_embd:n_head:n_layer")
    parser.add_argument("--modes", default="none,full,r0.68,r0.68+ckpt,full+ckpt")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where torch sees one")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mode")
    add_out_argument(parser, "offload-losses")
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        d, h, layers = (int(v) for v in args.size.split(":"))
        modes = {m: parse_mode(m) for m in args.modes.split(",") if m}
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    out = out_file(args.out, "offload-losses")
    emit({"bench": "offload_losses", "config": "start", **environment(args.device)}, out)
    base = {"device": args.device, "n_embd": d, "n_head": h, "n_layer": layers, "micro_batch": 1}
    base.update(seq_len=args.seq_len, stage=args.stage, clip=0.0, steps=args.steps, lr=args.lr)
    rows: dict[str, list[float]] = {}
    for name, mode in modes.items():
        spec = {**base, **mode}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        done = run_isolated(cmd, args.timeout, cwd=REPO)
        record: dict[str, Any] = {"bench": "offload_losses", "config": name, "size": args.size}
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.timed_out or not lines:
            record["error"] = "timed out" if done.timed_out else done.stderr[-1500:]
        else:
            record.update(json.loads(lines[-1]))
            rows[name] = record["losses"]
        emit(record, out)
    baseline = next(iter(modes))
    summary: dict[str, Any] = {"bench": "offload_losses", "config": "summary", "baseline": baseline}
    if baseline in rows:
        for name, losses in rows.items():
            gaps = [abs(a - b) for a, b in zip(losses, rows[baseline], strict=True)]
            summary[f"{name}_max_abs_diff"] = round(max(gaps), 5)
    emit(summary, out)
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return 0 if len(rows) == len(modes) else 1


if __name__ == "__main__":
    sys.exit(main())
