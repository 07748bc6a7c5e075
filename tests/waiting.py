"""Polling helper shared by tests that wait on real processes and files (tests/ is on sys.path through
its conftest.py)."""
import time


def wait_for(pred, timeout=20.0, what="condition", every=0.05):
    """Return once pred() is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
