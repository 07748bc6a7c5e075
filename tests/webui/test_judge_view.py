"""The Evaluate tab's judge mode: Start (the tab's own handler, as Gradio calls it) launches `tuneboard eval` with
do_judge as the tab's background job on a tiny model + adapter; the stand-in judge (tests/fake_teacher.py)
answers; the tab shows win / tie / loss, the interval and each row with both answers and reasons. The judge's
URL and key variable go through the UI's checks (an internal address, a key the operator does not offer)."""
from __future__ import annotations

import os

import pytest

from backend.core import teacher_access
from fake_teacher import KEY, FakeTeacher, no_key_under
from ui_handlers import form_args
from waiting import wait_for
from webui import judge_view
from webui.tabs import evaluate


@pytest.fixture
def judge():
    server = FakeTeacher(mode="judge_word", key=KEY).start()
    yield server
    server.stop()


def test_judge_mode_runs_as_the_tabs_job_and_shows_the_verdicts(root, tiny_llama, random_llama_adapter, judge, monkeypatch):
    from webui.app import create_app

    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", os.pathsep.join([str(tiny_llama), str(random_llama_adapter)]))
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    for name in (teacher_access.KEYS_ENV, teacher_access.URLS_ENV, teacher_access.POLICY_ENV):
        monkeypatch.delenv(name, raising=False)
    demo = create_app()
    fn = next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_start"
              and any(getattr(c, "elem_id", None) == "eval-judge" for c in f.inputs))
    values = dict(model_name_or_path=str(tiny_llama), adapter_name_or_path=str(random_llama_adapter), finetuning_type="lora",
                  template="llama3", dataset=["identity"], max_samples=2, max_new_tokens=4, judge=True,
                  judge_url=judge.url, judge_model="judge-model", judge_api_key_env="JUDGE_TEST_KEY",
                  lang="en")

    # the UI's checks: a loopback judge the operator did not allow, a key variable it does not offer
    out = fn.fn(None, *form_args(fn, **values))
    message = out[2]
    assert "`judge_url`" in message and "internal address" in message
    assert "`judge_api_key_env`" in message and "JUDGE_TEST_KEY" in message
    assert not judge.requests

    # the operator offers the key for this URL (as `tuneboard webui --teacher-key-env JUDGE_TEST_KEY=URL` does),
    # and the eval process checks again (the UI's policy in its environment)
    monkeypatch.setenv(teacher_access.KEYS_ENV, f"JUDGE_TEST_KEY={judge.url}")
    monkeypatch.setenv(teacher_access.POLICY_ENV, teacher_access.POLICY_WEBUI)
    st, _, message, *_ = fn.fn(None, *form_args(fn, **values))
    assert st["parts"] and st["spec"]["do_judge"] and len(st["parts"]) == 1, message
    ticks = []

    def ended() -> bool:
        ticks.append(evaluate.poll(st, False))
        return not ticks[-1][-1].active

    wait_for(ended, timeout=300, what="the judge eval to end")
    final = ticks[-1]
    assert "Eval done**: 2 rows" in final[2], final[2]
    # the status said what the process was doing: the base answers, the predictions, then the judge
    assert evaluate.part_status(st["parts"][0])["phase"] == "judging"
    assert any("the judge compares pair" in str(t[1]) or "base answer" in str(t[1]) for t in ticks[:-1]) \
        or len(ticks) < 4, [str(t[1]) for t in ticks]
    predicted = final[4]["value"]  # the rows table: the predict part's tuned answers, which the judge compared
    summary, frame = judge_view.refresh(st, "en")
    assert "**Judge** `judge-model`" in summary and "of 2 rows" in summary and "95% interval" in summary
    assert len(frame) == 2 and list(frame.columns) == judge_view.ROW_COLUMNS
    assert all(frame["reason (tuned first)"]) and all(frame["reason (tuned second)"])
    assert set(frame["verdict"]) <= {"win", "tie", "loss"}
    assert list(predicted["prediction"]) == list(frame["tuned"])
    assert len(judge.requests) == 4
    no_key_under(root)
    # the same report in another language
    zh, _ = judge_view.refresh(st, "zh")
    assert "胜率" in zh and "judge-model" in zh


def test_judge_flat_and_an_incomplete_report():
    assert judge_view.judge_flat(False, "http://x/v1", "m", "K", "", 0, False) == {}
    flat = judge_view.judge_flat(True, " http://x/v1 ", "m", "K", "", 5, True)
    assert flat == {"do_judge": True, "do_eval": False, "do_predict": True, "judge_url": "http://x/v1",
                    "judge_model": "m", "judge_api_key_env": "K", "judge_api_key_file": None,
                    "judge_max_requests": 5, "judge_against": "reference"}
    report = {"judge_model": "m", "judge_url": "http://x/v1", "against": "reference", "rows": 3, "judged": 1,
              "wins": 0, "ties": 0, "losses": 1, "win_rate": 0.0, "interval": [0.0, 0.79], "requests": 2,
              "cached": 0, "unparsed": 0, "complete": False, "stopped": "judge_max_requests 3 spent",
              "per_row": [{"index": 0, "prompt": [{"role": "user", "content": "Hi?"}], "a": "x", "b": "good",
                           "verdict": "loss", "orders": [
                               {"order": "AB", "reason": "B says good.\nVerdict: B", "parsed": True},
                               {"order": "BA", "reason": "no idea", "parsed": False}]}]}
    text = judge_view.summary_md(report)
    assert "the reference answers" in text and "Incomplete: 1 of 3 rows judged (judge_max_requests 3 spent)" in text
    frame = judge_view.rows_frame(report)
    assert frame.iloc[0].tolist() == [0, "Hi?", "x", "good", "loss", "B says good.\nVerdict: B",
                                      "no idea [no verdict: tie]"]
    # too few verdicts to score (backend.evaluation.judge.summarize): the reason, not a win rate
    unscored = {**report, "win_rate": None, "interval": None, "complete": True,
                "no_score": "no win rate: the judge gave a verdict in 0 of its 2 replies"}
    text = judge_view.summary_md(unscored)
    assert "✖ no win rate: the judge gave a verdict in 0 of its 2 replies" in text and "0.000" not in text
