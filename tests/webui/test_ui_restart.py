"""A UI restart with one run running and one queued (issue 9, "Faults"): the UI process that launched the
run and holds the queue worker is killed with SIGKILL (no handler, no cleanup); the run goes on in its own
session; the next UI process re-attaches to it (what a page load does: jobs.find_active_run) and its queue
worker starts the queued run only after the running one has ended.

The "UI process" is a real process running webui.jobs exactly as webui.app's main() does (start_or_queue
for each Start, a QueueWorker); the runs are process_fixture_trainer.py (see test_jobs.py), so this takes
seconds. Only the Gradio pages are left out (tests/e2e covers the page re-attaching after a reload)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from waiting import wait_for
from webui import jobs

FIXTURE = str(Path(__file__).with_name("process_fixture_trainer.py"))
UI = r'''
import sys, time
from pathlib import Path
from webui import jobs
root, fixture = Path(sys.argv[1]), sys.argv[2]
cmd = lambda spec: [sys.executable, fixture, str(spec), "steps=400", "step_s=0.05"]
worker = jobs.QueueWorker(root, interval_s=0.2, command=cmd).start()
for name in ("running", "queued"):
    print(name, *jobs.start_or_queue(f"output_dir: {root / name}\n", root / name, root=root, command=cmd), flush=True)
time.sleep(600)
'''


def test_a_killed_ui_leaves_its_run_running_and_the_next_ui_reattaches_and_runs_the_queue(tmp_path):
    root = tmp_path / "saves"
    running, queued = root / "running", root / "queued"
    ui = subprocess.Popen([sys.executable, "-c", UI, str(root), FIXTURE], stdout=subprocess.PIPE, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    try:
        said = [ui.stdout.readline().split() for _ in range(2)]
        assert said == [["running", "started", str(running)], ["queued", "queued", str(queued)]]
        wait_for(lambda: jobs.run_state(running).state == "running", timeout=60, what="the first run to run")
        run_pid = jobs.read_json(running / jobs.LAUNCH_FILE)["pid"]
    finally:
        ui.send_signal(signal.SIGKILL)  # the UI dies at once: no atexit, no thread of it runs again
        ui.wait()
    assert jobs.pid_alive(run_pid) and os.getpgid(run_pid) == run_pid  # alive, in its own session
    assert jobs.run_state(running).state == "running"  # the run outlived its UI

    # the next UI process (this one): a page load re-attaches to the run; the queue is still there, in order
    assert jobs.find_active_run(root) == str(running)
    cmd = lambda spec: [sys.executable, FIXTURE, str(spec), "steps=3", "step_s=0.05"]  # noqa: E731
    queue = jobs.JobQueue(root, command=cmd)
    assert [Path(e.run_dir) for e in queue.entries()] == [queued]
    worker = jobs.QueueWorker(root, interval_s=0.1, command=cmd).start()
    try:
        step = jobs.read_json(running / jobs.STATUS_FILE).get("step", 0)
        wait_for(lambda: jobs.read_json(running / jobs.STATUS_FILE).get("step", 0) > step + 2, timeout=60,
                 what="the run to go on without its UI")
        queue.pump()  # what the worker does every 0.1 s: one slot, taken
        assert not queued.exists() and [Path(e.run_dir) for e in queue.entries()] == [queued]  # one slot: it waits
        jobs.request_stop(running)  # the running run ends (its own final status: no watcher of it is left)
        wait_for(lambda: jobs.run_state(queued).state == "completed", timeout=60, what="the queued run to run")
    finally:
        worker.stop()
    assert jobs.run_state(running).state == "aborted"
    ended = jobs.read_json(running / jobs.STATUS_FILE)["finished_at"]
    launched = json.loads((queued / jobs.LAUNCH_FILE).read_text())["launched_at"]
    assert launched >= ended  # the queued run started after the running one had ended
    assert queue.entries() == [] and jobs.find_active_run(root) is None
