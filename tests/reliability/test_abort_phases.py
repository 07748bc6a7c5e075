"""Abort in every phase of a job, the way the UI aborts (issue 9, "Faults"): training through
webui.jobs.abort (STOP file, then SIGTERM, then SIGKILL of the process group), export and eval through
webui.tools.stop + the ABORTED marker, as their tabs do. The job must end by itself with status `aborted`,
keep everything an earlier run or export left, and leave no process of its group behind.

The phases are hit exactly with tests/reliability/phase_hooks.py (the real CLI; a hook holds the process
inside the phase until the abort reaches it), never by timing. The jobs are launched by the UI's own
functions, with `tuneboard` replaced by that hook script.

One run directory goes through the phases in turn: aborted at step 2 (training), then resumed and aborted
while tokenizing, while loading the model, and while saving checkpoint-4; its checkpoint-2 adapter is then
exported (aborted while writing, over an earlier export) and evaluated (aborted after the first row)."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from backend.core.rundir import read_status
from waiting import in_group, wait_for
from webui import jobs, tools

pytestmark = pytest.mark.slow
HOOKS = str(Path(__file__).with_name("phase_hooks.py"))
SPEC = """model_name_or_path: {model}
output_dir: {out}
dataset: identity
template: llama3
cutoff_len: 64
max_samples: 16
per_device_train_batch_size: 2
logging_steps: 1
learning_rate: 0.01
lora_rank: 4
max_steps: 6
save_steps: 2
plot_loss: false
"""


@pytest.fixture(autouse=True)
def hooked_cli(monkeypatch):
    """`tuneboard` is the hook script for every job the UI functions launch in these tests."""
    monkeypatch.setattr(jobs, "tuneboard_argv", lambda: [sys.executable, HOOKS])


def launched_pid(job_dir: Path) -> int:
    return jobs.read_json(job_dir / jobs.LAUNCH_FILE)["pid"]


def hold_env(phase: str, markers: Path) -> dict:
    return {"TUNEBOARD_TEST_HOLD_IN": phase, "TUNEBOARD_TEST_MARKERS": str(markers)}


def wait_in_phase(job_dir: Path, markers: Path, phase: str) -> int:
    """Wait until the job is inside `phase`; return its pid (= its process group)."""
    pid = launched_pid(job_dir)
    wait_for(lambda: (markers / f"in-{phase}").exists() or not jobs.pid_alive(pid), timeout=600,
             what=f"the job to enter {phase}")
    log = (job_dir / jobs.PROCESS_LOG).read_text(errors="replace")[-3000:]
    assert (markers / f"in-{phase}").exists(), f"the job ended before {phase}:\n{log}"
    assert in_group(pid), "the job's process group is empty while it runs"
    return pid


def wait_ended(pid: int) -> None:
    """The job's process is gone and the launcher's watcher (the thread that reaps it and writes the final status
    the process could not write) is done."""
    wait_for(lambda: not in_group(pid), timeout=300, what="every process of the job to end")
    wait_for(lambda: not any(t.name == f"reap-{pid}" for t in threading.enumerate()), timeout=30,
             what="the job watcher")


def snapshot(run: Path) -> dict:
    """What an earlier run left: complete checkpoints (their files and sizes) and the metrics log."""
    cps = {c.name: sorted((f.name, f.stat().st_size) for f in c.iterdir()) for c in sorted(run.glob("checkpoint-*"))}
    return {"checkpoints": cps, "log": (run / "trainer_log.jsonl").read_text()}


def logged_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "trainer_log.jsonl").read_text().splitlines()]


def abort_training(run: Path, phase: str, markers: Path, *overrides: str) -> dict:
    """Launch `tuneboard train run_spec.yaml` as the Train tab does, hold it in `phase`, press Abort."""
    argv = jobs.train_argv(run / jobs.SPEC_FILE, dict(o.split("=", 1) for o in overrides))
    jobs.launch(run, argv, env=hold_env(phase, markers))
    pid = wait_in_phase(run, markers, phase)
    assert jobs.abort(run)  # the Train tab's Abort: STOP file now, SIGTERM after 30 s, SIGKILL after 15 more
    wait_ended(pid)
    assert (markers / f"abort-seen-in-{phase}").exists()
    status = read_status(run)
    log = (run / jobs.PROCESS_LOG).read_text(errors="replace")[-3000:]
    assert status["state"] == "aborted", (status, log)
    assert status["exit_code"] == 130, (status, log)  # it stopped by itself, not by the escalation's SIGKILL
    assert jobs.run_state(run).state == "aborted"
    assert "Traceback" not in (run / "running_log.txt").read_text()
    return status


@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    """The run aborted during training (at the end of step 2), as its own test checks."""
    run = tmp_path_factory.mktemp("abort") / "run"
    jobs.write_spec_yaml(run, SPEC.format(model=tiny_llama, out=run))
    markers = run.parent
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jobs, "tuneboard_argv", lambda: [sys.executable, HOOKS])
        status = abort_training(run, "train", markers)
    return run, status


def test_abort_during_training_stops_at_that_step_with_its_checkpoint(run):
    run, status = run
    assert status["step"] == 2 and logged_steps(run) == [1, 2]
    assert (run / "checkpoint-2" / "trainer_state.json").is_file()
    assert (run / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("phase", ["preprocess", "load"])
def test_abort_while_tokenizing_or_loading_a_resumed_run_trains_nothing_and_keeps_the_earlier_run(run, phase, tmp_path):
    run, _ = run
    before = snapshot(run)
    status = abort_training(run, phase, tmp_path, "resume_from_checkpoint=true")
    assert snapshot(run) == before  # no new step, no new checkpoint, the metrics log as it was
    assert status["step"] == 2
    assert ("stop requested (STOP file found) before training: nothing trained, nothing saved, checkpoint-2 kept as it "
            "was") in (run / "running_log.txt").read_text()


def test_abort_while_saving_a_checkpoint_finishes_that_save_and_stops(run, tmp_path):
    run, _ = run
    before = snapshot(run)["checkpoints"]
    status = abort_training(run, "save", tmp_path, "resume_from_checkpoint=true")
    after = snapshot(run)["checkpoints"]
    assert {k: v for k, v in after.items() if k in before} == before  # earlier checkpoints untouched
    assert (run / "checkpoint-4" / "trainer_state.json").is_file()  # the save the abort arrived in is complete
    assert not list(run.glob(".saving-*"))
    assert status["step"] in (4, 5) and (run / f"checkpoint-{status['step']}" / "trainer_state.json").is_file()


def test_abort_during_export_keeps_the_earlier_export(run, tiny_llama, tmp_path, monkeypatch):
    run, _ = run
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    earlier = {"model.safetensors": b"an earlier export", "export_report.json": b'{"ok": true}'}
    for name, data in earlier.items():
        (export_dir / name).write_bytes(data)
    job = tools.new_job_dir("export", root=tmp_path / "saves")
    spec = (f"model_name_or_path: {tiny_llama}\nadapter_name_or_path: {run / 'checkpoint-2'}\ntemplate: llama3\n"
            f"export_dir: {export_dir}\nexport_overwrite: true\n")
    markers = tmp_path
    for key, value in hold_env("export", markers).items():  # tools.start passes its environment on
        monkeypatch.setenv(key, value)
    tools.start("export", job, spec)
    pid = wait_in_phase(job, markers, "export")
    assert list(export_dir.parent.glob(".export.partial-*"))  # the new files are being written beside it
    assert tools.stop(job)  # the Export tab's Abort: SIGTERM to the group now, SIGKILL after 5 s
    tools.mark_aborted(job)
    wait_ended(pid)
    out = (job / jobs.PROCESS_LOG).read_text(errors="replace")
    assert "export ABORTED (received SIGTERM)" in out, out[-3000:]
    assert {p.name: p.read_bytes() for p in export_dir.iterdir()} == earlier
    assert not list(export_dir.parent.glob(".export.*")) and not (tmp_path / "export.failed").exists()
    assert tools.was_aborted(job)
    if (job / "status.json").exists():  # what the watcher says about a job that keeps no status of its own
        assert read_status(job)["state"] == "aborted", read_status(job)  # it said "failed ... exited with code 130"


def test_abort_during_eval_keeps_the_rows_predicted_before_it(run, tiny_llama, tmp_path, monkeypatch):
    run, _ = run
    job = tools.new_job_dir("eval", root=tmp_path / "saves")
    spec = (f"model_name_or_path: {tiny_llama}\nadapter_name_or_path: {run / 'checkpoint-2'}\ntemplate: llama3\n"
            f"eval_dataset: identity\nmax_samples: 4\ncutoff_len: 64\nmax_new_tokens: 8\ndo_predict: true\n"
            f"output_dir: {job}\n")
    markers = tmp_path
    for key, value in hold_env("predict", markers).items():  # tools.start passes its environment on
        monkeypatch.setenv(key, value)
    tools.start("eval", job, spec)
    pid = wait_in_phase(job, markers, "predict")
    tools.mark_aborted(job)  # the Evaluate tab's Abort: the marker, then SIGTERM to the part's group
    assert tools.stop(job)
    wait_ended(pid)
    status = read_status(job)
    log = (job / jobs.PROCESS_LOG).read_text(errors="replace")[-3000:]
    assert status["state"] == "aborted" and status["exit_code"] == 130, (status, log)
    rows = tools.read_predictions(job)
    assert 1 <= len(rows) < 4  # the rows predicted before the abort are kept, the rest never started
    assert tools.read_results(job)["stopped"] in ("received SIGTERM", "STOP file found")
