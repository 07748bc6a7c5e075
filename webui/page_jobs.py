"""Which job each open page's Export, Evaluate and Distill tab shows, so that a late timer tick cannot put an
earlier job back on screen.

A Gradio event carries its inputs as they were when it fired. A tab's timer tick that fired before a Start and is
answered after it holds the earlier job's state: written back, it replaced the new job's state, showed the earlier
job's result and "ended", and stopped the timer while the new job ran (seen on the Export tab after a page reload
re-attached to an ended export). So Start and the re-attach on page load say here which job the page's tab shows
(keyed by kind and Gradio's session hash: one per open page), and a tick for any other job changes nothing.
Events without a session (none in a browser) are never taken for stale.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import gradio as gr

PAGES_KEPT = 4096  # the oldest pages' entries go first; a page that lost its entry is never taken for stale

_shown: OrderedDict[tuple[str, str], str] = OrderedDict()
_lock = threading.Lock()


def _key(kind: str, request) -> tuple[str, str] | None:
    session = getattr(request, "session_hash", None)
    return (kind, session) if session else None


def show(kind: str, request, job, first: bool = False) -> bool:
    """Record that this page's `kind` tab shows `job` now. first: only when the page has no job recorded yet (the
    re-attach on page load, which must not replace what a Start already recorded, nor read its job's log again from
    the start). Returns whether recorded."""
    key = _key(kind, request)
    if key is None or not job:
        return True
    with _lock:
        if first and key in _shown:
            return False
        _shown[key] = str(job)
        _shown.move_to_end(key)
        while len(_shown) > PAGES_KEPT:
            _shown.popitem(last=False)
    return True


def stale(kind: str, request, job) -> bool:
    """Whether this page's `kind` tab shows another job than `job` (the event holding `job` fired before it changed)."""
    key = _key(kind, request)
    if key is None or not job:
        return False
    with _lock:
        shown = _shown.get(key)
    return shown is not None and shown != str(job)


def job_of(st: dict | None) -> str | None:
    """The job a tab's state holds: its "job" folder (Export, Distill), or the folder of an eval's parts."""
    st = st or {}
    if st.get("job"):
        return str(st["job"])
    parts = st.get("parts") or []
    return str(Path(parts[0]["dir"]).parent) if parts and parts[0].get("dir") else None


def starting(kind: str, fn: Callable, state_at: int) -> Callable:
    """A Start handler that records the job its answer's state (output `state_at`) holds. Gradio passes the page's
    request to the first parameter (its annotation); the rest are fn's inputs."""
    def handler(request: gr.Request, *inputs):
        out = fn(*inputs)
        show(kind, request, job_of(out[state_at]))
        return out
    handler.__name__, handler.__doc__ = fn.__name__, fn.__doc__
    return handler


def ticking(kind: str, fn: Callable, outputs: int) -> Callable:
    """A timer tick that changes nothing (`outputs` skips) when its state (first input) holds a job the page's tab no
    longer shows."""
    skips = tuple(gr.skip() for _ in range(outputs)) if outputs > 1 else gr.skip()

    def handler(request: gr.Request, *inputs):
        if stale(kind, request, job_of(inputs[0])):
            return skips
        out = fn(*inputs)
        # asked again: a Start handled while this tick read its job's files (Gradio runs the two events' handlers
        # side by side) makes it stale too
        return skips if stale(kind, request, job_of(inputs[0])) else out
    handler.__name__, handler.__doc__ = fn.__name__, fn.__doc__
    return handler
