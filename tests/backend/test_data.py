"""backend.dataprep.data: dataset_info.json + files -> normalized examples, bad-row reports, registering.

Everything here reads real files through the real `datasets` library (tmp files or the bundled data/)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from backend.core import paths
from backend.dataprep import data
from backend.dataprep.data import DatasetError, load_dataset_info, load_examples, register_dataset, split_train_val


@pytest.fixture(autouse=True, scope="module")
def _datasets_cache(tmp_path_factory):
    """Keep the datasets cache of the tests out of the user's ~/.cache."""
    old = os.environ.get("TUNEBOARD_CACHE")
    os.environ["TUNEBOARD_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("TUNEBOARD_CACHE", None)
    else:
        os.environ["TUNEBOARD_CACHE"] = old


def make_dir(tmp_path: Path, entries: dict, files: dict) -> Path:
    """A dataset_dir with the given dataset_info entries and files (list -> .json, str -> raw text)."""
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        elif name.endswith(".jsonl"):
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in content), encoding="utf-8")
        else:
            path.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "dataset_info.json").write_text(json.dumps(entries, indent=2), encoding="utf-8")
    return tmp_path


def strip_meta(example: dict) -> dict:
    return {k: v for k, v in example.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------------------
# Each formatting normalizes to exactly the expected messages
# ---------------------------------------------------------------------------------------------
def test_alpaca_with_history_and_system(tmp_path):
    rows = [{"q": "Translate to French", "ctx": "good morning", "a": "bonjour",
             "hist": [["Hi", "Hello!"], ["What can you do?", "I translate."]], "sys": "You translate."},
            {"q": "Say hi", "ctx": "", "a": "hi", "hist": [], "sys": ""}]
    d = make_dir(tmp_path, {"t": {"file_name": "t.json", "columns": {
        "prompt": "q", "query": "ctx", "response": "a", "history": "hist", "system": "sys"}}}, {"t.json": rows})
    examples, report = load_examples("t", d)
    assert strip_meta(examples[0]) == {
        "messages": [
            {"role": "system", "content": "You translate."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What can you do?"}, {"role": "assistant", "content": "I translate."},
            {"role": "user", "content": "Translate to French\ngood morning"},
            {"role": "assistant", "content": "bonjour"},
        ],
        "tools": None, "chosen": None, "rejected": None, "kto_tag": None}
    assert examples[1]["messages"] == [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    assert [(e["_row"], e["_source"]) for e in examples] == [(0, "t"), (1, "t")]
    assert (report.total, report.kept, report.skipped) == (2, 2, 0)


def test_sharegpt_custom_tags_tools_function_call_observation(tmp_path):
    tool = {"name": "add", "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}
    row = {"chat": [
        {"speaker": "sys", "text": "Use tools."},
        {"speaker": "me", "text": "What is 2 + 3?"},
        {"speaker": "call", "text": json.dumps({"name": "add", "arguments": json.dumps({"a": 2, "b": 3})})},
        {"speaker": "result", "text": "{\"sum\": 5}"},
        {"speaker": "bot", "text": "2 + 3 = 5."},
        {"speaker": "me", "text": "Thanks"},
        {"speaker": "bot", "text": "You're welcome."},
    ], "fns": json.dumps([{"type": "function", "function": tool}])}
    tags = {"role_tag": "speaker", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot",
            "observation_tag": "result", "function_tag": "call", "system_tag": "sys"}
    d = make_dir(tmp_path, {"t": {"file_name": "t.json", "formatting": "sharegpt",
                                  "columns": {"messages": "chat", "tools": "fns"}, "tags": tags}}, {"t.json": [row]})
    (example,), _ = load_examples("t", d)
    assert strip_meta(example) == {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
            {"role": "tool", "content": "{\"sum\": 5}"},
            {"role": "assistant", "content": "2 + 3 = 5."},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "You're welcome."},
        ],
        "tools": [tool], "chosen": None, "rejected": None, "kto_tag": None}


def test_sharegpt_default_tags_system_column(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "system": "Be brief."}]
    d = make_dir(tmp_path, {"t": {"file_name": "t.json", "formatting": "sharegpt",
                                  "columns": {"messages": "conversations", "system": "system"}}}, {"t.json": rows})
    (example,), _ = load_examples("t", d)
    assert example["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "hello"}]


def test_sharegpt_ranking_with_message_answers(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "2+2?"}],
             "chosen": {"from": "gpt", "value": "4"}, "rejected": {"from": "gpt", "value": "5"}},
            {"conversations": [{"from": "human", "value": "1+1?"}, {"from": "gpt", "value": "2"}],
             "chosen": {"from": "gpt", "value": "ok"}, "rejected": {"from": "gpt", "value": "no"}},
            {"conversations": [{"from": "human", "value": "3+3?"}],
             "chosen": {"from": "gpt", "value": "6"}, "rejected": {"from": "gpt", "value": "6"}}]
    d = make_dir(tmp_path, {"p": {"file_name": "p.json", "formatting": "sharegpt", "ranking": True,
                                  "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}},
                 {"p.json": rows})
    examples, report = load_examples("p", d, stage="dpo")
    assert [strip_meta(e) for e in examples] == [{
        "messages": [{"role": "user", "content": "2+2?"}], "tools": None,
        "chosen": {"role": "assistant", "content": "4"}, "rejected": {"role": "assistant", "content": "5"},
        "kto_tag": None}]
    assert [(s.row, s.reason) for s in report.skipped_rows] == [
        (1, "a ranking row's conversation must end with a 'human' turn (the answers are in chosen/rejected), "
            "it ends with 'gpt' at turn 1"),
        (2, "chosen and rejected answers are identical")]


def test_kto_tag_must_be_a_boolean(tmp_path):
    rows = [{"instruction": "a", "output": "b", "ok": True}, {"instruction": "c", "output": "d", "ok": "false"},
            {"instruction": "e", "output": "f", "ok": "maybe"}]
    d = make_dir(tmp_path, {"k": {"file_name": "k.json", "columns": {"kto_tag": "ok"}}}, {"k.json": rows})
    examples, report = load_examples("k", d, stage="kto")
    assert [e["kto_tag"] for e in examples] == [True, False]
    assert report.skipped_rows == [("k", 2, "column 'ok' (kto_tag) must be true or false, got 'maybe'")]


def test_openai_messages_with_tool_calls(tmp_path):
    row = {"messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Lima\"}"}}]},
        {"role": "tool", "content": "5C"},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "Oslo 5C, Lima 20C."},
    ]}
    d = make_dir(tmp_path, {"t": {"file_name": "t.jsonl", "formatting": "openai"}}, {"t.jsonl": [row]})
    (example,), _ = load_examples("t", d)
    assert example["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}},
                                                            {"name": "weather", "arguments": {"city": "Lima"}}]},
        {"role": "tool", "content": "5C"},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "Oslo 5C, Lima 20C."},
    ]
    assert example["tools"] is None


