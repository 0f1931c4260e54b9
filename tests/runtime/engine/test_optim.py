"""runtime.optim: optimizers from the config section, our Lamb against a hand-written reference, and the
DeepSpeed lr schedules against values computed by hand."""

from __future__ import annotations

import io
import math

import pytest
import torch

from runtime.config import ConfigError, OptimizerConfig, SchedulerConfig, load_config
from runtime.optim import (
    Lamb,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    adam_implementation,
    build_optimizer,
    build_scheduler,
)


def _params(seed: int = 0, shapes=((4, 3), (3,))) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float32) for s in shapes]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


# ---------------------------------------------------------------------------------------------------------
# Adam / AdamW / SGD from the config


def test_deepspeed_adam_is_adamw_by_default_and_fused_on_cpu():
    params = _params()
    opt = build_optimizer(OptimizerConfig("Adam", {"lr": 1e-2, "weight_decay": 0.1}), params)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    l2 = build_optimizer(OptimizerConfig("adam", {"adam_w_mode": False, "weight_decay": 0.1}), _params())
    assert type(l2) is torch.optim.Adam and l2.defaults["weight_decay"] == 0.1


def test_built_adamw_matches_torch_reference_on_plain_fp32_shards():
    """The engine hands flat fp32 master shards (plain leaf tensors with .grad set by hand)."""
    ours = [torch.randn(1000, generator=torch.Generator().manual_seed(3))]
    ref = [ours[0].clone()]
    opt = build_optimizer(
        OptimizerConfig("AdamW", {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}), ours
    )
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=False)
    for step in range(10):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
    moved = (ours[0] - _params(3, ((1000,),))[0]).abs().max().item()
    assert moved > 1e-2  # the optimizer really stepped
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-6)


def test_param_groups_keep_their_overrides_and_take_config_defaults():
    w, b = _params()
    opt = build_optimizer(
        OptimizerConfig("AdamW", {"lr": 1e-3, "weight_decay": 0.1}),
        [{"params": [w]}, {"params": [b], "weight_decay": 0.0, "lr": 5e-4}],
    )
    g0, g1 = opt.param_groups
    assert (g0["lr"], g0["weight_decay"]) == (1e-3, 0.1)
    assert (g1["lr"], g1["weight_decay"]) == (5e-4, 0.0)
    assert g0["betas"] == (0.9, 0.999) and g0["eps"] == 1e-8


def test_sgd_from_config_matches_torch_sgd():
    ours, ref = _params(), _params()
    cfg = OptimizerConfig("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4})
    opt = build_optimizer(cfg, ours)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    for step in range(3):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_fused_only_when_every_tensor_can_take_it():
    assert adam_implementation([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)]) == {"fused": True}
    assert adam_implementation([torch.zeros(2), torch.zeros(2, device="meta")]) == {}


@pytest.mark.gpu
def test_fused_adamw_steps_masters_on_the_gpu_and_the_host_in_one_optimizer():
    """CUDA: partial optimizer offload keeps some masters on the GPU and the rest on the host in one
    optimizer; fused AdamW steps both (each device's own kernel) like one optimizer per device, and a
    master without a gradient (the host's, which the host side updates itself) is left alone."""
    torch.manual_seed(0)
    start = [torch.randn(1000), torch.randn(300)]
    grads = [torch.randn(1000), torch.randn(300)]
    mixed = [torch.nn.Parameter(start[0].cuda()), torch.nn.Parameter(start[1].clone())]
    assert adam_implementation(mixed) == {"fused": True}
    opt = torch.optim.AdamW(mixed, lr=1e-2, weight_decay=0.1, **adam_implementation(mixed))
    alone = [torch.nn.Parameter(start[0].cuda()), torch.nn.Parameter(start[1].clone())]
    refs = [torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=True) for p in alone]
    for step in range(3):
        for params in (mixed, alone):
            params[0].grad = grads[0].cuda() * (step + 1)
            params[1].grad = grads[1] * (step + 1) if step < 2 else None  # the last step skips the host's
        opt.step()
        for ref in refs[: 2 if step < 2 else 1]:
            ref.step()
    for got, want in zip(mixed, alone, strict=True):
        torch.testing.assert_close(got.detach().cpu(), want.detach().cpu())


