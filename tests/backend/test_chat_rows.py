"""Chat's "Save as a training row" (backend.core.chat_rows): the conversation with its corrected answer lands in
the picked dataset in that dataset's own columns and tags, or in a new dataset registered for it, and the same
loader that trains reads it back as the conversation that was saved; refusals are one line and write nothing."""
from __future__ import annotations

import json
import shutil

import pytest

from backend.core.chat_rows import save_row
from backend.core.dataset_info import DatasetError, load_dataset_info
from backend.core.paths import DATA_DIR
from backend.dataprep.data import load_examples

CONVERSATION = [{"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And times 3?"}, {"role": "assistant", "content": "12, since 4 x 3 = 12."}]


@pytest.fixture
def data_dir(tmp_path):
    for name in ("sharegpt_multiturn_demo.json", "alpaca_en_demo.json", "dpo_en_demo.json"):
        shutil.copy(DATA_DIR / name, tmp_path / name)
    info = json.loads((DATA_DIR / "dataset_info.json").read_text())
    keep = {k: info[k] for k in ("sharegpt_multiturn_demo", "alpaca_en_demo", "dpo_en_demo")}
    (tmp_path / "dataset_info.json").write_text(json.dumps(keep, indent=2))
    return tmp_path


def test_a_new_dataset_is_created_registered_and_reads_back(data_dir):
    saved = save_row(data_dir, "my_fixes", CONVERSATION)
    assert saved.created and saved.index == 0 and saved.path == data_dir / "my_fixes.jsonl"
    assert load_dataset_info(data_dir)["my_fixes"]["formatting"] == "openai"
    again = save_row(data_dir, "my_fixes", CONVERSATION[:3])
    assert not again.created and again.index == 1
    examples, report = load_examples("my_fixes", data_dir)
    assert report.skipped == 0 and len(examples) == 2
    assert examples[0]["messages"] == [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    assert examples[1]["messages"][-1]["content"] == "4."


def test_an_existing_sharegpt_dataset_gets_the_row_in_its_own_tags(data_dir):
    before = json.loads((data_dir / "sharegpt_multiturn_demo.json").read_text())
    saved = save_row(data_dir, "sharegpt_multiturn_demo", CONVERSATION)
    rows = json.loads(saved.path.read_text())
    assert not saved.created and saved.index == len(before) and rows[:-1] == before
    assert rows[-1]["system"] == "Answer in one line." and rows[-1]["conversations"][0] == {"from": "human", "value": "What is 2 + 2?"}
    examples, _ = load_examples("sharegpt_multiturn_demo", data_dir)
    assert examples[-1]["messages"][-1]["content"] == "12, since 4 x 3 = 12."


def test_one_turn_goes_into_alpaca_columns(data_dir):
    saved = save_row(data_dir, "alpaca_en_demo", [CONVERSATION[1], CONVERSATION[2]])
    assert json.loads(saved.path.read_text())[-1] == {"instruction": "What is 2 + 2?", "input": "", "output": "4."}


@pytest.mark.parametrize("name, messages, words", [
    ("alpaca_en_demo", CONVERSATION[1:], "no history column"),
    ("dpo_en_demo", CONVERSATION[1:3], "ranking dataset"),
    ("bad name!", CONVERSATION, "dataset name"),
    ("my_fixes", CONVERSATION[:2], "must end with a non-empty answer"),
])
def test_refusals_name_the_dataset_and_write_nothing(data_dir, name, messages, words):
    files = {p.name: p.read_bytes() for p in data_dir.iterdir()}
    with pytest.raises(DatasetError, match=words):
        save_row(data_dir, name, messages)
    assert {p.name: p.read_bytes() for p in data_dir.iterdir()} == files


def test_versions_keep_the_original_and_undo_removes_only_a_version(data_dir):
    from backend.core import dataset_versions as V

    original = (data_dir / "alpaca_en_demo.json").read_bytes()
    first = V.replace_row(data_dir, "alpaca_en_demo", 0, {"instruction": "q", "input": "", "output": "a"})
    second = V.replace_row(data_dir, "alpaca_en_demo", 0, {"instruction": "q2", "input": "", "output": "a2"})
    assert (first.name, second.name) == ("alpaca_en_demo_v2", "alpaca_en_demo_v3")
    assert (data_dir / "alpaca_en_demo.json").read_bytes() == original
    with pytest.raises(DatasetError, match="not a saved version"):
        V.remove_version(data_dir, "alpaca_en_demo")
    with pytest.raises(DatasetError, match="row 1000000 is not in"):
        V.replace_row(data_dir, "alpaca_en_demo", 10**6, {})
    V.remove_version(data_dir, "alpaca_en_demo_v2")
    assert not first.path.exists() and "alpaca_en_demo_v2" not in load_dataset_info(data_dir)
    assert second.path.exists() and "alpaca_en_demo_v3" in load_dataset_info(data_dir)