# ---------------------------------------------------------------------------------------------
# Bundled datasets
# ---------------------------------------------------------------------------------------------
BUNDLED = [  # name, stage, rows, formatting
    ("identity", "sft", 40, "alpaca"),
    ("alpaca_en_demo", "sft", 200, "alpaca"),
    ("alpaca_zh_demo", "sft", 200, "alpaca"),
    ("extraction_demo", "sft", 200, "alpaca"),
    ("toolcall_demo", "sft", 48, "sharegpt"),
    ("sharegpt_multiturn_demo", "sft", 30, "sharegpt"),
    ("openai_demo", "sft", 20, "openai"),
    ("dpo_en_demo", "dpo", 80, "alpaca"),
    ("kto_en_demo", "kto", 40, "sharegpt"),
    ("c4_demo", "pt", 100, "alpaca"),
    ("csv_demo", "sft", 20, "alpaca"),
]


def test_every_bundled_dataset_is_tested():
    assert sorted(load_dataset_info()) == sorted(n for n, *_ in BUNDLED)


@pytest.mark.parametrize("name,stage,rows,formatting", BUNDLED)
def test_bundled_dataset_loads_cleanly(name, stage, rows, formatting):
    examples, report = load_examples(name, stage=stage)
    counts = report.counts(name)
    assert (counts.total, counts.kept, counts.skipped, counts.formatting) == (rows, rows, 0, formatting)
    assert [e["_row"] for e in examples] == list(range(rows))
    assert all(e["_source"] == name for e in examples)
    blob = json.dumps(examples, ensure_ascii=False)
    assert "{{name}}" not in blob and "{{author}}" not in blob
    if stage == "pt":
        assert all(e["text"].strip() for e in examples)
    elif stage == "dpo":
        assert all(e["messages"][-1]["role"] == "user" and e["chosen"]["content"] != e["rejected"]["content"]
                   for e in examples)
    else:
        assert all(e["messages"][-1]["role"] == "assistant" for e in examples)
    if stage == "kto":
        assert {e["kto_tag"] for e in examples} == {True, False}


