"""Polling helper shared by tests that wait on real processes and files (tests/ is on sys.path through
its conftest.py)."""
import os
import time

import psutil


def wait_for(pred, timeout=20.0, what="condition", every=0.05):
    """Return once pred() is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def in_group(pgid: int) -> list[psutil.Process]:
    """Live processes of the process group `pgid` (a job's session: the CLI and anything it started)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found
