"""Property-based tests (hypothesis, issue 9): whatever a user writes, the spec parser and the dataset
converters answer with our own error types only (SpecError; DatasetError / RowError), never a TypeError,
KeyError or AttributeError from inside. Modest example counts, no deadline (the machine is shared)."""
from __future__ import annotations

import json

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from backend.dataprep import data as D
from backend.core.spec import RunSpec, SpecError, load_spec

SETTINGS = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = sorted(RunSpec.model_fields)
keys = st.sampled_from(FIELDS) | st.sampled_from(["hub_token", "optim", "save_only_model", "logging_first_step",
                                                  "report_to", "lorarank", "--lora_rank"]) | st.text(max_size=10)
raw_values = st.text(max_size=20) | st.sampled_from(["", "null", "[1", "{a: 1}", "1e23", "-1", "true", "nan",
                                                     ".inf", "0x10", "~", "!!python/object:os.system ls",
                                                     "&a [*a]", "'", "\x00"])


# ------------------------------------------------------------------ spec

@SETTINGS
@given(st.lists(st.tuples(keys, raw_values), max_size=6))
def test_key_value_overrides_raise_only_spec_errors(pairs):
    try:
        load_spec(None, [f"{k}={v}" for k, v in pairs])
    except SpecError as exc:
        assert str(exc).strip()  # one line per problem, never empty


@SETTINGS
@given(st.lists(st.text(max_size=25), max_size=4))
def test_arbitrary_command_line_words_raise_only_spec_errors(words):
    try:
        load_spec(None, words)
    except SpecError:
        pass


@SETTINGS
@given(st.dictionaries(keys, json_values, max_size=8))
def test_yaml_mappings_raise_only_spec_errors(tmp_path_factory, mapping):
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(yaml.safe_dump(mapping, allow_unicode=True), encoding="utf-8")
    try:
        load_spec(path)
    except SpecError:
        pass


@SETTINGS
@given(st.text(max_size=80) | st.binary(max_size=80).map(lambda b: b.decode("latin-1")))
def test_any_spec_file_text_raises_only_spec_errors(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass") if text.isascii() else text.encode("latin-1", "replace"))
    try:
        load_spec(path)
    except SpecError:
        pass


# ------------------------------------------------------------------ dataset_info.json and row conversion

entries = st.dictionaries(st.sampled_from(list(D.ENTRY_KEYS) + ["colums", "x"]), json_values, max_size=5) | json_values


@SETTINGS
@given(st.dictionaries(st.text(max_size=6), entries, max_size=4) | json_values)
def test_any_dataset_info_raises_only_dataset_errors(tmp_path_factory, info):
    folder = tmp_path_factory.mktemp("info")
    (folder / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    try:
        read = D.read_dataset_info(folder)
    except D.DatasetError:
        return
    for name in read.raw:
        try:
            read.entry(name)
        except D.DatasetError:
            pass


ENTRY_SHAPES = [
    {},  # alpaca
    {"ranking": True},
    {"columns": {"kto_tag": "label", "system": "system", "history": "history"}},
    {"formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system", "tools": "tools"}},
    {"formatting": "sharegpt", "ranking": True},
    {"formatting": "openai", "columns": {"messages": "messages", "kto_tag": "label"}},
    {"columns": {"text": "text"}},
]
COLUMN_NAMES = ["instruction", "input", "output", "system", "history", "chosen", "rejected", "label", "text",
                "conversations", "messages", "tools"]
turn = st.dictionaries(st.sampled_from(["from", "value", "role", "content", "tool_calls"]),
                       st.sampled_from(["human", "gpt", "user", "assistant", "system", "tool", "observation",
                                        "function_call"]) | json_values, max_size=3)
cell = json_values | st.lists(turn, max_size=4) | st.lists(turn, max_size=4).map(json.dumps)
rows = st.dictionaries(st.sampled_from(COLUMN_NAMES), cell, max_size=6)


@SETTINGS
@given(st.sampled_from(ENTRY_SHAPES), st.sampled_from(["pt", "sft", "rm", "dpo", "kto", "grpo"]), rows)
def test_row_conversion_raises_only_row_errors(shape, stage, row):
    spec = D._entry_spec("t", {"file_name": "t.json", **shape})
    try:
        example = D.convert_row(row, spec, stage)
    except D.RowError as exc:
        assert str(exc)
        return
    assert isinstance(example, dict) and ("text" in example or example["messages"])


@settings(SETTINGS, max_examples=60)  # each example reads a file through `datasets`
@given(st.lists(rows, min_size=0, max_size=5), st.sampled_from(ENTRY_SHAPES[:4]))
@example([{"instruction": {"": None, "\x00": None}}], {})  # found by a CI run: pyarrow's "duplicate field names"
def test_loading_a_file_of_any_rows_raises_only_dataset_errors(tmp_path_factory, file_rows, shape):
    folder = tmp_path_factory.mktemp("rows")
    (folder / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.jsonl", **shape}}))
    (folder / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in file_rows))
    stage = "dpo" if shape.get("ranking") else "kto" if "kto_tag" in shape.get("columns", {}) else "sft"
    try:
        examples, report = D.load_examples("t", folder, stage=stage)
    except D.DatasetError as exc:
        assert "dataset 't'" in str(exc)
        return
    assert len(examples) == report.kept >= 1
