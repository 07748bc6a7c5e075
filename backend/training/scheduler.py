"""TurnLock: one loaded model shared fairly by every request generating on it.

Before it, each model had a plain lock held for a whole `generate` call: a request for 8000 tokens held it
for minutes and a 5-token request sent beside it got nothing until the long one ended (security issue #25).
A TurnLock is still a lock (acquire / release / `with`, one holder at a time: forward passes on one model
never overlap, and the holder may switch the model's active adapter), but its waiters are served in arrival
order, and a holder in the middle of a generation calls `pass_turn()` between decode steps: when another
request waits, the turn goes to it and the holder queues again at the back of the line. Every active
request then advances a few tokens per round, each with its own KV cache, so a short request's first token
comes after at most a few tokens of each request ahead of it, however long those are.

Light module (no torch): the engine hands the turn over from the StoppingCriteria that transformers
calls after every generated token, so `generate` itself stays transformers' own.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

# Tokens a request generates per turn while others wait. 1 would be fairest; a handover may switch the
# shared model's adapter (a walk over its modules), so a few tokens per turn keep that cost small while a
# newcomer still waits only a few decode steps per request ahead of it.
TOKENS_PER_TURN = 4

# How often a waiter whose wait can be cancelled (its client left, its time ran out) looks again.
_POLL_S = 0.05


class TurnLock:
    """A fair (FIFO) lock whose holder can hand the turn to the next waiter and queue again.

    `state` is free for the holder's use: the engine records there which adapter the shared model has
    active, so a turn switches adapters only when the previous holder used another one."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._line: collections.deque = collections.deque()  # waiting tickets, in arrival order
        self._held = False
        self.state: object = None

    # -- the lock protocol (threading.Lock's signature)
    def acquire(self, blocking: bool = True, timeout: float = -1, *,
                cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait for the turn (behind everyone already waiting). False if `blocking` is false and it is
        taken, after `timeout` seconds (when >= 0), or once `cancelled()` is true while waiting."""
        with self._cond:
            if not self._held and not self._line:
                self._held = True
                return True
            if not blocking:
                return False
            return self._wait_in_line(timeout, cancelled)

    def release(self) -> None:
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an unheld TurnLock")
            self._held = False
            self._cond.notify_all()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def locked(self) -> bool:
        return self._held

    # -- turns
    def waiting(self) -> int:
        """How many requests wait for the turn (read without the lock: a hint, not a promise)."""
        return len(self._line)

    def pass_turn(self) -> bool:
        """Called by the holder between two steps: if anyone waits, hand them the turn and wait at the back
        of the line until it comes round again (the holder has it again on return). False when nobody was
        waiting (the holder simply kept it), True when the turn went round."""
        with self._cond:
            if not self._held:
                raise RuntimeError("pass_turn by a thread that does not hold the TurnLock")
            if not self._line:
                return False
            self._held = False
            self._cond.notify_all()
            self._wait_in_line(-1, None)
            return True

    def _wait_in_line(self, timeout: float, cancelled: Callable[[], bool] | None) -> bool:
        """(Under self._cond.) Queue a ticket and wait until it is first in line and the turn is free."""
        ticket = object()
        self._line.append(ticket)
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        try:
            while self._held or self._line[0] is not ticket:
                if cancelled is not None and cancelled():
                    return False
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    return False
                if cancelled is not None:
                    wait = _POLL_S if wait is None else min(wait, _POLL_S)
                self._cond.wait(wait)
            self._line.popleft()
            self._held = True
            return True
        finally:
            if ticket in self._line:  # gave up: leave the line, and wake the next one in case it was first
                self._line.remove(ticket)
                self._cond.notify_all()
