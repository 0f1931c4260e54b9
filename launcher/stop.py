"""The stop sequence: ask politely, wait a grace period, then kill. One state machine for both places
that stop processes: the node agent stopping its workers' process groups (SIGTERM, SIGKILL) and the
head stopping its node agents (``stop``, ``kill``). It decides *when*; its owner decides *how*.

States, in order (never backwards)::

    RUNNING --stop--> STOPPING --grace over / kill / second interrupt--> KILLING --finish--> DONE

Only three things turn a stop into a kill: the end of the grace period, an explicit kill, and a second
*interrupt* (a signal sent to us: the user's second Ctrl-C, or a second SIGTERM). Any other stop request
while stopping changes nothing, whatever started the first one. In particular the head's ``stop``,
arriving after the agent began stopping on its own because a worker failed, must not cut the survivors'
grace period short (issue 19: they were SIGKILLed about 20 ms after SIGTERM).

Imports only the standard library (``enum``): the node agent imports this module on every node.
"""

from __future__ import annotations

import enum


class StopState(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"  # the graceful request went out; the grace period runs
    KILLING = "killing"  # the kill went out; waiting for the processes to be gone
    DONE = "done"


class StopAction(enum.Enum):
    """What the owner must do now, as the result of a request or of the clock."""

    NOTHING = "nothing"
    TERMINATE = "terminate"  # send the graceful stop (SIGTERM to the workers, ``stop`` to the agents)
    KILL = "kill"  # send the kill (SIGKILL to the workers, ``kill`` to the agents)


class StopSequence:
    """SIGTERM -> grace -> SIGKILL as named states. Times are ``time.monotonic()`` values passed in, so
    every transition is a plain function call (unit-tested without processes or sleeping)."""

    __slots__ = ("grace", "interrupts", "kill_deadline", "killed_at", "reason", "state", "stopped_at")

    def __init__(self, grace: float) -> None:
        if grace < 0:
            raise ValueError(f"grace period {grace}: must be 0 or more")
        self.grace = grace
        self.state = StopState.RUNNING
        self.reason: str | None = None  # what started the stop (the first request)
        self.stopped_at: float | None = None
        self.kill_deadline: float | None = None
        self.killed_at: float | None = None
        self.interrupts = 0

    @property
    def stopping(self) -> bool:
        """Whether a stop has begun (any state but RUNNING)."""
        return self.state is not StopState.RUNNING

    def stop(self, now: float, reason: str, *, interrupt: bool = False) -> StopAction:
        """A request to stop gracefully. ``interrupt``: it is a signal sent to us; the second one kills."""
        if interrupt:
            self.interrupts += 1
        if self.state is StopState.RUNNING:
            self.state = StopState.STOPPING
            self.reason = reason
            self.stopped_at = now
            self.kill_deadline = now + self.grace
            return StopAction.TERMINATE
        if self.state is StopState.STOPPING and self.interrupts >= 2:
            return self._kill(now)
        return StopAction.NOTHING

    def kill(self, now: float, reason: str) -> StopAction:
        """A request to kill now, with or without a stop before it."""
        if self.state is StopState.RUNNING:
            self.reason = reason
            self.stopped_at = now
        if self.state in (StopState.RUNNING, StopState.STOPPING):
            return self._kill(now)
        return StopAction.NOTHING

    def tick(self, now: float) -> StopAction:
        """The clock: KILL once, when the grace period of a stop is over."""
        if self.state is StopState.STOPPING and self.kill_deadline is not None and now >= self.kill_deadline:
            return self._kill(now)
        return StopAction.NOTHING

    def finish(self) -> None:
        """Everything is gone; later requests do nothing."""
        self.state = StopState.DONE

    def _kill(self, now: float) -> StopAction:
        self.state = StopState.KILLING
        self.killed_at = now
        return StopAction.KILL