def test_bundled_toolcall_and_extraction_shapes():
    examples, _ = load_examples("toolcall_demo")
    assert all(e["tools"] and e["messages"][0]["role"] == "system" for e in examples)
    calls = [m for e in examples for m in e["messages"] if m.get("tool_calls")]
    assert len(calls) >= 40 and all(isinstance(c["tool_calls"][0]["arguments"], dict) for c in calls)
    assert sum(1 for e in examples if sum(m["role"] == "user" for m in e["messages"]) >= 2) >= 10  # multi-turn
    extraction, _ = load_examples("extraction_demo")
    for e in extraction:
        obj = json.loads(e["messages"][-1]["content"])
        assert isinstance(obj, dict)
        assert all(key in e["messages"][0]["content"] for key in obj)  # asked for exactly these keys
    multi, _ = load_examples("sharegpt_multiturn_demo")
    assert all(e["messages"][0]["role"] == "system" and len(e["messages"]) >= 5 for e in multi)


def test_identity_placeholders_filled_in_every_dataset(tmp_path):
    examples, _ = load_examples("identity", identity_name="Ada", identity_author="Acme Labs")
    who = next(e for e in examples if e["messages"][0]["content"] == "Who are you?")
    assert who["messages"][-1]["content"] == ("I am Ada, an AI assistant developed by Acme Labs. "
                                              "How can I help you today?")
    rows = [{"conversations": [{"from": "human", "value": "Is {{name}} your name?"},
                               {"from": "gpt", "value": "Yes, {{author}} named me {{name}}."}]}]
    d = make_dir(tmp_path, {"mine": {"file_name": "m.json", "formatting": "sharegpt"}}, {"m.json": rows})
    (e,), _ = load_examples("mine", d, identity_name="Ada", identity_author="Acme Labs")
    assert [m["content"] for m in e["messages"]] == ["Is Ada your name?", "Yes, Acme Labs named me Ada."]


def test_several_names_and_max_samples():
    examples, report = load_examples("identity, alpaca_en_demo", max_samples=7)
    assert [(e["_source"], e["_row"]) for e in examples] == (
        [("identity", i) for i in range(7)] + [("alpaca_en_demo", i) for i in range(7)])
    assert [(c.name, c.total, c.used, c.kept) for c in report.datasets] == [
        ("identity", 40, 7, 7), ("alpaca_en_demo", 200, 7, 7)]
    assert "first 7 used (max_samples)" in report.summary_lines()[0]
    assert load_examples(["identity", "c4_demo"], stage="pt")[1].kept == 140


def test_stage_needs_the_right_kind_of_dataset():
    with pytest.raises(DatasetError, match="stage 'dpo' needs a ranking dataset.*'identity'"):
        load_examples("identity", stage="dpo")
    with pytest.raises(DatasetError, match="'dpo_en_demo' is a ranking dataset"):
        load_examples("dpo_en_demo", stage="sft")
    with pytest.raises(DatasetError, match="stage 'kto' needs .*kto_tag.*'alpaca_en_demo'"):
        load_examples("alpaca_en_demo", stage="kto")
    with pytest.raises(DatasetError, match="unknown stage 'sftt'"):
        load_examples("identity", stage="sftt")


