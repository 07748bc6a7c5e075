"""PROCESS FIXTURE for tests/webui/test_jobs.py -- not the trainer and not a mock of webui.jobs.

The real `tuneboard train` loads a model and takes minutes; jobs.py only cares about process mechanics
(pid, process group, output file, status.json, STOP file, signals). This script behaves like a trainer
process in those respects only: it writes status.json / trainer_log.jsonl the way backend/core/rundir.py does,
honours (or, on request, ignores) the STOP file and SIGTERM, and can spawn a grandchild to check that
abort kills the whole process group.

usage: process_fixture_trainer.py SPEC.yaml [steps=N] [step_s=S] [ignore_stop=1] [ignore_term=1]
                                  [grandchild=1] [crash_at=N]
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

spec = Path(sys.argv[1])
opts = dict(a.split("=", 1) for a in sys.argv[2:])
run_dir = spec.parent
steps = int(opts.get("steps", 5))
step_s = float(opts.get("step_s", 0.1))
started = time.time()


def status(state, step, **extra):
    tmp = run_dir / "status.json.tmp"
    tmp.write_text(json.dumps({"state": state, "pid": os.getpid(), "step": step, "total_steps": steps,
                               "started_at": started, "updated_at": time.time(), **extra}))
    os.replace(tmp, run_dir / "status.json")


if opts.get("ignore_term") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if opts.get("grandchild") == "1":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (run_dir / "grandchild.pid").write_text(str(child.pid))

print("fixture trainer starting", flush=True)
status("running", 0)
with open(run_dir / "trainer_log.jsonl", "a") as log:
    for step in range(1, steps + 1):
        time.sleep(step_s)
        if opts.get("crash_at") == str(step):
            os._exit(3)  # dies without a final status, like an OOM kill
        log.write(json.dumps({"step": step, "total_steps": steps, "loss": 2.0 / step}) + "\n")
        log.flush()
        status("running", step)
        print(f"step {step}", flush=True)
        if (run_dir / "STOP").exists() and opts.get("ignore_stop") != "1":
            status("aborted", step, exit_code=0, finished_at=time.time())
            sys.exit(0)
status("completed", steps, exit_code=0, finished_at=time.time(), final_metrics={"train_loss": 2.0 / steps})
