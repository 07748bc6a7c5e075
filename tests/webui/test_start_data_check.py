"""The Train tab's pre-flight data check (issue 21 item 5): Start shows the lint's summary of the run's data once
(counts per severity, the worst findings, where to see them all) and starts on the next press; the lint's result is
kept by the data files' state, so a changed file is linted again, and data with nothing to say starts at once."""
from __future__ import annotations

import json

import pytest

from ui_handlers import form_args, handler, stand_in_launches
from waiting import wait_for
from webui import data_check, jobs

pytestmark = pytest.mark.slow


def test_start_shows_the_data_checks_summary_once_then_starts(root, tiny_llama, monkeypatch):
    from webui.app import create_app

    launched = stand_in_launches(monkeypatch)  # a harmless process instead of `tuneboard train`
    monkeypatch.setattr(data_check, "WAIT_S", 600.0)  # the result is waited for: the test does not race the lint
    folder = root / "mydata"
    folder.mkdir()
    rows = [{"instruction": f"Name a colour, number {k}, that people often see in the sky at {k} o'clock.",
             "output": f"Blue, at {k} o'clock."} for k in range(4)]
    (folder / "mine.json").write_text(json.dumps(rows + [dict(rows[1])]), encoding="utf-8")  # row 4 repeats row 1
    (folder / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}}), encoding="utf-8")

    start = handler(create_app(), "do_start")
    args = form_args(start, model_name_or_path=str(tiny_llama), template="default", dataset="mine",
                     dataset_dir=str(folder), cutoff_len=256)
    out = start.fn(*args)
    note = next(x for x in out if isinstance(x, str) and "Data check" in x)
    assert "Data check (tuneboard lint) of mine: 1 findings (0 errors, 1 warnings, 0 notes)" in note, note
    assert "(the first 2000 rows of each dataset)" in note and "<b>duplicates</b>: 1 rows repeat" in note, note
    assert "the Data tab's <b>Check</b>. Press Start again" in note and launched == []
    (lint,) = list((root / ".cache" / "lint").iterdir())
    assert json.loads((lint / data_check.RESULT).read_text())["findings"][0]["rows"] == [4]

    args[0] = next(x for x in out if isinstance(x, dict) and "lint_shown" in x)
    start.fn(*args)
    assert len(launched) == 1  # pressed again: started
    wait_for(lambda: not jobs.run_state(launched[0]).active, timeout=60, what="the stand-in run to end")

    # a new page (no state) is told again, from the kept result: no second lint of the same files
    out = start.fn(*([{}] + args[1:]))
    assert any(isinstance(x, str) and "1 findings" in x for x in out) and len(launched) == 1
    assert list((root / ".cache" / "lint").iterdir()) == [lint]

    # the duplicate removed: the changed file is linted again, finds nothing, and Start starts at once
    (folder / "mine.json").write_text(json.dumps(rows), encoding="utf-8")
    start.fn(*([{}] + args[1:]))
    assert len(launched) == 2 and len(list((root / ".cache" / "lint").iterdir())) == 2


def test_a_finding_about_the_model_alone_holds_nothing():
    """The template auto picks for a model without one is said by the preview and the run log: alone, it does not
    hold Start; with a finding about rows it is listed too."""
    template = {"check": "template", "severity": "warning", "dataset": "-", "message": "template auto: ...", "rows": []}
    cut = {"check": "cut_answers", "severity": "warning", "dataset": "mine", "message": "2 of 4 rows ...", "rows": [1, 3]}
    assert data_check.summary_md({"datasets": {"mine": 4}, "findings": [template]}) == ""
    note = data_check.summary_md({"datasets": {"mine": 4}, "findings": [template, cut], "max_rows": 2000})
    assert "2 findings (0 errors, 2 warnings, 0 notes)" in note and "<b>template</b>" in note and "<b>cut_answers</b>" in note
