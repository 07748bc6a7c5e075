"""Start refuses, as a validation error beside its field, data the run would fail on at once (the data check's
`refused`: the run's own loading of the data, backend/dataprep/lint.py run_refusal), and launches nothing, however
often it is pressed: a val_size that leaves no training rows after max_samples, a mapped answer column no row has.
Data with some usable rows is still only told once ("Press Start again to start anyway"), then started."""
from __future__ import annotations

import json

import pytest

from ui_handlers import form_args, handler, stand_in_launches
from webui import data_check

pytestmark = pytest.mark.slow


def field_errors(out) -> list[str]:
    """The per-field error texts among Start's outputs (gr.update dicts with the error class)."""
    return [x["info"] for x in out if isinstance(x, dict) and "tb-field-error" in (x.get("elem_classes") or [])]


def errors_box(out) -> str:
    return next(x["value"] for x in out if isinstance(x, dict) and x.get("visible") is True and "value" in x)


@pytest.fixture
def start(root, tiny_llama, monkeypatch):
    """(Start's handler, its args for `values`, what it launched)."""
    from webui.app import create_app

    launched = stand_in_launches(monkeypatch)  # a harmless process instead of `tuneboard train`
    monkeypatch.setattr(data_check, "WAIT_S", 600.0)  # the result is waited for: the test does not race the lint
    fn = handler(create_app(), "do_start")

    def args(**values):
        return form_args(fn, model_name_or_path=str(tiny_llama), template="default", cutoff_len=256, **values)
    return fn, args, launched


def test_a_val_size_that_leaves_no_training_rows_is_refused_beside_its_field(start):
    fn, args, launched = start
    a = args(dataset="identity", val_size=500, max_samples=12)  # the bundled identity set: 40 rows, 12 used
    for _ in range(2):  # pressed again: still refused, never "start anyway"
        out = fn.fn(*a)
        assert launched == []
        assert "leaves no training rows" in errors_box(out) and "`val_size`" in errors_box(out)
        (beside,) = field_errors(out)
        assert "val_size 500" in beside and "of the 12 rows" in beside, beside


def test_a_mapped_column_no_row_has_is_refused_some_usable_rows_start_anyway(start, root):
    fn, args, launched = start
    folder = root / "mydata"
    folder.mkdir()
    rows = [{"instruction": f"Name a colour, number {k}, that people often see in the sky at {k} o'clock.",
             "output": f"Blue, at {k} o'clock."} for k in range(6)]
    (folder / "mine.json").write_text(json.dumps(rows), encoding="utf-8")
    info = {"broken": {"file_name": "mine.json", "columns": {"prompt": "instruction", "response": "answer_missing"}},
            "mine": {"file_name": "mine.json"}}
    (folder / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")

    out = fn.fn(*args(dataset="broken", dataset_dir=str(folder)))
    assert launched == []
    assert "has no column 'answer_missing' (columns.response)" in errors_box(out), errors_box(out)
    (beside,) = field_errors(out)
    assert "answer_missing" in beside

    # two of six rows without an answer: told once, then started on the next press
    (folder / "mine.json").write_text(json.dumps(rows[:4] + [dict(r, output="") for r in rows[4:]]), encoding="utf-8")
    a = args(dataset="mine", dataset_dir=str(folder))
    out = fn.fn(*a)
    note = next(x for x in out if isinstance(x, str) and "Data check" in x)
    assert "empty_answer" in note and "Press Start again to start anyway" in note and launched == []
    assert field_errors(out) == []
    a[0] = next(x for x in out if isinstance(x, dict) and "lint_shown" in x)
    fn.fn(*a)
    assert len(launched) == 1


def test_the_refusal_names_its_field():
    assert data_check.refusal({"findings": []}) is None and data_check.refusal(None) is None
    field, message = data_check.refusal({"error": "x", "refused": "val_size 0.5 takes 2 of the 2 rows ..."})
    assert field == "val_size" and "val_size 0.5" in message
    assert data_check.refusal({"refused": "eval_dataset: dataset 'e': ..."})[0] == "eval_dataset"
    assert data_check.refusal({"refused": "dataset 'mine': every one of the 3 rows ..."})[0] == "dataset"
