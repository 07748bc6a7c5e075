"""`tuneboard train` from a command line (no web UI watching), killed or stopped at an exact point (issue 25, part 5):
its supervising parent (backend/core/supervise.py) writes the final status the training process could not, so a script
or a second CLI reading status.json never sees a dead run as running.

- kill -9 of the training child -> status.json says failed, with the signal and the step, within seconds; the
  parent exits 128 + 9; the parent preloads no allocator and imports no torch; nothing of the run is left;
- SIGTERM to the CLI (the parent only, as `kill PID` does) while a checkpoint is being saved -> the child gets it
  once, finishes that save and stops: aborted, exit 130, every checkpoint complete (never half).

Covered elsewhere, not repeated here: a rank of a 2-process run killed with -9 (failed naming the rank, no process
left: tests/backend/test_distributed_runs.py::test_a_killed_rank_fails_the_run_by_name_and_leaves_no_process); the
UI's Abort in every phase (tests/reliability/test_abort_phases.py, now through the supervisor); a full disk while
saving (tests/reliability/test_training_faults.py, a real tmpfs); a probe of a spec that does not fit
(tests/backend/test_probe.py::test_probe_suggests_what_to_change_when_it_does_not_fit)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from backend.training import allocator
from backend.core.paths import REPO_ROOT
from backend.core.rundir import is_complete_checkpoint, read_status
from waiting import wait_for

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
STEP_HOOKS = str(HERE / "train_with_hooks.py")
PHASE_HOOKS = str(HERE / "phase_hooks.py")


def tiny_args(model: Path, out: Path, *extra: str) -> list[str]:
    args = [f"model_name_or_path={model}", f"output_dir={out}", "dataset=identity", "template=llama3",
            "cutoff_len=64", "max_samples=16", "per_device_train_batch_size=2", "logging_steps=1",
            "learning_rate=0.01", "lora_rank=4", "max_steps=3", "save_steps=100", "plot_loss=false", *extra]
    return list({a.split("=", 1)[0]: a for a in args}.values())  # an extra key=value replaces the default


def start(argv: list[str], out: Path, env: dict) -> subprocess.Popen:
    """A command-line run: a plain child of the test (no new session, no UI watcher), output to a file."""
    return subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=open(out.with_suffix(".log"), "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, **env})


def output(out: Path) -> str:
    return out.with_suffix(".log").read_text(errors="replace")[-3000:]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_training_child_killed_with_sigkill_is_marked_failed_with_the_signal_and_step(tiny_llama, tmp_path):
    out = tmp_path / "killed"
    proc = start([sys.executable, STEP_HOOKS, *tiny_args(tiny_llama, out, "max_steps=6")], out,
                 {"TUNEBOARD_TEST_PAUSE_AT": "2"})
    try:
        wait_for(lambda: (out / "paused-at-2").exists() or proc.poll() is not None, timeout=600,
                 what="training paused at step 2")
        assert (out / "paused-at-2").exists(), output(out)
        status = read_status(out)
        assert status["state"] == "running" and status["pid"] == proc.pid  # the launched process, as the UI expects
        trainer = status.get("train_pid", status["pid"])  # the process that trains (before: the only one)
        parent_maps, trainer_maps = maps(proc.pid), maps(trainer)
        os.kill(trainer, signal.SIGKILL)  # what the kernel's OOM killer does: no handler runs
        # a reader of the file alone (no UI, no pid check) learns the run is over
        wait_for(lambda: read_status(out).get("state") != "running", timeout=60, what="status.json to leave 'running'")
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    # the parent only waits: no allocator preloaded, no torch; the training child has them
    assert "libtorch" not in parent_maps and not any(lib in parent_maps for lib in allocator.LIBRARIES.values())
    assert "libtorch" in trainer_maps
    if allocator.find("jemalloc"):
        assert allocator.LIBRARIES["jemalloc"] in trainer_maps
    status = read_status(out)
    assert status["state"] == "failed" and status["exit_code"] == -signal.SIGKILL, status
    assert status["error"] == "killed by signal 9 (SIGKILL, out of memory?) at step 2 of 6", status
    assert status["ended_by"] == "supervisor" and status["step"] == 2
    assert "FAILED: killed by signal 9" in (out / "running_log.txt").read_text()
    assert "tuneboard train: failed: killed by signal 9" in output(out)
    assert not alive(trainer) and not alive(proc.pid)


def test_sigterm_to_the_cli_during_a_checkpoint_save_finishes_the_save_and_aborts(tiny_llama, tmp_path):
    out, markers = tmp_path / "saving", tmp_path / "markers"
    markers.mkdir()
    argv = [sys.executable, PHASE_HOOKS, "train", *tiny_args(tiny_llama, out, "max_steps=4", "save_steps=2")]
    proc = start(argv, out, {"TUNEBOARD_TEST_HOLD_IN": "save", "TUNEBOARD_TEST_MARKERS": str(markers)})
    try:
        wait_for(lambda: (markers / "in-save").exists() or proc.poll() is not None, timeout=600,
                 what="the run to be inside the save of checkpoint-2")
        assert (markers / "in-save").exists(), output(out)
        trainer = read_status(out)["train_pid"]
        assert trainer != proc.pid and int((markers / "in-save").read_text()) == trainer
        proc.send_signal(signal.SIGTERM)  # the parent only: it forwards to the training child
        assert proc.wait(timeout=600) == 130, output(out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (markers / "abort-seen-in-save").exists()
    status = read_status(out)
    assert status["state"] == "aborted" and status["exit_code"] == 130, status
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()  # the save the SIGTERM arrived in is complete
    # the stop lands at the next step end: step 2 itself, or step 3 with its own checkpoint
    assert status["step"] in (2, 3) and (out / f"checkpoint-{status['step']}" / "trainer_state.json").is_file()
    assert all(is_complete_checkpoint(c) for c in out.glob("checkpoint-*"))  # none half-written
    assert not list(out.glob(".saving-*"))
    log = (out / "running_log.txt").read_text()
    assert "received SIGTERM" in log and "Traceback" not in log
    assert not alive(trainer)
