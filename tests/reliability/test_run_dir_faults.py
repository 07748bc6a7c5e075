"""The run directory under faults (issue 9, items 6 and 7): a status write that fails (disk full) never
leaves status.json "running" or a .tmp file behind; a process that died without a final status is made
final by whoever notices (the launcher's watcher with its exit code, or a later look); resume skips a
checkpoint whose save was cut short; a STOP file left by an earlier abort does not stop the next start."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from backend.core.paths import REPO_ROOT
from backend.core.rundir import STATUS_FILE, RunDir, mark_ended, read_status
from backend.stages.base import RunError, resume_checkpoint
from webui import jobs

# A RunDir that hits a full disk while writing its final status: RLIMIT_FSIZE makes every write past
# 2 KB fail with a real OSError (EFBIG) in that process only, as ENOSPC would on a full disk.
FULL_DISK_FINISH = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from backend.core.rundir import RunDir
run = RunDir(sys.argv[1])
run.start()
run.update_status(step=3, total_steps=10)
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
run.finish("failed", 1, error="RuntimeError: [enforce fail at inline_container.cc:672] " + "x" * 5000,
           final_metrics={"loss": 1.0})
print("finished")
"""


def test_a_final_status_that_does_not_fit_falls_back_to_a_small_one(tmp_path):
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_FINISH, str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr
    status = read_status(tmp_path)
    assert status["state"] == "failed" and status["exit_code"] == 1 and status["step"] == 3
    assert status["error"].startswith("RuntimeError: [enforce fail") and len(status["error"]) == 500
    assert "could not be written" in status["note"] and "final_metrics" not in status
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_whose_process_is_gone_is_made_final_by_the_next_look(tmp_path):
    """No watcher (the UI restarted, or the run came from the command line): run_state notices the dead pid
    and writes `failed`, exit code unknown; the watcher that knows the code may still say it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_spec.yaml").write_text("max_steps: 10\n")
    (run / STATUS_FILE).write_text(json.dumps({"state": "running", "pid": dead_pid(), "step": 4, "total_steps": 10}))
    st = jobs.run_state(run)
    assert st.state == "failed" and not st.alive
    status = read_status(run)
    assert status["state"] == "failed" and status["exit_code"] is None
    assert status["error"] == "the process ended without a final status (exit code unknown) at step 4 of 10"
    assert "FAILED: the process ended" in (run / "running_log.txt").read_text()
    # the launcher's watcher, which knows how the process ended, replaces the guess ...
    assert mark_ended(run, -9)["error"] == "killed by signal 9 (SIGKILL, out of memory?) at step 4 of 10"
    # ... but a final status the run wrote itself is never replaced
    (run / STATUS_FILE).write_text(json.dumps({"state": "completed", "exit_code": 0, "step": 10}))
    assert mark_ended(run, -9) is None and read_status(run)["state"] == "completed"


def test_a_kill_after_a_stop_request_is_an_abort_not_an_out_of_memory_guess(tmp_path):
    """Abort's escalation: STOP file, SIGTERM, then SIGKILL of a run that would not stop."""
    (tmp_path / STATUS_FILE).write_text(json.dumps({"state": "running", "step": 7, "total_steps": 9}))
    (tmp_path / "STOP").write_text("stop requested\n")
    written = mark_ended(tmp_path, -9)
    assert written["state"] == "aborted"
    assert written["error"] == "killed by signal 9 (SIGKILL) at step 7 of 9 (after a stop request)"


def test_a_stale_status_from_an_earlier_process_is_not_taken_for_the_new_ones(tmp_path):
    """A resume whose process dies while loading: the status on disk is the earlier run's final one."""
    (tmp_path / STATUS_FILE).write_text(json.dumps({"state": "aborted", "exit_code": 130, "step": 3}))
    past = time.time() - 60
    os.utime(tmp_path / STATUS_FILE, (past, past))
    written = mark_ended(tmp_path, 1, launched_at=past + 30, detail="error: something went wrong")
    assert written["state"] == "failed" and written["exit_code"] == 1
    assert written["error"] == ("the process exited with code 1 without a final status before the first training "
                                "step: error: something went wrong")


def test_a_stop_file_left_by_an_earlier_abort_is_removed_at_start_a_new_one_is_kept(tmp_path):
    stop = tmp_path / "STOP"
    stop.write_text("stop requested\n")
    past = psutil.Process().create_time() - 60  # written before this process started: an earlier run's
    os.utime(stop, (past, past))
    run = RunDir(tmp_path)
    run.start()
    assert not stop.exists()
    assert "removed the STOP file left by an earlier stop" in (tmp_path / "running_log.txt").read_text()
    stop.write_text("stop requested\n")  # written while this process runs: a stop request for it
    run.start()
    assert stop.exists() and run.stop_requested
    run.close()


def make_checkpoint(run: Path, step: int, state: str | None) -> Path:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    if state is not None:
        (folder / "trainer_state.json").write_text(state)
    return folder


def test_resume_picks_the_newest_complete_checkpoint_and_says_which_it_skipped(tmp_path):
    class Spec:
        resume_from_checkpoint = True

    make_checkpoint(tmp_path, 2, '{"global_step": 2}')
    make_checkpoint(tmp_path, 10, '{"global_step": 10}')
    make_checkpoint(tmp_path, 12, None)  # killed or disk full during the save: trainer_state.json comes last
    make_checkpoint(tmp_path, 14, '{"global_st')  # cut off while writing trainer_state.json itself
    said = []
    assert resume_checkpoint(Spec, tmp_path, log=said.append) == str(tmp_path / "checkpoint-10")
    assert len(said) == 1 and "checkpoint-12, checkpoint-14" in said[0] and "incomplete" in said[0]

    Spec.resume_from_checkpoint = str(tmp_path / "checkpoint-12")
    with pytest.raises(RunError, match="checkpoint-12 is incomplete"):
        resume_checkpoint(Spec, tmp_path)
    Spec.resume_from_checkpoint = True
    only_partial = tmp_path / "partial"
    make_checkpoint(only_partial, 3, None)
    with pytest.raises(RunError, match=r"no complete checkpoint-N folder .*\(checkpoint-3 incomplete\)"):
        resume_checkpoint(Spec, only_partial, log=said.append)
