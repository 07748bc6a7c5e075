"""Runs-tab actions on real run directories and real processes (the process fixture of test_jobs.py):
resume and "continue N more steps" go through the queue, clone fills the form from run_spec.yaml,
delete needs the confirmation and refuses live runs and folders outside the saves root; the queue shows
in the Runs table."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from webui import jobs
from webui.tabs import runs
from waiting import wait_for

FIXTURE = str(Path(__file__).with_name("process_fixture_trainer.py"))


def cmd(*opts):
    """spec path (+ overrides) -> argv of the process fixture; the overrides are passed as key=value
    arguments like `tuneboard train` gets them, and are recorded in launch.json by jobs.launch."""
    def argv(spec_path, overrides=None):
        return [sys.executable, FIXTURE, str(spec_path), *opts] + [f"{k}={v}" for k, v in (overrides or {}).items()]
    return argv


def finished_run(root: Path, name: str, steps: int = 3, checkpoint: bool = True) -> Path:
    """A run dir as `tuneboard train` leaves it: run_spec.yaml, status completed at `steps`, checkpoints."""
    d = root / name
    jobs.write_spec_yaml(d, yaml.safe_dump({"model_name_or_path": "m", "dataset": "identity",
                                            "max_steps": steps, "output_dir": str(d), "learning_rate": 0.001}))
    (d / "status.json").write_text(json.dumps({"state": "completed", "step": steps, "total_steps": steps}))
    if checkpoint:
        (d / f"checkpoint-{steps}").mkdir()
    return d


def argv_of(run_dir: Path) -> list[str]:
    return json.loads((run_dir / jobs.LAUNCH_FILE).read_text())["argv"]


def test_resume_starts_when_the_slot_is_free_and_keeps_the_spec(root):
    d = finished_run(root, "a")
    spec_before = (d / jobs.SPEC_FILE).read_text()
    ok, msg = runs.relaunch_run(str(d), root=root, command=cmd("steps=1", "step_s=0.01"))
    assert ok and msg.startswith("Resumed"), msg
    assert "resume_from_checkpoint=True" in argv_of(d)
    assert (d / jobs.SPEC_FILE).read_text() == spec_before  # run_spec.yaml is never changed
    wait_for(lambda: not jobs.run_state(d).active, what="resumed run ends")


def test_continue_n_steps_while_another_runs_is_queued_then_launched(root):
    busy = root / "busy"
    spec = jobs.write_spec_yaml(busy, f"output_dir: {busy}\n")
    jobs.launch(busy, cmd("steps=6", "step_s=0.2")(spec))
    wait_for(lambda: jobs.run_state(busy).active, what="busy run alive")
    d = finished_run(root, "b", steps=3)
    ok, msg = runs.relaunch_run(str(d), extra_steps=5, root=root, command=cmd("steps=1", "step_s=0.01"))
    assert ok and msg.startswith("Queued"), msg
    [entry] = jobs.JobQueue(root).entries()
    assert entry.run_dir == str(d) and entry.overrides == {"resume_from_checkpoint": True, "max_steps": 8}
    rows = runs.run_rows(root)
    assert [r["status"] for r in rows if r["run_dir"] == str(d)][0] == "queued (resume)"
    assert len(runs.table(rows, "queued", "")) == 1
    # the same run cannot be queued twice
    assert runs.relaunch_run(str(d), extra_steps=5, root=root)[0] is False
    wait_for(lambda: not jobs.run_state(busy).active, what="busy run ends")
    launched = jobs.JobQueue(root, command=cmd("steps=1", "step_s=0.01")).pump()
    assert launched == [str(d)]
    assert argv_of(d)[-2:] == ["resume_from_checkpoint=True", "max_steps=8"]
    wait_for(lambda: not jobs.run_state(d).active, what="continued run ends")


def test_resume_refusals(root):
    assert runs.relaunch_run(None, root=root)[0] is False
    d = finished_run(root, "nock", checkpoint=False)
    ok, msg = runs.relaunch_run(str(d), root=root)
    assert not ok and "checkpoint" in msg
    assert jobs.JobQueue(root).entries() == []


def test_clone_gives_the_spec_with_a_fresh_output_dir(root):
    d = finished_run(root, "c")
    spec, msg = runs.clone_spec(str(d))
    assert spec is not None, msg
    assert spec.output_dir is None and spec.resume_from_checkpoint is None
    assert spec.learning_rate == 0.001 and spec.max_steps == 3 and spec.dataset == "identity"
    (d / jobs.SPEC_FILE).write_text("learning_rat: 1\n")
    spec, msg = runs.clone_spec(str(d))
    assert spec is None and "learning_rat" in msg


def test_delete_needs_confirmation_and_refuses_live_and_outside(root, tmp_path):
    d = finished_run(root, "d")
    assert runs.delete_run(str(d), confirmed=False, root=root) == (False, "Tick “I am sure” to delete.")
    assert d.exists()
    outside = finished_run(tmp_path, "elsewhere")
    ok, msg = runs.delete_run(str(outside), confirmed=True, root=root)
    assert not ok and "saves folder" in msg and outside.exists()
    live = root / "live"
    spec = jobs.write_spec_yaml(live, f"output_dir: {live}\n")
    jobs.launch(live, cmd("steps=30", "step_s=0.1")(spec))
    wait_for(lambda: jobs.run_state(live).active, what="live run alive")
    ok, msg = runs.delete_run(str(live), confirmed=True, root=root)
    assert not ok and "Abort" in msg and live.exists()
    jobs.abort(live, term_after_s=5, kill_after_s=2, wait=True)
    ok, msg = runs.delete_run(str(d), confirmed=True, root=root)
    assert ok and not d.exists()
