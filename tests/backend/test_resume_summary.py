"""A resumed run's summary and log (fast tier; the real resumed run: tests/reliability/test_training_faults.py).

- the mean train loss weighs each logged loss by the steps it covers, and a loss logged after a resume covers the
  steps since the checkpoint only (the HF Trainer counts from there), whatever logging_steps and save_steps are;
- status.json's resumed_at keeps the resumes before the checkpoint a resume continues;
- the log trimmed to the checkpoint on resume is read again from its start by a tailer that had read more of it,
  even when the resumed steps have grown it past where the tailer stopped before its next look.
"""
from __future__ import annotations

import json

import pytest

from backend.core.rundir import LOG_FILE, RunDir, earlier_time, run_seconds
from backend.stages.base import mean_train_loss, resume_steps, trim_log_to
from webui.tailer import RunTail


def test_mean_train_loss_weighs_each_logged_loss_by_the_steps_it_covers():
    # logging_steps 5: losses at steps 5 and 10 cover five steps each, the last step's (12, always logged) two
    history = [{"step": 5, "loss": 2.0}, {"step": 10, "loss": 1.0}, {"step": 12, "loss": 0.5}, {"step": 12, "train_loss": 9}]
    assert mean_train_loss(history, []) == pytest.approx((5 * 2.0 + 5 * 1.0 + 2 * 0.5) / 12)
    # resumed from checkpoint-7 (save_steps 7): the checkpoint's history ends at step 5; the resumed Trainer's
    # loss at step 10 is the mean of steps 8-10 (steps 6-7 were never logged)
    assert mean_train_loss(history, [7]) == pytest.approx((5 * 2.0 + 3 * 1.0 + 2 * 0.5) / 10)
    # and again from checkpoint-11: step 12's loss is step 12's alone
    assert mean_train_loss(history, [7, 11]) == pytest.approx((5 * 2.0 + 3 * 1.0 + 1 * 0.5) / 9)
    # a resume at a logged step (an abort logs and saves the same step) changes nothing
    assert mean_train_loss(history, [10]) == mean_train_loss(history, [])
    assert mean_train_loss([{"step": 3, "eval_loss": 1.0}], []) is None


def test_resumed_at_keeps_the_resumes_before_the_checkpoint():
    assert resume_steps(None, 3) == [3]
    assert resume_steps([3, 7], 9) == [3, 7, 9]
    assert resume_steps([3, 7], 5) == [3, 5]  # resumed from an older checkpoint: the resume at 7 is past it


def test_a_resumed_runs_time_counts_its_earlier_processes():
    first = {"started_at": "2026-01-01T10:00:00+00:00", "finished_at": "2026-01-01T10:02:00+00:00"}
    assert earlier_time(first) == (120.0, first["started_at"])
    # killed without a final status: its last update ends it; the earlier processes' time and first start carry on
    second = {"started_at": "2026-01-02T09:00:00+00:00", "updated_at": "2026-01-02T09:00:30+00:00",
              "earlier_s": 120.0, "run_started_at": first["started_at"]}
    assert earlier_time(second) == (150.0, first["started_at"])
    third = {"started_at": "2026-01-03T08:00:00+00:00", "finished_at": "2026-01-03T08:01:00+00:00", "earlier_s": 150.0}
    assert run_seconds(third) == 210.0


def test_start_keeps_a_resumed_runs_time_and_drops_the_earlier_summary(tmp_path):
    run = RunDir(tmp_path)
    run.start()
    run.finish("completed", 0, final_metrics={"train_loss": 1.0})
    run.close()
    ended = json.loads((tmp_path / "status.json").read_text())
    again = RunDir(tmp_path)
    again.start(continues=True)
    again.close()
    status = json.loads((tmp_path / "status.json").read_text())
    assert "final_metrics" not in status  # the earlier process's summary is not this one's (a failed resume kept it)
    assert status["run_started_at"] == ended["started_at"] and status["earlier_s"] == earlier_time(ended)[0]
    fresh = RunDir(tmp_path)
    fresh.start()
    fresh.close()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["earlier_s"] == 0 and status["run_started_at"] == status["started_at"]


def test_the_log_trimmed_on_resume_is_read_again_whole(tmp_path):
    log = tmp_path / LOG_FILE

    def append(steps, elapsed_s):
        with open(log, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": s, "loss": 2.0 - s / 10, "elapsed_s": elapsed_s * s}) + "\n" for s in steps)

    append(range(1, 7), 1.5)  # the first process reached step 6; its checkpoint is at 3
    tail = RunTail(str(tmp_path))
    tail.poll()
    assert [r["step"] for r in tail.records] == [1, 2, 3, 4, 5, 6]
    trim_log_to(tmp_path, 3)
    append(range(4, 10), 0.25)  # the resumed process's steps, past where the tailer had read before it looks again
    tail.poll()
    assert [r["step"] for r in tail.records] == list(range(1, 10))  # one curve, each step once: the file's
    assert tail.records == [json.loads(line) for line in log.read_text().splitlines()]
    assert tail.metrics.malformed == 0