# ---------------------------------------------------------------------------------------------
# File types
# ---------------------------------------------------------------------------------------------
def test_csv_parquet_jsonl_files(tmp_path):
    (tmp_path / "t.csv").write_text("instruction,input,output\nPad 7 to three digits,,007\nAdd,\"1, 2\",3\n",
                                    encoding="utf-8")
    datasets.Dataset.from_list([{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}]
                               ).to_parquet(str(tmp_path / "t.parquet"))
    d = make_dir(tmp_path, {"c": {"file_name": "t.csv"}, "p": {"file_name": "t.parquet"},
                            "j": {"file_name": "t.jsonl", "formatting": "sharegpt"}},
                 {"t.jsonl": [{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}]})
    csv_rows, _ = load_examples("c", d)
    assert [e["messages"] for e in csv_rows] == [
        [{"role": "user", "content": "Pad 7 to three digits"}, {"role": "assistant", "content": "007"}],
        [{"role": "user", "content": "Add\n1, 2"}, {"role": "assistant", "content": "3"}]]
    parquet_rows, _ = load_examples("p", d)
    assert [e["messages"][1]["content"] for e in parquet_rows] == ["b", "d"]
    jsonl_rows, _ = load_examples("j", str(d))
    assert jsonl_rows[0]["messages"] == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert not any(p.name.endswith(".arrow") or p.name.startswith("cache") for p in tmp_path.iterdir())
    assert list((Path(os.environ["TUNEBOARD_CACHE"]) / "datasets").rglob("*.arrow"))  # the cache went here


def test_split_key_is_passed_to_datasets(tmp_path):
    rows = [{"instruction": str(i), "output": "x"} for i in range(6)]
    d = make_dir(tmp_path, {"head": {"file_name": "s.json", "split": "train[:2]"},
                            "nope": {"file_name": "s.json", "split": "validation"}}, {"s.json": rows})
    assert [e["_row"] for e in load_examples("head", d)[0]] == [0, 1]
    with pytest.raises(DatasetError, match="dataset 'nope': could not read .*s.json.*Unknown split"):
        load_examples("nope", d)


def test_folder_file_name_reads_every_file(tmp_path):
    d = make_dir(tmp_path, {"f": {"file_name": "parts"}}, {
        "parts/a.json": [{"instruction": "1", "output": "one"}],
        "parts/b.jsonl": [{"instruction": "2", "output": "two"}, {"instruction": "3", "output": ""}]})
    examples, report = load_examples("f", d)
    assert [e["messages"][1]["content"] for e in examples] == ["one", "two"]
    # a folder's rows are numbered on across its files (as a stream numbers them): b.jsonl's row 1 is the set's row 2
    assert [e["_row"] for e in examples] == [0, 1]
    assert report.skipped_rows == [("f", 2, "b.jsonl row 1: empty response (column 'output')")]
    assert data.dataset_row("f", 1, d)["messages"][1]["content"] == "two"
    with pytest.raises(data.SkippedRowError, match=r"dataset 'f': training skips row 2 \(b\.jsonl row 1\): empty resp"):
        data.dataset_row("f", 2, d)


def test_dataset_row_is_the_row_the_report_and_the_examples_number(tmp_path):
    """`tuneboard preview --index` (the Data tab's Row field) takes a row by the number the lint and the data report
    name: the file's row, not the position among the rows training uses (row 3 here is the third usable one)."""
    rows = [{"instruction": f"q{k}", "output": f"a{k}"} for k in range(4)]
    rows.insert(1, {"instruction": "no answer", "output": ""})
    for name, content in (("t.json", rows), ("t.jsonl", "".join(json.dumps(r) + "\n\n" for r in rows))):
        d = make_dir(tmp_path, {"t": {"file_name": name}}, {name: content})
        examples, report = load_examples("t", d)
        assert [e["_row"] for e in examples] == [0, 2, 3, 4] and report.skipped_rows[0].row == 1, name
        for e in examples:
            assert data.dataset_row("t", e["_row"], d) == e, (name, e["_row"])
        with pytest.raises(data.SkippedRowError, match=rf"dataset 't': training skips row 1 of {name}: empty resp") as exc:
            data.dataset_row("t", 1, d)
        assert exc.value.row == 1
        with pytest.raises(DatasetError, match=r"row 5 is out of range: it has 5 rows \(0\.\.4\)"):
            data.dataset_row("t", 5, d)