def test_optimizer_config_made_in_code_is_checked_with_the_key_path():
    with pytest.raises(ConfigError, match=r"^optimizer\.params\.lr: expected a number >= 0\.0, got -1\.0"):
        build_optimizer(OptimizerConfig("AdamW", {"lr": -1.0}), _params())
    with pytest.raises(
        ConfigError, match=r'^optimizer\.params\.momentun: unknown key; did you mean "momentum"'
    ):
        build_optimizer(OptimizerConfig("SGD", {"momentun": 0.9}), _params())
    with pytest.raises(ValueError, match="got no parameters"):
        build_optimizer(OptimizerConfig("AdamW", {}), [])


# ---------------------------------------------------------------------------------------------------------
# Lamb


def _lamb_reference(
    params, grads_per_step, lr, betas, eps, wd, bias_correction, max_coeff, min_coeff, inside
):
    """Plain float64 LAMB with DeepSpeed's FusedLamb semantics, written from its description."""
    b1, b2 = betas
    ps = [p.double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_per_step, start=1):
        for p, m, v, g in zip(ps, ms, vs, grads, strict=True):
            g = g.double()
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            denom = torch.sqrt(v + eps) if inside else torch.sqrt(v) + eps
            u = m / denom + wd * p
            w_norm, u_norm = p.norm().item(), u.norm().item()
            trust = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
            p.sub_(step_size * trust * u)
    return ps


@pytest.mark.parametrize(
    ("start", "expected", "trust"),
    [
        # ||p|| = 5, update ~ (3.162, 3.162): trust = 5 / 4.472 = 1.118; step 1 moves lr * trust per element.
        ([3.0, 4.0], [2.8881966, 3.8881966], 1.118034),
        ([300.0, 400.0], [299.0, 399.0], 10.0),  # trust 111.8 clamped to max_coeff
        ([0.003, 0.004], [0.002, 0.003], 0.01),  # trust 0.0011 clamped to min_coeff
        ([0.0, 0.0], [-0.1, -0.1], 1.0),  # zero weights: trust is 1
    ],
)
def test_lamb_first_step_against_hand_computed_values(start, expected, trust):
    p = torch.tensor(start, dtype=torch.float64)
    p.grad = torch.ones(2, dtype=torch.float64)
    opt = Lamb([p], lr=0.1, eps=0.0)
    opt.step()
    torch.testing.assert_close(p, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    assert opt.state[p]["trust_ratio"].item() == pytest.approx(trust, rel=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {"weight_decay": 0.01},
        {"weight_decay": 0.0, "bias_correction": False},
        {"weight_decay": 0.05, "eps_inside_sqrt": True, "max_coeff": 2.0, "min_coeff": 0.5},
    ],
)
def test_lamb_from_config_matches_reference_over_several_steps(options):
    params = _params(7, ((8, 5), (5,), (1,)))
    start = [p.clone() for p in params]
    grads = []
    for step in range(6):
        _set_grads(params, step)
        grads.append([p.grad.clone() for p in params])
    lamb_params = {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-6, **options}
    opt = build_optimizer(OptimizerConfig("Lamb", lamb_params), params)
    assert isinstance(opt, Lamb)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        opt.step()
    expected = _lamb_reference(
        start,
        grads,
        lr=0.02,
        betas=(0.9, 0.99),
        eps=1e-6,
        wd=options["weight_decay"],
        bias_correction=options.get("bias_correction", True),
        max_coeff=options.get("max_coeff", 10.0),
        min_coeff=options.get("min_coeff", 0.01),
        inside=options.get("eps_inside_sqrt", False),
    )
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.double(), e, rtol=1e-5, atol=1e-6)


def test_lamb_state_dict_round_trip_continues_identically():
    a = _params(1)
    b = [p.clone() for p in a]
    opt_a = Lamb(a, lr=0.01, weight_decay=0.01)
    for step in range(3):
        _set_grads(a, step)
        opt_a.step()
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    for dst, src in zip(b, a, strict=True):
        dst.copy_(src)
    opt_b = Lamb(b, lr=0.01, weight_decay=0.01)
    buffer.seek(0)
    opt_b.load_state_dict(torch.load(buffer))
    for step in range(3, 6):
        _set_grads(a, step)
        _set_grads(b, step)
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# Schedulers: DeepSpeed iteration it (-1 before the first step) -> lr, computed by hand


