"""The supervising parent of `tuneboard train` (torch-free: standard library + backend.core.rundir).

A process killed with SIGKILL (the kernel's out-of-memory killer, `kill -9`) runs no handler, so it cannot mark
its own run ended: status.json would say `running` with a dead pid until some reader (the web UI's watcher) saw
the process gone, and a script or a second CLI reading the file would see a live run. So `tuneboard train` keeps a
small parent process that imports nothing heavy and only:

- starts the training process (the same interpreter and command line, with the allocator of
  backend/training/allocator.py preloaded: the child, never this parent) in its own process group, with
  PR_SET_PDEATHSIG=SIGKILL so it dies with this parent, and stdin from /dev/null;
- forwards SIGINT / SIGTERM / SIGHUP to it exactly once (the child's own flag-only handler turns them into a stop
  at the next step with a checkpoint and `aborted`). The child is in its own group so that a signal to this
  parent's group (the UI's Abort, Ctrl-C in a terminal) reaches it once, through here, not twice;
- learns the child's run directory through a pipe (backend.core.rundir: RunDir.start writes it), and when the child
  ends without having written a final state (killed by a signal, a non-zero exit), writes `failed` (`aborted`
  after a stop request) with the signal and the last step into status.json at once, through
  backend.core.rundir.mark_ended;
- exits with the child's code (128 + N when signal N killed it).

status.json's pid is this parent's (the process the UI launched, the leader of the group its Abort signals);
train_pid is the child's. A multi-process run is the same one level down: the child is the launcher
(backend/core/launch.py), whose workers die with it (PR_SET_PDEATHSIG) and which itself writes which rank failed.
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

from backend.core.rundir import (ACTIVE_STATES, SUPERVISOR_FD_ENV, SUPERVISOR_PID_ENV, end_reason, mark_ended,
                            read_status)

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def available() -> bool:
    """Whether `tuneboard train` starts a supervised child here: Linux (PR_SET_PDEATHSIG; elsewhere it trains in
    its own process, without a preloaded allocator), and not already below a supervisor (the training child
    itself, a launched worker, anything they start)."""
    return sys.platform.startswith("linux") and not os.environ.get(SUPERVISOR_PID_ENV)


def _prctl():
    """libc's prctl, resolved once (so a preexec_fn in a forked child calls it without loading anything), or
    None off Linux / glibc."""
    global _PRCTL
    if _PRCTL is False:
        try:
            _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
        except (OSError, AttributeError):
            _PRCTL = None
    return _PRCTL


_PRCTL = False


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send this process `sig` when its parent dies (PR_SET_PDEATHSIG: a killed run leaves no
    child behind); with `parent`, exit at once when that parent is already gone (it died before prctl took
    effect). Nothing off Linux. The one home of it: the training child, launched workers, tokenizer
    processes, the distill run's local teacher."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, sig)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def exit_code(returncode: int) -> int:
    """A process's exit code for its own parent: the child's code, 128 + N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def run(argv: list[str], env: dict[str, str]) -> int:
    """Run `argv` (the training process) under supervision; return this process's exit code."""
    _prctl()  # resolved here, before the fork: the child's preexec_fn only calls it
    pending: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
        if child is None:
            pending.append(signum)
            return
        try:
            child.send_signal(signum)
        except OSError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    read_end, write_end = os.pipe()
    env = {**env, SUPERVISOR_PID_ENV: str(os.getpid()), SUPERVISOR_FD_ENV: str(write_end)}
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, pass_fds=(write_end,), process_group=0,
                                 preexec_fn=functools.partial(die_with_parent, signal.SIGKILL, os.getpid()))
        os.close(write_end)
        for signum in pending:
            child.send_signal(signum)
        returncode = child.wait()  # handlers run while it waits (PEP 475)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    run_dir = _reported_run_dir(read_end)
    if run_dir is not None:
        _mark_if_unfinished(run_dir, child.pid, returncode)
    return exit_code(returncode)


def _reported_run_dir(fd: int) -> Path | None:
    """The run folder the child wrote into the pipe (RunDir.start), or None when it never got that far."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:  # a grandchild still holds the write end: what is there is all there will be
        pass
    finally:
        os.close(fd)
    line = data.decode("utf-8", "surrogateescape").strip().splitlines()
    return Path(line[0]) if line else None


def _mark_if_unfinished(run_dir: Path, child_pid: int, returncode: int) -> None:
    """The final status the child could not write. Only this child's run: a status another process owns (an
    earlier run the child refused to overwrite) is left alone."""
    status = read_status(run_dir)
    if status.get("train_pid") != child_pid or status.get("state") not in ACTIVE_STATES:
        return
    written = mark_ended(run_dir, returncode, by="supervisor")
    if written:
        print(f"tuneboard train: {written['state']}: {written['error']} (status.json written)", file=sys.stderr,
              flush=True)
    else:
        print(f"tuneboard train: {end_reason(returncode)}; status.json could not be updated", file=sys.stderr,
              flush=True)