def test_files_with_a_byte_order_mark(tmp_path):
    """Excel saves "CSV UTF-8" with a byte order mark: the first column is `q`, not `\ufeffq` (the column mapping
    found no `q`); JSON and JSONL files with one load too, and a malformed one is named at its real line."""
    bom = "\ufeff"
    rows = [{"q": "Pad 7 to three digits", "a": "007"}, {"q": "Say hi", "a": "hi"}]
    mapped = {"columns": {"prompt": "q", "response": "a"}}
    d = make_dir(tmp_path, {"c": {"file_name": "t.csv", **mapped}, "j": {"file_name": "t.json", **mapped},
                            "l": {"file_name": "t.jsonl", **mapped}, "bad": {"file_name": "bad.jsonl", **mapped},
                            "none": {"file_name": "none.json", **mapped}}, {
        "t.csv": bom + "q,a\nPad 7 to three digits,007\nSay hi,hi\n",
        "t.json": bom + json.dumps(rows),
        "t.jsonl": bom + "".join(json.dumps(r) + "\n" for r in rows),
        "bad.jsonl": bom + json.dumps(rows[0]) + '\n{"q": "x" "a": "y"}\n',
        "none.json": bom + "[]\n"})
    assert list(data.read_rows(d / "t.csv")[0]) == ["q", "a"]
    for name in ("c", "j", "l"):
        examples, _ = load_examples(name, d)
        assert [[m["content"] for m in e["messages"]] for e in examples] == [[r["q"], r["a"]] for r in rows], name
    with pytest.raises(DatasetError, match=r"bad\.jsonl: not valid JSON at line 2 column"):
        load_examples("bad", d)
    with pytest.raises(DatasetError, match=r"none\.json has no rows"):
        load_examples("none", d)
    # a streamed CSV (streaming: true) and the row editor's and the lint fix's reading (dataset_versions) alike
    from backend.core import dataset_versions
    from backend.dataprep.stream import open_stream

    info = d / "dataset_info.json"
    raw, columns = open_stream("c", json.loads(info.read_text())["c"], d, info, "sft")
    assert columns == ["q", "a"] and next(iter(raw)) == rows[0]
    for name in ("t.json", "t.jsonl"):
        assert dataset_versions.read_rows(d / name, name) == rows, name


def test_num_samples_draws_rows_with_the_seed(tmp_path):
    rows = [{"instruction": str(i), "output": "x"} for i in range(10)]
    d = make_dir(tmp_path, {"s": {"file_name": "s.json", "num_samples": 4},
                            "big": {"file_name": "s.json", "num_samples": 13}}, {"s.json": rows})
    a, report = load_examples("s", d, seed=1)
    b, _ = load_examples("s", d, seed=1)
    assert len(a) == 4 and [e["_row"] for e in a] == [e["_row"] for e in b]
    assert "4 sampled (num_samples)" in report.summary_lines()[0]
    big, _ = load_examples("big", d)
    assert len(big) == 13 and sorted({e["_row"] for e in big}) == list(range(10))


# ---------------------------------------------------------------------------------------------
# Bad rows and bad datasets
# ---------------------------------------------------------------------------------------------
def test_bad_rows_are_skipped_with_counts_and_reasons(tmp_path):
    rows = [
        {"instruction": "ok", "output": "fine"},
        {"instruction": "no answer", "output": ""},
        {"instruction": "missing"},
        {"instruction": "", "input": "", "output": "x"},
        {"instruction": "ok again", "output": "fine"},
        {"instruction": "list", "output": ["not", "text"]},
    ]
    d = make_dir(tmp_path, {"t": {"file_name": "t.json"}}, {"t.json": rows})
    examples, report = load_examples("t", d)
    assert [e["_row"] for e in examples] == [0, 4]
    c = report.counts("t")
    assert (c.total, c.kept, c.skipped) == (6, 2, 4)
    assert [(s.row, s.reason) for s in report.skipped_rows] == [
        (1, "empty response (column 'output')"),
        (2, "column 'output' missing"),
        (3, "empty prompt (columns 'instruction' and 'input')"),
        (5, "column 'output' must be text, got list"),
    ]
    lines = report.summary_lines()
    assert lines[0].startswith("dataset t (alpaca, ") and lines[0].endswith("6 rows, 2 kept, 4 skipped (row numbers from 0)")
    assert "  skipped row 1: empty response (column 'output')" in lines