def _trace(sched, opt, last_it: int, key: str = "lr") -> dict[int, float]:
    def read() -> float:
        value = opt.param_groups[0][key]
        return value[0] if key == "betas" else value

    out = {-1: read()}
    for it in range(last_it + 1):
        opt.step()
        sched.step()
        out[it] = read()
    return out


def _sgd(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=lr)


def _adam(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.zeros(2, requires_grad=True)], lr=lr)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (
            {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10},  # log warmup (the default)
            {-1: 0.0, 0: 0.0, 1: 0.0030103, 4: 0.0069897, 9: 0.01, 15: 0.01},
        ),
        (
            {"warmup_min_lr": 0.001, "warmup_max_lr": 0.011, "warmup_num_steps": 10, "warmup_type": "linear"},
            {-1: 0.001, 0: 0.001, 4: 0.005, 9: 0.010, 10: 0.011, 30: 0.011},
        ),
    ],
)
def test_warmup_lr_values(params, expected):
    opt = _sgd()
    trace = _trace(build_scheduler(SchedulerConfig("WarmupLR", params), opt), opt, max(expected))
    for it, lr in expected.items():
        assert trace[it] == pytest.approx(lr, abs=1e-7), it


def test_warmup_decay_lr_values():
    opt = _sgd()
    params = {"warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear", "total_num_steps": 20}
    trace = _trace(build_scheduler(SchedulerConfig("WarmupDecayLR", params), opt), opt, 25)
    expected = {-1: 0.0, 5: 0.05, 10: 0.1, 15: 0.05, 19: 0.01, 20: 0.0, 25: 0.0}
    for it, lr in expected.items():
        assert trace[it] == pytest.approx(lr, abs=1e-9), it


def test_warmup_cosine_lr_values():
    opt = _sgd(lr=0.1)
    params = {
        "total_num_steps": 20,
        "warmup_num_steps": 10,
        "warmup_type": "linear",
        "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.01,
    }
    trace = _trace(build_scheduler(SchedulerConfig("WarmupCosineLR", params), opt), opt, 40)
    expected = {-1: 0.0, 0: 0.01, 5: 0.055, 9: 0.091, 10: 0.0975773, 14: 0.0505, 19: 0.001, 40: 0.001}
    for it, lr in expected.items():
        assert trace[it] == pytest.approx(lr, abs=1e-7), it


ONE_CYCLE = {
    "cycle_min_lr": 0.01,
    "cycle_max_lr": 0.1,
    "cycle_first_step_size": 4,
    "cycle_second_step_size": 2,
    "decay_lr_rate": 0.5,
    "decay_step_size": 2,
    "cycle_min_mom": 0.8,
    "cycle_max_mom": 0.9,
    "decay_mom_rate": 0.01,
}


def test_one_cycle_lr_and_momentum_values():
    opt = _adam()
    sched = build_scheduler(SchedulerConfig("OneCycle", ONE_CYCLE), opt)
    lrs = _trace(sched, opt, 9)
    expected_lr = {-1: 0.01, 0: 0.0325, 1: 0.055, 3: 0.1, 4: 0.055, 5: 0.01, 6: 0.008, 9: 0.005}
    for it, lr in expected_lr.items():
        assert lrs[it] == pytest.approx(lr, abs=1e-9), it
    opt = _adam()
    moms = _trace(build_scheduler(SchedulerConfig("OneCycle", ONE_CYCLE), opt), opt, 9, key="betas")
    expected_mom = {-1: 0.9, 0: 0.875, 1: 0.85, 3: 0.8, 5: 0.9, 6: 0.9045, 9: 0.918}
    for it, mom in expected_mom.items():
        assert moms[it] == pytest.approx(mom, abs=1e-9), it
    assert opt.param_groups[0]["betas"][1] == 0.999  # beta2 is the optimizer's own


