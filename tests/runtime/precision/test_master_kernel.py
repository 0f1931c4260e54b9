"""The one-pass bf16-master step (runtime/precision/master_kernel.py): `MasterAdam`'s update compiled by
inductor into one loop, the default for large parameters on a CPU host and on a GPU with Triton.

What a user relies on: it steps to the same weights and moments as the chunked step it replaced (torch's
fp32 arithmetic, but for the rare tie that a contracted multiply-add decides the other way), for AdamW
and Adam with L2 decay, bf16 or fp32 moments; stochastic rounding keeps updates far below a bf16 ulp,
with noise that depends only on the seed, the step and the parameter, so a resumed optimizer continues
exactly as the unbroken one; a parameter longer than one call's reach is stepped in pieces; a kernel
that does not build falls back to the chunked step with a warning instead of failing;
`DSLAUNCH_FUSED_MASTER_STEP=0` turns it off.

Device: CPU (inductor's C++ kernels), with `DSLAUNCH_FUSED_MASTER_STEP=1` for sizes below the default's
threshold; the `gpu` test compares the default on CUDA (a Triton kernel) with the chunked step.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

from runtime.precision import master_kernel
from runtime.precision.master_adam import MasterAdam

ENV = "DSLAUNCH_FUSED_MASTER_STEP"
N = 50_000


def _run(
    monkeypatch: pytest.MonkeyPatch,
    switch: str,
    *,
    steps: int = 5,
    device: str = "cpu",
    state_dtype: torch.dtype = torch.bfloat16,
    rounding: bool = False,
    decoupled: bool = True,
    seed: int = 0,
    optimizer: MasterAdam | None = None,
    param: torch.nn.Parameter | None = None,
) -> tuple[torch.nn.Parameter, MasterAdam]:
    """`steps` updates of a bf16 parameter from seeded gradients, with the switch at `switch`."""
    monkeypatch.setenv(ENV, switch)
    if param is None:
        param = torch.nn.Parameter(
            torch.randn(N, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
        )
    if optimizer is None:
        optimizer = MasterAdam(
            [param], lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, stochastic_rounding=rounding,
            decoupled_weight_decay=decoupled, seed=seed,
        )  # fmt: skip
    grads = torch.Generator().manual_seed(1 + len(optimizer.state))
    for _ in range(steps):
        param.grad = torch.randn(N, generator=grads).to(device, torch.bfloat16)
        optimizer.step()
    return param, optimizer


def _moments(optimizer: MasterAdam, param: torch.Tensor) -> list[torch.Tensor]:
    return [optimizer.state[param][key].float() for key in ("exp_avg", "exp_avg_sq")]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal but for a few elements a bf16 ulp apart: the kernel's fp32 arithmetic is torch's, but where
    the compiler contracts a multiply and an add, a last fp32 bit may differ and decide a tie between two
    bf16 numbers the other way (a moment rounded so moves its weight's later updates by a fraction of the
    lr, 1e-2)."""
    a, b = a.float(), b.float()
    ulp = torch.maximum(a.abs(), b.abs()) * 2.0**-8
    assert bool(((a - b).abs() <= ulp + 1e-4).all())
    assert (a != b).float().mean().item() < 0.001


@pytest.mark.parametrize(
    "state_dtype, decoupled",
    [(torch.bfloat16, True), (torch.float32, False)],
    ids=["adamw-bf16", "adam-fp32"],
)
def test_the_one_pass_step_equals_the_chunked_step(
    monkeypatch: pytest.MonkeyPatch, state_dtype: torch.dtype, decoupled: bool
) -> None:
    runs = [_run(monkeypatch, s, steps=20, state_dtype=state_dtype, decoupled=decoupled) for s in ("0", "1")]
    (chunked, chunked_opt), (one_pass, one_pass_opt) = runs
    assert not torch.equal(chunked, runs[0][0].new_zeros(N))
    _close(one_pass.detach(), chunked.detach())
    for a, b in zip(_moments(one_pass_opt, one_pass), _moments(chunked_opt, chunked), strict=True):
        if state_dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # m crosses zero: an absolute floor
        else:
            _close(a, b)


def test_stochastic_rounding_keeps_updates_far_below_an_ulp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights at 1.0 (bf16 ulp 2^-7) stepped 50 times by lr 1e-4 (Adam's step is lr for a constant
    gradient): round-to-nearest loses every update, the kernel's rounding keeps their sum on average."""
    monkeypatch.setenv(ENV, "1")
    drift = {}
    for rounding in (False, True):
        param = torch.nn.Parameter(torch.ones(N, dtype=torch.bfloat16))
        optimizer = MasterAdam([param], lr=1e-4, state_dtype=torch.float32, stochastic_rounding=rounding)
        for _ in range(50):
            param.grad = torch.ones(N, dtype=torch.bfloat16)
            optimizer.step()
        drift[rounding] = 1.0 - param.detach().float().mean().item()
    assert drift[False] == 0.0
    assert drift[True] == pytest.approx(50e-4, rel=0.02)