def test_bad_conversations_are_skipped_with_reasons(tmp_path):
    h, g = (lambda v: {"from": "human", "value": v}), (lambda v: {"from": "gpt", "value": v})
    rows = [
        {"conversations": [h("a"), g("b")]},
        {"conversations": [h("a"), h("again"), g("b")]},
        {"conversations": [g("b"), h("a")]},
        {"conversations": [h("a"), g("b"), h("c")]},
        {"conversations": [h("a"), {"from": "function_call", "value": "{not json"}]},
        {"conversations": [h("a"), {"from": "observation", "value": "42"}, g("b")]},
        {"conversations": [h("a"), {"from": "robot", "value": "b"}]},
        {"conversations": [h("a"), g("  ")]},
        {"conversations": []},
    ]
    d = make_dir(tmp_path, {"t": {"file_name": "t.json", "formatting": "sharegpt"}}, {"t.json": rows})
    examples, report = load_examples("t", d)
    assert [e["_row"] for e in examples] == [0]
    assert report.counts("t").skipped == 8
    assert [(s.row, s.reason) for s in report.skipped_rows] == [
        (1, "conversation must alternate user/assistant, got two 'human' turns at turn 1"),
        (2, "conversation must start with a 'human' turn, got 'gpt' at turn 0"),
        (3, "conversation must end with a 'gpt' turn, it ends with 'human' at turn 2"),
        (4, "turn 1: function call is not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        (5, "an 'observation' turn must follow a function call, got it after 'human' at turn 1"),
    ]  # only the first 5 are kept
    assert report.summary_lines()[-1] == "  ... and 3 more skipped rows"


def test_every_row_bad_is_an_error_naming_the_file(tmp_path):
    d = make_dir(tmp_path, {"t": {"file_name": "t.json"}},
                 {"t.json": [{"instruction": "a", "output": ""}, {"instruction": "b", "output": " "}]})
    with pytest.raises(DatasetError) as err:
        load_examples("t", d)
    msg = str(err.value)
    assert str(tmp_path / "t.json") in msg and "every one of the 2 rows" in msg
    assert "row 0: empty response (column 'output')" in msg


def test_missing_column_in_file_is_an_error(tmp_path):
    d = make_dir(tmp_path, {"t": {"file_name": "t.json", "columns": {"prompt": "question", "response": "answer"}}},
                 {"t.json": [{"question": "a", "reply": "b"}]})
    with pytest.raises(DatasetError, match=r"t\.json has no column 'answer' \(columns.response\); its columns are: question, reply"):
        load_examples("t", d)


def test_missing_file_names_path_and_dataset(tmp_path):
    d = make_dir(tmp_path, {"gone": {"file_name": "nowhere/gone.json"}}, {})
    with pytest.raises(DatasetError) as err:
        load_examples("gone", d)
    assert "dataset 'gone'" in str(err.value) and str(tmp_path / "nowhere" / "gone.json") in str(err.value)


def test_unknown_dataset_suggests_close_names():
    with pytest.raises(DatasetError) as err:
        load_examples("identiti")
    msg = str(err.value)
    assert "unknown dataset 'identiti'" in msg and str(paths.DATA_DIR / "dataset_info.json") in msg
    assert "did you mean 'identity'" in msg


def test_hub_only_entry_is_a_clear_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # TuneBoard's default (backend/cli.py); tests/backend/test_hub_data.py has the rest
    d = make_dir(tmp_path, {"hub": {"hf_hub_url": "someone/some-data", "split": "train"}}, {})
    with pytest.raises(DatasetError, match="^dataset 'hub': someone/some-data is on the Hugging Face Hub and this "
                                           r"machine is offline \(HF_HUB_OFFLINE=1\)"):
        load_examples("hub", d)


def test_malformed_data_file_names_file_and_line(tmp_path):
    d = make_dir(tmp_path, {"t": {"file_name": "t.jsonl"}},
                 {"t.jsonl": '{"instruction": "a", "output": "b"}\n{"instruction": "c" "output": "d"}\n'})
    with pytest.raises(DatasetError, match=r"t\.jsonl: not valid JSON at line 2 column"):
        load_examples("t", d)


def test_a_row_that_is_not_an_object_is_named(tmp_path):
    """pyarrow's own message named row 0 of a column ("changed from object to string in row 0"), after datasets
    logged a second, rawer line."""
    rows = [{"instruction": "a", "output": "b"}] * 3
    d = make_dir(tmp_path, {"a": {"file_name": "a.json"}, "l": {"file_name": "l.jsonl"}},
                 {"a.json": json.dumps(rows + ["oops"]), "l.jsonl": "".join(json.dumps(r) + "\n" for r in rows) + "[1]\n"})
    with pytest.raises(DatasetError, match=r"a\.json: row 3 is a string, not an object \(each row of a data file"):
        load_examples("a", d)
    with pytest.raises(DatasetError, match=r"l\.jsonl: line 4 is a list, not an object"):
        load_examples("l", d)
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "preview", "--dataset", "a", "--dataset-dir", str(d)],
                          cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Failed to load JSON" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"error: dataset 'a': {d / 'a.json'}: row 3 is a string, not an "
                                                    "object (each row of a data file is a JSON object)")