def test_one_cycle_stairs_hold_the_lr_flat():
    opt = _sgd()
    params = {**ONE_CYCLE, "cycle_first_stair_count": 2, "cycle_momentum": False}
    lrs = _trace(build_scheduler(SchedulerConfig("OneCycle", params), opt), opt, 5)
    assert [round(lrs[it], 9) for it in range(6)] == [0.01, 0.055, 0.055, 0.1, 0.055, 0.01]


def test_one_cycle_cycles_sgd_momentum():
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.5)
    moms = _trace(build_scheduler(SchedulerConfig("OneCycle", ONE_CYCLE), opt), opt, 3, key="momentum")
    assert moms[-1] == pytest.approx(0.9) and moms[3] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("type_name", "params"),
    [
        ("WarmupLR", {"warmup_num_steps": 5}),
        ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 12}),
        ("WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 12}),
        ("OneCycle", ONE_CYCLE),
    ],
)
def test_scheduler_state_dict_round_trip_continues_identically(type_name, params):
    config = SchedulerConfig(type_name, params)
    opt_a = _adam(0.05)
    sched_a = build_scheduler(config, opt_a)
    for _ in range(7):
        opt_a.step()
        sched_a.step()
    buffer = io.BytesIO()
    torch.save({"opt": opt_a.state_dict(), "sched": sched_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    opt_b = _adam(0.05)
    sched_b = build_scheduler(config, opt_b)
    opt_b.load_state_dict(saved["opt"])
    sched_b.load_state_dict(saved["sched"])
    assert sched_b.last_batch_iteration == 6
    for _ in range(6):
        for opt, sched in ((opt_a, sched_a), (opt_b, sched_b)):
            opt.step()
            sched.step()
        assert sched_b.get_last_lr() == sched_a.get_last_lr()
        assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
        assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]


def test_last_batch_iteration_resumes_the_schedule():
    opt = _sgd()
    sched = WarmupLR(
        opt, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=4
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.004) and sched.last_batch_iteration == 4
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)


def test_warmup_targets_each_groups_own_lr_when_max_is_not_set():
    opt = torch.optim.SGD(
        [
            {"params": [torch.zeros(1, requires_grad=True)], "lr": 0.1},
            {"params": [torch.zeros(1, requires_grad=True)]},
        ],
        lr=0.02,
    )
    sched = WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    for _ in range(3):
        opt.step()
        sched.step()
    assert sched.get_last_lr() == pytest.approx([0.1, 0.02])  # it = 2: warmup done, decay not begun
    with pytest.raises(ValueError, match="warmup_min_lr: 3 values given for 2 optimizer param groups"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.0, 0.0])


def test_cosine_uses_the_groups_lr_and_schedules_from_a_loaded_config():
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.2}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 4, "warmup_num_steps": 2}},
        },
        world_size=1,
    )
    opt = build_optimizer(cfg.optimizer, [torch.zeros(3, requires_grad=True)])
    sched = build_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupCosineLR)
    trace = _trace(sched, opt, 4)
    # log warmup over max(2, 2) steps: it 0 -> ratio 0, it 1 -> log(2)/log(2) = 1; cosine to 1e-4 by it 3.
    assert trace[0] == 0.0 and trace[1] == pytest.approx(0.2)
    assert trace[2] == pytest.approx(0.2 * (1e-4 + (1 - 1e-4) * 0.5)) and trace[4] == pytest.approx(
        0.2 * 1e-4
    )


def test_scheduler_config_made_in_code_is_checked_with_the_key_path():
    with pytest.raises(ConfigError, match=r"^scheduler\.params\.cycle_min_lr: required"):
        build_scheduler(SchedulerConfig("OneCycle", {"cycle_max_lr": 0.1}), _sgd())
    with pytest.raises(
        ConfigError, match=r'^scheduler\.type: unknown scheduler "WarmUpLRR"; did you mean "WarmupLR"'
    ):
        build_scheduler(SchedulerConfig("WarmUpLRR", {}), _sgd())
    assert isinstance(build_scheduler(SchedulerConfig("onecycle", ONE_CYCLE), _sgd()), OneCycle)
