"""Shared pytest set-up: the device every test trains on, and the real-sshd testbed (fake hosts on
127.0.0.x, see tests/support/sshd_testbed.py).

Device (the same on the 2-core CPU machine and on a GPU host):

- Every test trains on the CPU over gloo. `DS_ACCELERATOR=cpu` is set in this process when pytest starts,
  before any test module is imported, so the runtime here, every subprocess a test starts (train_gpt.py,
  the benchmarks, ds_estimate) and every worker dslaunch launches inherit it: the engine picks the CPU
  whatever LOCAL_RANK says, and the launcher starts CPU workers even where GPUs are visible.
  `tests.support.dist.run_distributed` sets it in each rank as well.
- A test marked `gpu` trains on CUDA (NCCL between ranks): `DS_ACCELERATOR=cuda` is set for that test
  alone, and the test is skipped, with the reason, where torch sees no CUDA device.

Fixtures:

- ``sshd_hosts`` (session): one shared testbed, 2 hosts x 2 slots, namespace-isolated where possible.
  Read-only use: do not stop hosts or change keys on it (use the factory for that).
- ``sshd_testbed_factory`` (session): ``make(n_hosts=2, slots=2, isolate="ns", sshd_extra="")`` returns a
  fresh, private Testbed; every testbed it made is stopped at the end of the session.

Both skip the test, with the reason, when the machine cannot run sshd servers (not root, no openssh-server).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator

import pytest

from tests.support import sshd_testbed
from tests.support.sshd_testbed import Testbed

TestbedFactory = Callable[..., Testbed]

ACCELERATOR_ENV = "DS_ACCELERATOR"  # runtime.distributed.ACCELERATOR_ENV; not imported: no torch here
GPU_SKIP_REASON = "marked gpu: needs a CUDA device, and torch sees none"


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: test modules and the processes they start all see the CPU choice.
    os.environ[ACCELERATOR_ENV] = "cpu"


@pytest.fixture(autouse=True)
def _device_of_the_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU for every test, CUDA for a test marked `gpu` (skipped without a CUDA device)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv(ACCELERATOR_ENV, "cpu")  # a test that changed it cannot leak into the next
        return
    import torch

    if not torch.cuda.is_available():
        pytest.skip(GPU_SKIP_REASON)
    monkeypatch.setenv(ACCELERATOR_ENV, "cuda")


@pytest.fixture(scope="session")
def sshd_testbed_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestbedFactory]:
    reason = sshd_testbed.unavailable_reason()
    made: list[Testbed] = []

    def make(n_hosts: int = 2, slots: int = 2, isolate: str = "ns", sshd_extra: str = "") -> Testbed:
        if reason:
            pytest.skip(reason)
        tb = sshd_testbed.start(
            tmp_path_factory.mktemp(f"sshd{n_hosts}x{slots}"), n_hosts, slots, isolate, sshd_extra
        )
        made.append(tb)
        if tb.notice:
            warnings.warn(tb.notice, stacklevel=2)
        return tb

    try:
        yield make
    finally:
        for tb in made:
            tb.stop()


@pytest.fixture(scope="session")
def sshd_hosts(sshd_testbed_factory: TestbedFactory) -> Testbed:
    return sshd_testbed_factory(2, 2)