def test_malformed_dataset_info_names_file_line_and_column(tmp_path):
    (tmp_path / "dataset_info.json").write_text('{\n  "a": {"file_name": "a.json"},\n  "b": {"file_name" "b.json"}\n}\n')
    with pytest.raises(DatasetError) as err:
        load_dataset_info(tmp_path)
    assert str(tmp_path / "dataset_info.json") in str(err.value)
    assert "line 3 column 21" in str(err.value)


@pytest.mark.parametrize("entry,expected", [
    ({"file_name": "a.json", "colums": {}}, "dataset 'x': unknown key 'colums' (did you mean 'columns'?)"),
    ({"file_name": "a.json", "formatting": "sharegtp"}, "dataset 'x': 'formatting' must be one of alpaca, sharegpt, openai, got 'sharegtp'"),
    ({"formatting": "alpaca"}, "dataset 'x': missing key 'file_name'"),
    ({"file_name": "a.json", "columns": {"promt": "q"}}, "dataset 'x': unknown key 'columns.promt' (did you mean 'prompt'?)"),
    ({"file_name": "a.json", "formatting": "sharegpt", "tags": {"user_tag": 3}}, "'tags.user_tag' must be a non-empty string"),
    ({"file_name": "a.json", "ranking": "yes"}, "'ranking' must be true or false"),
    ({"file_name": "a.json", "num_samples": 0}, "'num_samples' must be a positive integer"),
    ({"file_name": "a.json", "columns": {"messages": "conversations"}}, "'columns.messages' is for sharegpt/openai"),
])
def test_bad_entries_name_dataset_and_key(tmp_path, entry, expected):
    make_dir(tmp_path, {"ok": {"file_name": "ok.json"}, "x": entry}, {})
    assert list(load_dataset_info(tmp_path)) == ["ok"]  # the bad entry does not hide the good one
    with pytest.raises(DatasetError) as err:
        load_examples("x", tmp_path)  # using it says why
    assert expected in str(err.value)


# ---------------------------------------------------------------------------------------------
# split_train_val
# ---------------------------------------------------------------------------------------------
def test_split_train_val():
    rows = list(range(20))
    train, val = split_train_val(rows, 0.1, seed=3)
    assert len(val) == 2 and sorted(train + val) == rows and train == sorted(train)
    assert split_train_val(rows, 0.1, seed=3) == (train, val)
    assert len(split_train_val(rows, 5, seed=3)[1]) == 5
    assert split_train_val(rows, 0, seed=3) == (rows, [])
    assert len(split_train_val(rows, 0.01, seed=3)[1]) == 1  # a fraction rounds up: never an empty val set
    with pytest.raises(DatasetError, match="leaves no training rows"):
        split_train_val(rows, 20, seed=3)
    with pytest.raises(DatasetError, match="whole number"):
        split_train_val(rows, 2.5, seed=3)


# ---------------------------------------------------------------------------------------------
# register_dataset
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def reg_dir(tmp_path):
    d = make_dir(tmp_path, {"old": {"file_name": "old.json"}, "older": {"file_name": "older.json", "ranking": False}},
                 {"old.json": [{"instruction": "a", "output": "b"}],
                  "new.json": [{"q": "hi", "a": "hello"}, {"q": "x", "a": ""}],
                  "bad.json": [{"q": "hi", "a": ""}]})
    return d


