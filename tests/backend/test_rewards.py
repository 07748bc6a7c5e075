"""The built-in GRPO reward functions on hand-made completions, and a user's own function (backend.core.rewards)."""
from __future__ import annotations

import json

import pytest

from backend.core import rewards
from backend.core.rewards import RewardError, build_reward_funcs

REF = json.dumps({"name": "Pixel Tablet", "price": 391.81, "in_stock": False, "colors": ["grey", "black"]})
VALID = '{"name": "Pixel Tablet", "price": 391.81, "in_stock": false, "colors": ["grey", "black"]}'
FENCED = "```json\n" + VALID + "\n```"
PARTIAL = '{"name": "pixel tablet", "price": "391.81", "colors": ["grey"]}'  # price a string, in_stock missing
INVALID = '{"name": "Pixel Tablet", "price": 391.81,'
PROSE = "The product is the Pixel Tablet."


def call(func, completions, reference=None, **kwargs):
    return func(prompts=["p"] * len(completions), completions=completions, reference=reference, **kwargs)


def test_json_valid():
    assert call(rewards.json_valid, [VALID, FENCED, PARTIAL, INVALID, PROSE, "[1, 2]"]) == [1, 1, 1, 0, 0, 1]


def test_json_schema_inferred_from_reference_gives_partial_credit():
    scores = call(rewards.json_schema, [VALID, PARTIAL, INVALID, PROSE, "[1]"], reference=[REF] * 5)
    assert scores[0] == 1.0
    # 2 of the 4 required fields present and of the right type (name, colors): 0.9 * 2/4
    assert scores[1] == pytest.approx(0.45)
    assert scores[2:] == [0.0, 0.0, 0.0]


def test_json_schema_from_the_spec_and_rows_without_any():
    schema = {"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "string"}},
              "additionalProperties": False}
    completions = ['{"a": 1, "b": "x"}', '{"a": 1}', '{"a": 1, "b": "x", "c": 2}', '{"a": "1", "b": 2}']
    scores = call(rewards.json_schema, completions, schema=[json.dumps(schema)] * 4)
    assert scores == [1.0, pytest.approx(0.45), pytest.approx(0.9), 0.0]
    # no schema and no JSON reference: the row does not count
    assert call(rewards.json_schema, [VALID, VALID], reference=[None, "plain text"]) == [None, None]


def test_field_f1():
    scores = call(rewards.field_f1, [VALID, FENCED, PARTIAL, INVALID, '{"other": 1}'], reference=[REF] * 5)
    assert scores[0] == scores[1] == 1.0
    # PARTIAL: leaves name (case-insensitive match), price (string != number), colors[0] match -> 2 of 3
    # predicted, 2 of 5 expected: F1 = 2 * (2/3 * 2/5) / (2/3 + 2/5) = 0.5
    assert scores[2] == pytest.approx(0.5)
    assert scores[3:] == [0.0, 0.0]
    assert call(rewards.field_f1, [VALID], reference=["no json here"]) == [None]


def test_exact_match():
    assert call(rewards.exact_match, ["  yes\n", "Yes", "no"], reference=["yes", "yes", None]) == [1.0, 0.0, None]


def test_length_penalty():
    scores = call(rewards.length_penalty, ["x" * 10, "x" * 15, "x" * 40], reference=["y" * 10] * 3)
    assert scores == [1.0, 0.5, 0.0]
    by_tokens = rewards.length_penalty(prompts=["p"] * 3, completions=["a", "b", "c"], reference=None,
                                       completion_ids=[[1] * 0, [1] * 8, [1] * 32], max_completion_length=32)
    assert by_tokens == [1.0, 0.75, 0.0]


def test_format_regex_default_and_custom():
    assert call(rewards.format_regex, [VALID, " " + VALID + "\n", "Sure: " + VALID, PROSE]) == [1, 1, 0, 0]
    assert call(rewards.format_regex, ["ANSWER: 42", "42"], pattern=r"ANSWER: \d+") == [1.0, 0.0]


