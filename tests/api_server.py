"""Start and stop a real `tuneboard api` subprocess for the tests (the API, its fairness and load, benchmarks
through lm-eval's completions client)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from backend.core.paths import REPO_ROOT


def start_server(*args, env=None, timeout=120):
    """Start `tuneboard api ARGS --port 0`; return (process, base url) once it prints its ready line."""
    cmd = [sys.executable, "-m", "backend.cli", "api", *args, "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving on "):
            proc.log = lines  # the server's later output, read by a thread so the pipe never fills
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return proc, line.split()[-1]
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines))


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
