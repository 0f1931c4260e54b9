"""CPUAdam / DeepSpeedCPUAdam / FusedAdam: parity with torch's reference Adam(W), the offload entry point
(flat buffers, bf16 grads in, bf16 weights out), state dicts, refusals, and the benchmark's output."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from runtime.ops.adam import AdamHyperparams, CPUAdam, DeepSpeedCPUAdam, FusedAdam, adam_step_
from tests.support.paths import REPO

REPO = REPO
STEPS = 20


def _grads(shapes: list[tuple[int, ...]], steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _params(shapes: list[tuple[int, ...]], seed: int = 1) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    # Two groups with their own lr and weight decay, as a model with no-decay biases would have.
    return [
        {"params": params[:2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0},
    ]


SHAPES = [(64, 33), (33,), (17, 5), (1000,)]


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_step_matches_torch_reference_over_20_steps(adamw_mode: bool) -> None:
    ours_p = _params(SHAPES)
    ref_p = _clone(ours_p)
    ours = CPUAdam(_groups(ours_p), betas=(0.9, 0.95), eps=1e-6, adamw_mode=adamw_mode)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = ref_cls(_groups(ref_p), betas=(0.9, 0.95), eps=1e-6, foreach=False)
    # The LR schedule must reach the kernel each step, as the engine's scheduler would change it.
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ours, ref)]
    for t, step_grads in enumerate(_grads(SHAPES, STEPS)):
        for p, q, g in zip(ours_p, ref_p, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        # A parameter without a gradient is skipped and its step count stays behind, as in torch.
        if t % 3 == 0:
            ours_p[1].grad = ref_p[1].grad = None
        ours.step()
        ref.step()
        for s in scheds:
            s.step()
    moved = max((q.detach() - p0).abs().max().item() for q, p0 in zip(ref_p, _params(SHAPES), strict=True))
    assert moved > 1e-3  # the weights really moved, so the comparison means something
    for p, q in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    for p, q in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(
            ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9
        )
        assert ours.state[p]["step"].item() == ref.state[q]["step"].item()
    assert ours.state[ours_p[1]]["step"].item() == STEPS - len(range(0, STEPS, 3))


def test_closure_loss_is_returned_and_grads_untouched() -> None:
    (p,) = _params([(8,)])
    opt = DeepSpeedCPUAdam([p], lr=0.1)
    assert DeepSpeedCPUAdam is CPUAdam

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    before = p.detach().clone()
    loss = opt.step(closure)
    assert loss is not None and loss.item() == pytest.approx((before**2).sum().item())
    assert torch.allclose(
        p.detach(), before - 0.1 * torch.sign(before), atol=1e-5
    )  # first Adam step = lr*sign


def test_without_bias_correction_matches_formula() -> None:
    (p,) = _params([(257,)])
    start = p.detach().clone()
    opt = CPUAdam([p], lr=1e-2, bias_correction=False, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-5)
    w, m, v = (
        start.clone().double(),
        torch.zeros(257, dtype=torch.float64),
        torch.zeros(257, dtype=torch.float64),
    )
    for (g,) in _grads([(257,)], 5):
        p.grad = g.clone()
        opt.step()
        g = g.double()
        w *= 1 - 1e-2 * 0.05
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        w -= 1e-2 * m / (v.sqrt() + 1e-5)  # no 1/(1 - beta^t) factors anywhere
    torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=1e-6)
    # The same run with bias correction ends far from it, so the formula check tells the two apart.
    q = torch.nn.Parameter(start.clone())
    corrected = CPUAdam([q], lr=1e-2, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-5)
    for (g,) in _grads([(257,)], 5):
        q.grad = g.clone()
        corrected.step()
    assert (q.detach() - p.detach()).abs().max() > 2e-3


@pytest.mark.parametrize("chunk", [0, 256, None], ids=["unchunked", "chunk256", "default_chunk"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_flat_bf16_grads_and_bf16_output_match_reference(chunk: int | None, adamw_mode: bool) -> None:
    n = 1000 + 37  # not a multiple of the chunk: the tail chunk is exercised
    master = torch.randn(n, generator=torch.Generator().manual_seed(3))
    ref_p = torch.nn.Parameter(master.clone())
    ours = CPUAdam([master], lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode, chunk_elems=chunk)
    ref = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(
        [ref_p], lr=1e-2, weight_decay=0.1, foreach=False
    )
    out = torch.empty(n, dtype=torch.bfloat16)
    for (g,) in _grads([(n,)], STEPS):
        grad16 = g.to(torch.bfloat16)
        before = grad16.clone()
        ours.step(grads=[grad16], out=[out])
        ref_p.grad = grad16.float()
        ref.step()
        assert torch.equal(grad16, before)  # the landed gradient buffer is only read
        # The bf16 copy for the GPU is exactly the new fp32 master weights rounded to bf16.
        assert torch.equal(out, master.to(torch.bfloat16))
    torch.testing.assert_close(master, ref_p.detach(), rtol=0, atol=1e-6)
    # ... and equals the reference fp32 weights rounded to bf16.
    assert torch.equal(out, ref_p.detach().to(torch.bfloat16))
    assert ours.state[master]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp32_grads_with_output_buffer(out_dtype: torch.dtype) -> None:
    n = 3000
    master = torch.randn(n, generator=torch.Generator().manual_seed(4))
    ref_p = torch.nn.Parameter(master.clone())
    ours = CPUAdam([master], lr=1e-3, weight_decay=0.01, chunk_elems=512)
    ref = torch.optim.AdamW([ref_p], lr=1e-3, weight_decay=0.01, foreach=False)
    out = torch.empty(n, dtype=out_dtype)
    for (g,) in _grads([(n,)], 5):
        ours.step(grads=[g.clone()], out=[out])
        ref_p.grad = g.clone()
        ref.step()
        assert torch.equal(out, master.to(out_dtype))
    torch.testing.assert_close(master, ref_p.detach(), rtol=0, atol=1e-6)


def test_grad_scale_is_applied_inside_the_step() -> None:
    # The engine folds loss scale and clipping into one divisor; a power of two keeps the check exact.
    n, scale = 777, 1024.0
    a = torch.randn(n, generator=torch.Generator().manual_seed(6))
    b = a.clone()
    opt_a = CPUAdam([a], lr=1e-2, weight_decay=0.1, chunk_elems=128)
    opt_b = CPUAdam([b], lr=1e-2, weight_decay=0.1, chunk_elems=128)
    out_a, out_b = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    for (g,) in _grads([(n,)], 6):
        scaled16 = (g * scale).to(torch.bfloat16)
        kept = scaled16.clone()
        opt_a.step(grads=[scaled16], out=[out_a], grad_scale=scale)
        opt_b.step(grads=[scaled16.float() / scale], out=[out_b])
        assert torch.equal(a, b) and torch.equal(out_a, out_b)
        assert torch.equal(scaled16, kept)  # a bf16 grad buffer is never written
    # fp32 grads take the kernel's direct path: they are left divided, as documented.
    (g,) = _grads([(n,)], 1)[0]
    grad32 = g * scale
    c, d = torch.zeros(n), torch.zeros(n)
    CPUAdam([c], lr=1e-2).step(grads=[grad32], grad_scale=torch.tensor(scale))
    CPUAdam([d], lr=1e-2).step(grads=[g.clone()])
    assert torch.equal(c, d)
    assert torch.equal(grad32, g)


def test_bf16_params_keep_fp32_states() -> None:
    n = 500
    p16 = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16))
    shadow = torch.nn.Parameter(p16.detach().float())
    ours = CPUAdam([p16], lr=1e-2, weight_decay=0.1, chunk_elems=128)  # fp32_optimizer_states defaults True
    ref = torch.optim.AdamW([shadow], lr=1e-2, weight_decay=0.1, foreach=False)
    for (g,) in _grads([(n,)], 10):
        # Reference: fp32 m, v; each update computed in fp32 from the bf16 weights, rounded once to bf16.
        with torch.no_grad():
            shadow.copy_(p16.detach().float())
        p16.grad = g.to(torch.bfloat16)
        shadow.grad = p16.grad.float()
        ours.step()
        ref.step()
        torch.testing.assert_close(p16.detach(), shadow.detach().to(torch.bfloat16), rtol=8e-3, atol=0)
    assert ours.state[p16]["exp_avg"].dtype == torch.float32
    assert (p16.detach() != shadow.detach().to(torch.bfloat16)).sum() <= 2  # rounding ties at most
    low = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    low_opt = CPUAdam([low], fp32_optimizer_states=False)
    low.grad = torch.ones(4, dtype=torch.bfloat16)
    low_opt.step()
    assert low_opt.state[low]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(low.detach(), torch.full((4,), -1e-3).to(torch.bfloat16))


def test_state_dict_round_trip_continues_identically() -> None:
    shapes = [(40, 3), (7,)]
    grads = _grads(shapes, 10)
    a = _params(shapes)
    opt_a = CPUAdam([{"params": a[:1]}, {"params": a[1:], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
    for step_grads in grads[:5]:
        for p, g in zip(a, step_grads, strict=True):
            p.grad = g.clone()
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    b = _clone(a)
    opt_b = CPUAdam([{"params": b[:1]}, {"params": b[1:], "weight_decay": 0.0}], lr=5.0, weight_decay=0.0)
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 1e-2 and opt_b.param_groups[1]["weight_decay"] == 0.0
    for step_grads in grads[5:]:
        for p, q, g in zip(a, b, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
    assert opt_b.state[b[0]]["step"].item() == 10


def test_state_dict_from_torch_adamw_loads_and_continues() -> None:
    # Same state keys as torch.optim.AdamW: a torch run can be resumed on CPUAdam.
    (p,) = _params([(300,)])
    q = _clone([p])[0]
    torch_opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=False)
    grads = _grads([(300,)], 8)
    for (g,) in grads[:4]:
        p.grad = g.clone()
        torch_opt.step()
    with torch.no_grad():
        q.copy_(p)
    ours = CPUAdam([q], lr=1e-2, weight_decay=0.1)
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for (g,) in grads[4:]:
        p.grad, q.grad = g.clone(), g.clone()
        torch_opt.step()
        ours.step()
    torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=1e-6)


def test_load_state_dict_keeps_fp32_states_for_bf16_params() -> None:
    p = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    opt = CPUAdam([p])
    p.grad = torch.randn(64).to(torch.bfloat16)
    opt.step()
    fresh = CPUAdam([p])
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch would cast m, v to bf16 here
    assert fresh.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_amsgrad_is_refused_with_a_clear_message() -> None:
    with pytest.raises(
        ValueError, match=r"amsgrad=True \(param group 0\) is not supported.*AdamW\(params, amsgrad"
    ):
        DeepSpeedCPUAdam(_params([(3,)]), amsgrad=True)
    with pytest.raises(ValueError, match=r"param group 1"):
        CPUAdam([{"params": _params([(3,)])}, {"params": _params([(2,)]), "amsgrad": True}])


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="param 0 of group 0 is not contiguous"):
        CPUAdam([torch.nn.Parameter(torch.randn(4, 6).t())])
    with pytest.raises(ValueError, match=r"dtype torch\.float64"):
        CPUAdam([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))])
    with pytest.raises(ValueError, match="beta2 must be in"):
        CPUAdam(_params([(3,)]), betas=(0.9, 1.0))
    master = torch.randn(100)
    opt = CPUAdam([master])
    with pytest.raises(ValueError, match="got 2 grads for 1 parameters"):
        opt.step(grads=[torch.randn(100), torch.randn(100)])
    with pytest.raises(ValueError, match=r"grads\[0\] has 99 elements but the parameter has 100"):
        opt.step(grads=[torch.randn(99)])
    with pytest.raises(ValueError, match=r"out\[0\] has dtype torch\.int32"):
        opt.step(grads=[torch.randn(100)], out=[torch.empty(100, dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"grad_scale must be a finite number > 0, got 0\.0"):
        opt.step(grads=[torch.randn(100)], grad_scale=0.0)
    with pytest.raises(ValueError, match="chunk_elems must be >= 0"):
        CPUAdam([master], chunk_elems=-1)
    assert master.isfinite().all() and not opt.state  # nothing was stepped by the refused calls


def test_refused_step_changes_nothing_and_callback_sees_finished_buffers() -> None:
    bufs = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    opt = CPUAdam([{"params": bufs[:2]}, {"params": bufs[2:], "lr": 0.1}], lr=1e-2, chunk_elems=128)
    grads = [torch.randn(300).to(torch.bfloat16) for _ in bufs]
    outs = [torch.empty(300, dtype=torch.bfloat16) for _ in bufs]
    before = [b.clone() for b in bufs]
    with pytest.raises(ValueError, match=r"out\[2\] has 299 elements"):
        opt.step(grads=grads, out=[*outs[:2], torch.empty(299, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"out\[1\] was given but parameter 1 has no gradient"):
        opt.step(grads=[grads[0], None, grads[2]], out=outs)
    assert all(torch.equal(a, b) for a, b in zip(bufs, before, strict=True)) and not opt.state

    seen: list[tuple[int, bool, bool]] = []

    def done(i: int) -> None:
        # Buffer i is final (its bf16 copy matches), the next one is still untouched.
        nxt = i + 1 < len(bufs) and torch.equal(bufs[i + 1], before[i + 1])
        seen.append((i, torch.equal(outs[i], bufs[i].to(torch.bfloat16)), nxt or i + 1 == len(bufs)))

    opt.step(grads=[grads[0], None, grads[2]], out=[outs[0], None, outs[2]], on_param_done=done)
    assert seen == [(0, True, True), (2, True, True)]
    assert torch.equal(bufs[1], before[1]) and not torch.equal(bufs[2], before[2])


def test_adam_step_functional_core() -> None:
    # The offload engine may call the functional core directly on its flat buffers.
    n = 2048 + 5
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    ref = torch.nn.Parameter(p.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=False)
    hp = AdamHyperparams(lr=1e-3, weight_decay=0.01)
    scratch = torch.empty(512)
    out = torch.empty(n, dtype=torch.float16)
    for step, (g,) in enumerate(_grads([(n,)], 4), start=1):
        adam_step_(p, g.half(), m, v, step, hp, out=out, chunk_elems=512, scratch=scratch)
        ref.grad = g.half().float()
        ref_opt.step()
    torch.testing.assert_close(p, ref.detach(), rtol=0, atol=1e-6)
    assert torch.equal(out, p.half())
    with pytest.raises(ValueError, match="scratch must be a contiguous"):
        adam_step_(p, g.half(), m, v, 5, hp, chunk_elems=512, scratch=torch.empty(10))
    with pytest.raises(ValueError, match="step counts updates from 1"):
        adam_step_(p, g, m, v, 0, hp)


def test_fused_adam_alias_matches_torch() -> None:
    shapes = [(20, 4), (9,)]
    ours_p = _params(shapes)
    ref_p = _clone(ours_p)
    ours = FusedAdam(ours_p, lr=1e-2, weight_decay=0.1)  # adam_w_mode=True by default, as in DeepSpeed
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, foreach=False)
    for step_grads in _grads(shapes, 10):
        for p, q, g in zip(ours_p, ref_p, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="bias_correction=False is not supported"):
        FusedAdam(_params([(3,)]), bias_correction=False)


@pytest.mark.timeout(120)
def test_benchmark_reports_every_variant_with_consistent_bandwidth() -> None:
    n = 200_000
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench/cpu_adam.py"), "--sizes", str(n), "--rounds", "2",
         "--warmup", "1", "--chunks", "4096", "--no-deepspeed"],
        capture_output=True, text=True, timeout=110, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout is JSON lines only
    assert records[0]["event"] == "env" and records[0]["threads"] >= 1
    results = {r["variant"]: r for r in records if r["event"] == "result"}
    assert set(results) >= {
        "memcpy",
        "torch_adamw_fused",
        "torch_adamw_foreach",
        "ours",
        "ours_out_bf16",
        "ours_out_bf16_unchunked",
        "ours_bf16grad_out_bf16",
        "ours_bf16grad_out_bf16_chunk4096",
        "ours_bf16grad_out_bf16_unchunked",
    }
    assert results["ours"]["bytes_per_param"] == 28 and results["ours_out_bf16"]["bytes_per_param"] == 30
    for r in results.values():
        assert r["gbps"] == pytest.approx(r["bytes_per_param"] * n / r["median_s"] / 1e9, rel=0.02, abs=1e-3)
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
    (summary,) = [r for r in records if r["event"] == "summary"]
    assert summary["best_baseline"] in ("torch_adamw_fused", "torch_adamw_foreach")
    assert summary["ours_speedup_vs_best"] == pytest.approx(
        results[summary["best_baseline"]]["median_s"] / results["ours"]["median_s"], rel=0.01
    )
