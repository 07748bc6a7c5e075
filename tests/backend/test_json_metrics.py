"""backend/core/metrics.py's JSON figures by hand: json_valid = the answer parses as JSON (NaN and Infinity do not),
field F1 over every field of flatten (empty objects and lists are fields too; a path is a tuple of keys and indices,
so dotted keys do not collide with nesting)."""
from __future__ import annotations

import pytest

from backend.core import metrics


def f1_and_valid(prediction: str, reference: str) -> tuple[float, float]:
    out = metrics.compute([prediction], [reference])
    return out["json_field_f1"], out["json_valid"]


@pytest.mark.parametrize("both", ["{}", "[]", '{"a": []}', '{"a": {}, "b": [1, {}]}'])
def test_identical_answers_with_empty_containers_score_100(both):
    assert f1_and_valid(both, both) == (100.0, 100.0)
    assert metrics.compute([both], [both])["exact_match"] == 100.0


def test_a_missing_empty_container_is_a_missed_field():
    # 1 of 1 predicted field matched, 1 of 2 expected: precision 1, recall 1/2
    f1, valid = f1_and_valid('{"a": 1}', '{"a": 1, "b": []}')
    assert valid == 100.0 and f1 == pytest.approx(100 * 2 * 1 * 0.5 / 1.5)
    assert f1_and_valid('{"a": 1, "b": [3]}', '{"a": 1, "b": []}')[0] == pytest.approx(50.0)  # [] vs [3]: no match
    assert f1_and_valid("{}", '{"a": 1}')[0] == 0.0 and f1_and_valid('{"a": 1}', "{}")[0] == 0.0


def test_paths_cannot_collide():
    assert f1_and_valid('{"a.b": 1}', '{"a": {"b": 1}}')[0] == 0.0
    assert f1_and_valid('{"a": {"0": 1}}', '{"a": [1]}')[0] == 0.0  # a key "0" is not index 0
    assert f1_and_valid('{"a[0]": 1}', '{"a": [1]}')[0] == 0.0
    assert metrics.flatten({"a": {"b": 1}, "c": [2], "d": [], "a.b": {}}) == \
        {("a", "b"): 1, ("c", 0): 2, ("d",): [], ("a.b",): {}}


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '{"a": NaN}', '[1, Infinity]'])
def test_nan_and_infinity_are_not_json(text):
    assert metrics.parse_json(text) == (False, None)
    assert f1_and_valid(text, '{"a": 1}') == (0.0, 0.0)


def test_json_valid_means_parses_as_json_and_field_f1_judges_the_shape():
    """A scalar is JSON (json_valid, as the json_valid reward counts it) but none of the object's fields."""
    assert metrics.parse_json("42") == (True, 42)
    assert f1_and_valid("42", '{"a": 42}') == (0.0, 100.0)
    assert f1_and_valid('```json\n{"a": 1}\n```', '{"a": 1}') == (100.0, 100.0)
    assert metrics.row_scores("{}", "{}")["field_f1"] == 100.0


def test_an_answer_that_can_only_be_nan_settles_at_once():
    """eval_metric's early stop (task_metric.answer_settled) agrees: NaN / Infinity cannot begin a JSON value."""
    from backend.evaluation.task_metric import answer_settled

    assert answer_settled("N", [], json_answer=True) and answer_settled("I", [], json_answer=True)
    assert not answer_settled("n", [], json_answer=True)  # null
