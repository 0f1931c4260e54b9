"""Shared pytest fixtures: the real-sshd testbed (fake hosts on 127.0.0.x), see tests/sshd_testbed.py.

- ``sshd_hosts`` (session): one shared testbed, 2 hosts x 2 slots, namespace-isolated where possible.
  Read-only use: do not stop hosts or change keys on it (use the factory for that).
- ``sshd_testbed_factory`` (session): ``make(n_hosts=2, slots=2, isolate="ns", sshd_extra="")`` returns a
  fresh, private Testbed; every testbed it made is stopped at the end of the session.

Both skip the test, with the reason, when the machine cannot run sshd servers (not root, no openssh-server).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest

from tests import sshd_testbed
from tests.sshd_testbed import Testbed

TestbedFactory = Callable[..., Testbed]


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