def test_the_noise_is_the_seed_step_and_parameter_s_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same seed: the same bits; another seed: other roundings; an optimizer rebuilt from a state_dict
    after 3 steps continues bit for bit as the unbroken one over 2 more."""
    first, _ = _run(monkeypatch, "1", rounding=True)
    again, _ = _run(monkeypatch, "1", rounding=True)
    other, _ = _run(monkeypatch, "1", rounding=True, seed=1)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)

    unbroken, unbroken_opt = _run(monkeypatch, "1", rounding=True, steps=3)
    saved = (unbroken.detach().clone(), copy.deepcopy(unbroken_opt.state_dict()))
    _run(monkeypatch, "1", steps=2, optimizer=unbroken_opt, param=unbroken)
    param = torch.nn.Parameter(saved[0])
    resumed = MasterAdam([param], lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16)
    resumed.load_state_dict(saved[1])
    _run(monkeypatch, "1", steps=2, optimizer=resumed, param=param)
    assert torch.equal(param, unbroken)


def test_a_long_parameter_is_stepped_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces change only the noise's key: without rounding, the pieces' result is the one call's."""
    whole, _ = _run(monkeypatch, "1")
    monkeypatch.setattr(master_kernel, "PIECE", 4096)  # 13 pieces, the last a short one
    pieces, _ = _run(monkeypatch, "1")
    assert torch.equal(whole, pieces)


def test_a_kernel_that_does_not_build_falls_back_to_the_chunked_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(*_: Any) -> Any:
        def update(*_: Any) -> None:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return update

    monkeypatch.setattr(master_kernel, "_refusals", {})
    monkeypatch.setattr(master_kernel, "update_for", no_compiler)
    with caplog.at_level(logging.WARNING, logger="runtime.precision.master_kernel"):
        fallback, _ = _run(monkeypatch, "1")
    chunked, _ = _run(monkeypatch, "0")
    assert torch.equal(fallback, chunked)
    assert "the chunked step runs" in caplog.text and "No working C++ compiler" in caplog.text


def test_the_default_takes_large_host_parameters_and_the_switch_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv(ENV, raising=False)
    assert not master_kernel.wanted(cpu, master_kernel.CPU_MIN_ELEMENTS - 1)
    assert master_kernel.wanted(cpu, master_kernel.CPU_MIN_ELEMENTS)
    monkeypatch.setenv(ENV, "0")
    assert not master_kernel.wanted(cpu, 10**10)
    monkeypatch.setenv(ENV, "1")
    assert master_kernel.wanted(cpu, 1)


@pytest.mark.gpu
def test_the_cuda_default_steps_as_the_host_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device: CUDA. The default there is the same arithmetic compiled by Triton. One step from the same
    state matches the CPU host's one-pass step but for ties (Triton's fp32 division and contractions
    differ in the last bit); over many steps such ties compound through the moments, so the rounding is
    held to its drift."""
    if not master_kernel.wanted(torch.device("cuda"), N):
        pytest.skip("Triton is not installed: the default on CUDA is the chunked step")
    host, _ = _run(monkeypatch, "1", steps=1)
    monkeypatch.delenv(ENV)
    cuda, _ = _run(monkeypatch, "", device="cuda", steps=1)
    assert master_kernel.refusal(cuda.device, (torch.bfloat16,) * 3, True, False) is None
    a, b = cuda.detach().cpu().float(), host.detach().float()
    assert bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2.0**-7).all())  # one bf16 ulp
    assert (a != b).float().mean().item() < 0.01
    param = torch.nn.Parameter(torch.ones(N, dtype=torch.bfloat16, device="cuda"))
    optimizer = MasterAdam([param], lr=1e-4, state_dtype=torch.float32)
    for _ in range(50):
        param.grad = torch.ones_like(param)
        optimizer.step()
    assert 1.0 - param.detach().float().mean().item() == pytest.approx(50e-4, rel=0.02)


def test_the_kernel_is_built_when_the_optimizer_is_made_not_in_its_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's bf16-master optimizer (`for_masters`) comes with its kernels built: the compile (14 s
    here on a cold cache, a minute on a 16-core host) is part of the setup, not a stall in step 1."""
    from runtime.precision.master_adam import for_masters

    events: list[str] = []
    probe = master_kernel.refusal

    def recording(*args: Any) -> str | None:
        events.append("probe")
        return probe(*args)

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(master_kernel, "refusal", recording)
    param = torch.nn.Parameter(torch.randn(N).to(torch.bfloat16))
    adam = for_masters(torch.optim.AdamW([param], lr=1e-2), torch.bfloat16, torch.bfloat16, True)
    assert isinstance(adam, MasterAdam) and events == ["probe"]
    key = ("cpu", torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True)
    assert master_kernel._refusals[key] is None  # built, and it ran
    param.grad = torch.randn(N).to(torch.bfloat16)
    before = param.detach().clone()
    adam.step()
    assert not torch.equal(param, before)  # the step ran the kernel the setup built
