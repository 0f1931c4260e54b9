"""The offload bench's arithmetic, pure (no torch, no device): which configurations are engines, and the
summary line: the hardware lower bound from the parts one run measured (T_gpu, the host Adam step, the PCIe
copies, the device step alone) and every engine's step against it, the price of the non-finite check
(`checked_over_unchecked`), and each engine against ours. scripts/bench/offload.py runs the
configurations and prints what this computes."""

from __future__ import annotations

from typing import Any

ENGINES = (
    "ours",
    "ours-host",
    "ours-clip",
    "ours-unchecked",
    "ours-waited",
    "ours-dpu",
    "ours-bf16grads",
    "ours-z3-param",
    "ours-z3-param-serial",
    "ours-device",
    "deepspeed",
)
SHARE_CONFIG = "ours-share"  # + a percentage: DSLAUNCH_OFFLOAD_HOST_SHARE


def share_of(name: str) -> float | None:
    """The host share an "ours-shareNN" configuration sets, else None."""
    digits = name.removeprefix(SHARE_CONFIG)
    if digits == name or not digits.isdigit() or int(digits) > 100:
        return None
    return int(digits) / 100


def engines(rows: dict[str, Any]) -> list[str]:
    """ENGINES and the host-share configurations among `rows`, in that order."""
    return [*ENGINES, *sorted((n for n in rows if share_of(n) is not None), key=share_of)]


def summarize(rows: dict[str, dict[str, Any]], accumulation: int = 1) -> dict[str, Any]:
    """The lower bound from the parts measured in this run, and every engine against it.

    An engine whose gradients landed as fp32 runs a different host step and moves twice the bytes, so it
    is held to that bound: torch's fused fp32 kernel and the fp32 copies. Rows that do not say how their
    gradients landed (ours-device) are held to the bf16 bound. Without every part of a bound
    (a configuration not run, or failed) that bound and its ratios are left out.

    The parts are one micro-batch's: an engine row of A micro-batches a step (its `accumulation`, else
    `accumulation` here) is held to (A-1)·T_gpu plus each bound, since only the last micro-batch can
    overlap the offloaded update. The summary's own bounds are at the A of the "ours" row (else of the
    first engine row); an engine row at another A carries `<name>_accumulation` beside its ratios."""
    adam, pcie = rows.get("adam", {}), rows.get("pcie", {})
    t_gpu = rows.get("gpu", {}).get("step_s")
    parts = {"gpu": t_gpu, "adam": adam.get("step_s"), "pcie": pcie.get("both_s")}
    parts32 = {**parts, "adam": adam.get("torch_fused_fp32_grads_s"), "pcie": pcie.get("both_fp32_s")}
    # the device step: the CPU Adam time is still torch's fused step (the best the host does), and
    # its PCIe time is what it moves, 12 bytes a parameter each way (three times the fp32 copies)
    both32 = pcie.get("both_fp32_s")
    parts_device = {**parts32, "pcie": None if both32 is None else 3 * both32}
    # the host's real floor for fp32 landing: its step with the copies sharing host memory bandwidth
    shared = adam.get("torch_fused_fp32_with_copies_s")
    host_floor = None if shared is None or t_gpu is None else max(t_gpu, shared)
    # the device step's: its update alone, every byte up and down included, or the GPU's compute
    alone = rows.get("devstep", {}).get("step_s")
    device_floor = None if alone is None or t_gpu is None else max(t_gpu, alone)
    names = engines(rows)
    steps_of = {n: rows.get(n, {}).get("accumulation", accumulation) for n in names}
    present = [n for n in names if n in rows]
    run_a = steps_of["ours"] if "ours" in rows else (steps_of[present[0]] if present else accumulation)

    def at(a: int, floor: float) -> float:  # a step of `a` micro-batches: the first a-1 run alone
        return floor + (a - 1) * t_gpu  # t_gpu is known wherever a floor is

    summary: dict[str, Any] = {
        "bench": "offload",
        "config": "summary",
        "accumulation": run_a,
        **{f"t_{k}_s": v for k, v in parts.items()},
    }
    bounds = {}
    for label, values in (("", parts), ("_fp32", parts32), ("_device", parts_device)):
        if all(v is not None for v in values.values()):
            bound = max(values.values())
            bounds[label] = (bound, sum(values.values()))
            summary.update(
                {
                    f"bound{label}_s": round(at(run_a, bound), 4),
                    f"serial{label}_s": round(at(run_a, sum(values.values())), 4),
                    f"bound{label}_by": max(values, key=values.get),
                }
            )
    if host_floor is not None:
        summary["host_floor_fp32_s"] = round(at(run_a, host_floor), 4)
    if device_floor is not None:
        summary["device_floor_s"] = round(at(run_a, device_floor), 4)
    for name in names:
        step = rows.get(name, {}).get("step_s")
        landing = rows.get(name, {}).get("grad_landing")
        label = {"float32": "_fp32", "device": "_device"}.get(landing, "")
        a = steps_of[name]
        if step is not None and a != run_a:
            summary[f"{name}_accumulation"] = a
        if step is not None and label in bounds:
            bound, serial = bounds[label]
            summary[f"{name}_over_bound"] = round(step / at(a, bound), 3)
            summary[f"{name}_over_serial"] = round(step / at(a, serial), 3)
            if label == "_fp32" and host_floor is not None:
                summary[f"{name}_over_host_floor"] = round(step / at(a, host_floor), 3)
        if step is not None and label == "_device" and device_floor is not None:
            summary[f"{name}_over_device_floor"] = round(step / at(a, device_floor), 3)
        micro = rows.get(name, {}).get("micro_s")
        if micro is not None and t_gpu is not None:  # the micro-batches that cannot overlap the update
            summary[f"{name}_micro_over_gpu"] = round(micro / t_gpu, 3)
        # ZeRO-3 offload_param: the upload stream's busy time against its bytes over this run's measured
        # host-to-device rate (issue 32 item 3 asks for 1.2x at most)
        row = rows.get(name, {})
        uploaded, busy = row.get("upload_bytes_per_step"), row.get("upload_s_per_step")
        if uploaded and busy and pcie.get("up_gb_per_s"):
            summary[f"{name}_upload_over_link"] = round(busy / (uploaded / (pcie["up_gb_per_s"] * 1e9)), 3)
    ours = rows.get("ours", {}).get("step_s")
    unchecked = rows.get("ours-unchecked", {}).get("step_s")
    if ours is not None and unchecked:  # the price of the non-finite check (issue 32 item 4)
        summary["checked_over_unchecked"] = round(ours / unchecked, 3)
    for name in names[1:]:
        other = rows.get(name, {}).get("step_s")
        if ours is not None and other is not None:
            summary[f"{name}_over_ours"] = round(other / ours, 3)
    return summary
