"""webui.jobs with real subprocesses: launch, status from status.json + pid, abort escalation to the whole
process group, FIFO queue on disk, run listing. The child is `process_fixture_trainer.py` (see its
docstring): real processes, real signals, real files; only the training inside is left out."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from webui import jobs
from waiting import wait_for

FIXTURE = str(Path(__file__).with_name("process_fixture_trainer.py"))


def fixture_cmd(*opts):
    return lambda spec_path: [sys.executable, FIXTURE, str(spec_path), *opts]


def start(tmp_path, *opts, name="run") -> Path:
    run_dir = tmp_path / "saves" / name
    spec = jobs.write_spec_yaml(run_dir, f"output_dir: {run_dir}\nmax_steps: 5\n")
    jobs.launch(run_dir, fixture_cmd(*opts)(spec))
    return run_dir


def test_train_argv_is_a_list_with_the_spec_and_overrides(tmp_path):
    argv = jobs.train_argv(tmp_path / "run_spec.yaml", {"resume_from_checkpoint": True, "max_steps": 40})
    assert argv[-4:] == ["train", str(tmp_path / "run_spec.yaml"), "resume_from_checkpoint=true", "max_steps=40"]


def test_default_output_dir_is_unique_and_named_after_model(tmp_path):
    a = jobs.default_output_dir("HuggingFaceTB/SmolLM2-135M-Instruct", "lora", root=tmp_path)
    assert a.parent == tmp_path / "SmolLM2-135M-Instruct" / "lora"
    a.mkdir(parents=True)
    b = jobs.default_output_dir("HuggingFaceTB/SmolLM2-135M-Instruct", "lora", root=tmp_path,
                                now=__import__("datetime").datetime.strptime(a.name, "%Y-%m-%d-%H-%M-%S"))
    assert b != a and b.name.startswith(a.name)
    assert jobs.model_slug("/x/y/model.Q4_1.gguf") == "model.Q4_1"


def test_launch_runs_to_completion_with_output_captured(tmp_path):
    run_dir = start(tmp_path, "steps=3", "step_s=0.05")
    first = jobs.run_state(run_dir)
    assert first.state in ("starting", "running", "completed")
    wait_for(lambda: jobs.run_state(run_dir).state == "completed", what="completed")
    st = jobs.run_state(run_dir)
    assert not st.alive and st.status["final_metrics"]["train_loss"] == pytest.approx(2 / 3)
    out = (run_dir / "process_output.log").read_text()
    assert "fixture trainer starting" in out and "step 3" in out
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["argv"][1] == FIXTURE


def test_dead_process_with_running_status_is_failed(tmp_path):
    run_dir = start(tmp_path, "steps=50", "step_s=0.05", "crash_at=3")
    # the process dies with status.json saying "running"; the launcher's watcher makes it final, with why
    wait_for(lambda: jobs.read_json(run_dir / "status.json").get("state") == "failed", what="crash recorded")
    st = jobs.run_state(run_dir)
    assert st.state == "failed" and not st.alive
    assert st.status["exit_code"] == 3
    assert st.status["error"] == "the process exited with code 3 without a final status at step 2 of 50"


def test_abort_graceful_via_stop_file(tmp_path):
    run_dir = start(tmp_path, "steps=200", "step_s=0.05")
    wait_for(lambda: jobs.run_state(run_dir).state == "running", what="running")
    assert jobs.abort(run_dir, term_after_s=10, kill_after_s=5, wait=True)
    st = jobs.run_state(run_dir)
    assert st.state == "aborted" and st.status["state"] == "aborted"  # the trainer wrote it itself
    assert st.status["step"] < 200


def test_abort_escalates_to_sigkill_of_the_whole_group(tmp_path):
    run_dir = start(tmp_path, "steps=10000", "step_s=0.05", "ignore_stop=1", "ignore_term=1", "grandchild=1")
    wait_for(lambda: (run_dir / "grandchild.pid").exists() and jobs.run_state(run_dir).state == "running",
             what="running with grandchild")
    grandchild = int((run_dir / "grandchild.pid").read_text())
    pid = jobs.run_state(run_dir).pid
    t0 = time.monotonic()
    assert jobs.abort(run_dir, term_after_s=0.5, kill_after_s=0.5, wait=True)
    assert time.monotonic() - t0 < 8
    assert not jobs.pid_alive(pid)
    wait_for(lambda: not jobs.pid_alive(grandchild), timeout=5, what="grandchild gone (no orphans)")
    st = jobs.run_state(run_dir)
    assert st.state == "aborted"  # status still says running, but a stop was requested and it is gone


def test_abort_of_finished_run_is_a_no_op(tmp_path):
    run_dir = start(tmp_path, "steps=1", "step_s=0.01")
    wait_for(lambda: jobs.run_state(run_dir).state == "completed", what="completed")
    assert jobs.abort(run_dir, wait=True) is False


def test_queue_is_fifo_limited_and_survives_restart(tmp_path):
    root = tmp_path / "saves"
    cmd = fixture_cmd("steps=4", "step_s=0.15")
    q = jobs.JobQueue(root, command=cmd)
    assert q.max_concurrent() == 1
    dirs = [root / f"r{i}" for i in range(3)]
    assert jobs.start_or_queue(f"output_dir: {dirs[0]}\n", dirs[0], root=root, command=cmd)[0] == "started"
    assert jobs.start_or_queue(f"output_dir: {dirs[1]}\n", dirs[1], root=root, command=cmd)[0] == "queued"
    assert jobs.start_or_queue(f"output_dir: {dirs[2]}\n", dirs[2], root=root, command=cmd)[0] == "queued"
    # a fresh JobQueue object (as after a UI restart) sees the same queue, in order
    q2 = jobs.JobQueue(root, command=cmd)
    assert [Path(e.run_dir) for e in q2.entries()] == dirs[1:]
    assert q2.entries()[0].spec == {"output_dir": str(dirs[1])}
    assert q2.pump() == []  # slot busy
    wait_for(lambda: jobs.run_state(dirs[0]).state == "completed", what="first done")
    assert q2.pump() == [str(dirs[1])]
    assert [Path(e.run_dir) for e in q2.entries()] == dirs[2:]
    q2.set_max_concurrent(2)
    assert q2.pump() == [str(dirs[2])]
    assert q2.running_count() == 2
    wait_for(lambda: all(jobs.run_state(d).state == "completed" for d in dirs), what="all done")
    started = [json.loads((d / "launch.json").read_text())["launched_at"] for d in dirs]
    assert started == sorted(started)


def test_start_reports_started_when_another_pumper_launched_it(tmp_path, monkeypatch):
    """The UI's QueueWorker pumps every second: when it launches the entry between start_or_queue's
    enqueue and its own pump, the run still counts as started (it once said "Queued" for a running run)."""
    root, cmd = tmp_path / "saves", fixture_cmd("steps=3", "step_s=0.05")
    pump = jobs.JobQueue.pump

    def worker_first(self, env=None):
        pump(jobs.JobQueue(root, command=cmd), env)  # the worker gets there first
        return pump(self, env)

    monkeypatch.setattr(jobs.JobQueue, "pump", worker_first)
    run_dir = root / "r0"
    assert jobs.start_or_queue(f"output_dir: {run_dir}\n", run_dir, root=root, command=cmd)[0] == "started"
    assert jobs.JobQueue(root, command=cmd).entries() == []
    wait_for(lambda: jobs.run_state(run_dir).state == "completed", what="run done")
    other = root / "r1"
    slow = fixture_cmd("steps=20", "step_s=0.1")
    jobs.launch(other, slow(jobs.write_spec_yaml(other, f"output_dir: {other}\n")))  # slot busy: queued
    assert jobs.start_or_queue(f"output_dir: {root / 'r2'}\n", root / "r2", root=root, command=cmd)[0] == "queued"
    wait_for(lambda: jobs.run_state(other).state == "completed", what="blocking run done")


def test_queue_remove_and_worker(tmp_path):
    root = tmp_path / "saves"
    cmd = fixture_cmd("steps=2", "step_s=0.05")
    q = jobs.JobQueue(root, command=cmd)
    q.set_max_concurrent(1)
    a = q.enqueue("output_dir: a\n", root / "a")
    b = q.enqueue("output_dir: b\n", root / "b")
    assert q.remove(a.id) and not q.remove(a.id)
    worker = jobs.QueueWorker(root, interval_s=0.1, command=cmd).start()
    try:
        wait_for(lambda: jobs.run_state(root / "b").state == "completed", what="worker launched b")
    finally:
        worker.stop()
    assert not (root / "a").exists()
    assert q.entries() == []


def test_list_runs_and_find_active(tmp_path):
    root = tmp_path / "saves"
    done = start(tmp_path, "steps=1", "step_s=0.01", name="m/lora/done")
    wait_for(lambda: jobs.run_state(done).state == "completed", what="done")
    (done / "checkpoint-1").mkdir()
    (done / "checkpoint-1" / "run_spec.yaml").write_text("not a run\n")
    assert jobs.find_active_run(root) is None
    live = start(tmp_path, "steps=1000", "step_s=0.05", name="m/lora/live")
    try:
        runs = jobs.list_runs(root)
        assert [r.name for r in runs] == ["m/lora/live", "m/lora/done"]
        assert runs[1].spec["max_steps"] == 5
        assert jobs.find_active_run(root) == str(live)
    finally:
        jobs.abort(live, term_after_s=0.1, kill_after_s=1, wait=True)
    assert jobs.find_active_run(root) is None


def test_no_zombie_left_after_exit(tmp_path):
    run_dir = start(tmp_path, "steps=1", "step_s=0.01")
    pid = json.loads((run_dir / "launch.json").read_text())["pid"]

    def ended() -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and not jobs.pid_alive(pid)
        except psutil.NoSuchProcess:  # already reaped (also between an exists-check and a look)
            return True

    wait_for(ended, what="reaped")
    wait_for(lambda: not psutil.pid_exists(pid), timeout=5, what="child reaped, not a zombie")
    assert os.getpid() != pid