def test_builtins_are_bound_to_their_settings():
    length, regex = build_reward_funcs("length_penalty,format_regex", max_completion_length=4, regex="a+")
    assert length(prompts=["p"], completions=["xx"], completion_ids=[[1, 2]], reference=[None]) == [0.5]
    assert regex(prompts=["p", "p"], completions=["aaa", "ab"]) == [1.0, 0.0]
    assert [f.__name__ for f in build_reward_funcs(["json_valid", "field_f1"])] == ["json_valid", "field_f1"]


def test_a_users_function_from_a_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def brevity(prompts, completions, **kwargs):\n"
                    "    return [1.0 / (1 + len(c)) for c in completions]\n"
                    "def broken(prompts, completions, **kwargs):\n"
                    "    raise KeyError('answer')\n"
                    "def short(prompts, completions, **kwargs):\n"
                    "    return [1.0]\n"
                    "def words(prompts, completions, **kwargs):\n"
                    "    return ['good' for c in completions]\n")
    (brevity,) = build_reward_funcs(f"{path}:brevity")
    assert brevity.__name__ == "brevity"
    assert brevity(prompts=["p", "p"], completions=["", "abc"]) == [1.0, 0.25]
    for name, message in (("broken", "raised KeyError: 'answer'"), ("short", "returned 1 scores for 2 completions"),
                          ("words", "returned 'good' (str) for completion 0")):
        (func,) = build_reward_funcs(f"{path}:{name}")
        with pytest.raises(RewardError, match=f"reward function .*{name}.*{message.split()[0]}") as err:
            func(prompts=["p", "p"], completions=["a", "b"])
        assert message in str(err.value)
    with pytest.raises(RewardError, match="has no function 'missing'"):
        build_reward_funcs(f"{path}:missing")


def test_module_function_and_bad_names(tmp_path, monkeypatch):
    (tmp_path / "rewardmod.py").write_text("def one(prompts, completions, **kw):\n    return [1] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (one,) = build_reward_funcs("rewardmod:one")
    assert one(prompts=["p"], completions=["x"]) == [1.0]
    assert rewards.name_problem("json_vaild") and "not a built-in reward" in rewards.name_problem("json_vaild")
    assert "is not a file" in rewards.name_problem("nowhere/x.py:f")
    assert "not a module name" in rewards.name_problem("my-mod:f")
    with pytest.raises(RewardError, match="importing nosuchmodule_xyz failed"):
        build_reward_funcs("nosuchmodule_xyz:f")


def test_a_folder_in_reward_funcs_is_a_reward_model_in_its_place(tmp_path):
    """A path (a '/' in it, or an existing folder) is a reward model: named after its folder in the metrics, built
    by the loader the stage passes, in its place among the functions; without a loader it is refused."""
    folder = tmp_path / "rm-run"
    folder.mkdir()
    assert rewards.is_model_name(str(folder)) and rewards.is_model_name("./saves/rm/")
    assert not rewards.is_model_name("json_valid") and not rewards.is_model_name("my.py:f")
    assert rewards.metric_name(f"{folder}/") == "rm-run" and rewards.metric_name("pkg.mod:brevity") == "brevity"
    assert rewards.name_problem(str(folder)) is None
    assert "is not a folder" in rewards.name_problem(f"{tmp_path}/missing")
    assert rewards.name_problem(f"{tmp_path}/missing", check_files=False) is None
    assert "nor a reward model folder" in rewards.name_problem("json_vald")
    loaded = []

    def loader(path):
        loaded.append(path)
        return lambda prompts, completions, **kw: [0.5] * len(completions)

    funcs = build_reward_funcs(f"json_valid,{folder}", reward_model=loader)
    assert loaded == [str(folder)] and funcs[0].__name__ == "json_valid" and funcs[1](["p"], ["c"]) == [0.5]
    with pytest.raises(RewardError, match="is a reward model"):
        build_reward_funcs(str(folder))