def test_register_dataset_writes_and_keeps_other_entries(reg_dir):
    report = register_dataset(reg_dir, "new", {"file_name": "new.json", "columns": {"prompt": "q", "response": "a"}})
    assert (report.kept, report.skipped) == (1, 1)
    text = (reg_dir / "dataset_info.json").read_text()
    info = json.loads(text)
    assert list(info) == ["old", "older", "new"]
    assert info["older"] == {"file_name": "older.json", "ranking": False}
    assert text.startswith('{\n  "old": {\n    "file_name"')  # indent 2
    assert sorted(p.name for p in reg_dir.iterdir() if p.name.startswith(".")) == []  # no temp file left
    examples, _ = load_examples("new", reg_dir)
    assert examples[0]["messages"][0]["content"] == "hi"


def test_register_dataset_refuses_duplicates_unless_overwrite(reg_dir):
    before = (reg_dir / "dataset_info.json").read_bytes()
    with pytest.raises(DatasetError, match="'old' already exists"):
        register_dataset(reg_dir, "old", {"file_name": "new.json", "columns": {"prompt": "q", "response": "a"}})
    assert (reg_dir / "dataset_info.json").read_bytes() == before
    register_dataset(reg_dir, "old", {"file_name": "new.json", "columns": {"prompt": "q", "response": "a"}},
                     overwrite=True)
    assert list(json.loads((reg_dir / "dataset_info.json").read_text())) == ["old", "older"]
    assert load_dataset_info(reg_dir)["old"]["file_name"] == "new.json"


@pytest.mark.parametrize("name,entry,expected", [
    ("b", {"file_name": "bad.json", "columns": {"prompt": "q", "response": "a"}}, "every one of the 1 rows"),
    ("m", {"file_name": "missing.json"}, "file not found"),
    ("w", {"file_name": "new.json", "columns": {"prompt": "q", "response": "answer"}}, "has no column 'answer'"),
    ("u", {"file_name": "new.json", "formating": "alpaca"}, "unknown key 'formating'"),
    ("a,b", {"file_name": "new.json"}, "commas"),
])
def test_register_dataset_rejects_bad_entries_and_keeps_the_file(reg_dir, name, entry, expected):
    before = (reg_dir / "dataset_info.json").read_bytes()
    with pytest.raises(DatasetError, match=expected):
        register_dataset(reg_dir, name, entry)
    assert (reg_dir / "dataset_info.json").read_bytes() == before


def test_register_dataset_is_atomic_when_the_write_fails(reg_dir, monkeypatch):
    before = (reg_dir / "dataset_info.json").read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(data.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        register_dataset(reg_dir, "new", {"file_name": "new.json", "columns": {"prompt": "q", "response": "a"}})
    assert (reg_dir / "dataset_info.json").read_bytes() == before
    assert not [p for p in reg_dir.iterdir() if p.name.endswith(".tmp")]


def test_register_a_pretraining_corpus(tmp_path):
    d = make_dir(tmp_path, {}, {"corpus.jsonl": [{"text": "one paragraph"}, {"text": "another"}]})
    report = register_dataset(d, "corpus", {"file_name": "corpus.jsonl", "columns": {"prompt": "text"}})
    assert report.kept == 2
    assert [e["text"] for e in load_examples("corpus", d, stage="pt")[0]] == ["one paragraph", "another"]


# ---------------------------------------------------------------------------------------------
# dataset_dir resolution
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset_dir", ["None", "'data'"])
def test_dataset_dir_works_from_another_cwd(tmp_path, dataset_dir):
    code = ("from backend.dataprep.data import load_examples; "
            f"ex, rep = load_examples('identity', {dataset_dir}); print(len(ex), rep.skipped)")
    env = dict(os.environ, PYTHONPATH=str(paths.REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["40", "0"]


def test_unknown_dataset_dir_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match="dataset_dir 'no_such_dir' not found: looked in"):
        load_examples("identity", "no_such_dir")


def test_make_datasets_script_is_deterministic(tmp_path):
    """The bundled files are exactly what scripts/make_datasets.py writes."""
    subprocess.run([sys.executable, str(paths.REPO_ROOT / "scripts" / "make_datasets.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=120)
    for path in sorted(tmp_path.iterdir()):
        if path.name != "dataset_info.json":
            assert path.read_bytes() == (paths.DATA_DIR / path.name).read_bytes(), path.name
    bundled = json.loads((tmp_path / "dataset_info.json").read_text())
    assert {k: v for k, v in load_dataset_info().items() if k in bundled} == bundled
