"""Hub datasets (issue 21 item 3): an hf_hub_url entry is read with datasets' own loader, here from a local folder
laid out like a hub repository (parquet and jsonl shards, README.md configs, splits, a data folder); offline, a hub
entry or `dataset: org/name` is one line at validate and in the Train form naming the dataset and how to get it."""
from __future__ import annotations

import json
import re
import sys

import pytest

from backend.core.dataset_info import DatasetError
from backend.core.spec import SpecError, validate_spec
from backend.dataprep.data import load_examples

README = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/train-*.parquet
  - split: test
    path: en/test-00000-of-00001.parquet
- config_name: de
  data_files:
  - split: train
    path: de/train.parquet
---
# a dataset card
"""


def _rows(lang: str, split: str, n: int, start: int = 0) -> list[dict]:
    return [{"instruction": f"{lang} {split} question {i}", "input": "", "output": f"{lang} answer {i}"}
            for i in range(start, start + n)]


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    import pandas as pd

    root = tmp_path_factory.mktemp("hub")
    repo = root / "hub_repo"
    (repo / "en").mkdir(parents=True)
    (repo / "de").mkdir()
    (repo / "README.md").write_text(README)
    pd.DataFrame(_rows("en", "train", 3)).to_parquet(repo / "en" / "train-00000-of-00002.parquet")
    pd.DataFrame(_rows("en", "train", 2, start=3)).to_parquet(repo / "en" / "train-00001-of-00002.parquet")
    pd.DataFrame(_rows("en", "test", 2)).to_parquet(repo / "en" / "test-00000-of-00001.parquet")
    pd.DataFrame(_rows("de", "train", 4)).to_parquet(repo / "de" / "train.parquet")
    plain = root / "plain_repo" / "data" / "v2"  # no configs, jsonl shards: `folder` picks the data_dir
    plain.mkdir(parents=True)
    for shard, rows in enumerate((_rows("v2", "train", 2), _rows("v2", "train", 1, start=2))):
        (plain / f"train-{shard}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "plain_repo" / "data" / "v1").mkdir()
    (root / "plain_repo" / "data" / "v1" / "train.jsonl").write_text(json.dumps(_rows("v1", "train", 1)[0]) + "\n")
    info = {
        "hub_en": {"hf_hub_url": "hub_repo", "subset": "en"},
        "hub_en_test": {"hf_hub_url": "hub_repo", "subset": "en", "split": "test"},
        "hub_de": {"hf_hub_url": str(repo), "subset": "de"},
        "hub_folder": {"hf_hub_url": "plain_repo", "folder": "data/v2"},
        "hub_subset_typo": {"hf_hub_url": "hub_repo", "subset": "eng"},
        "hub_split_typo": {"hf_hub_url": "hub_repo", "subset": "en", "split": "tset"},
        "hub_folder_typo": {"hf_hub_url": "./hub_rep"},
        "remote": {"hf_hub_url": "tuneboard-tests/alpaca-mini", "subset": "en"},
        "modelscope": {"ms_hub_url": "AI-ModelScope/alpaca-gpt4-data-en"},
        "cloud": {"cloud_file_name": "s3://a-bucket/alpaca.json"},
    }
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


def _questions(name, hub_dir):
    examples, _ = load_examples(name, hub_dir)
    return [e["messages"][0]["content"] for e in examples]


def test_a_hub_style_folder_loads_through_the_hub_loader(hub_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # TuneBoard's default (backend/cli.py): a folder needs no hub
    assert _questions("hub_en", hub_dir) == [f"en train question {i}" for i in range(5)]  # both parquet shards
    assert _questions("hub_en_test", hub_dir) == ["en test question 0", "en test question 1"]
    assert _questions("hub_de", hub_dir) == [f"de train question {i}" for i in range(4)]  # an absolute folder
    assert _questions("hub_folder", hub_dir) == [f"v2 train question {i}" for i in range(3)]
    validate_spec({"dataset": "hub_en,hub_folder", "dataset_dir": str(hub_dir)})  # validate accepts them


def test_a_typo_is_one_line(hub_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError) as exc:  # found by datasets' loader
        load_examples("hub_split_typo", hub_dir)
    message = str(exc.value)
    assert "\n" not in message and message.startswith("dataset 'hub_split_typo': could not load hf_hub_url "
                                                      f"{hub_dir / 'hub_repo'} subset 'en' split 'tset': ")
    assert "tset" in message.split(": ", 2)[2] and "'test'" in message  # datasets' words: the split and the ones there
    with pytest.raises(SpecError) as exc:  # validate reads the folder's README.md configs
        validate_spec({"dataset": "hub_subset_typo", "dataset_dir": str(hub_dir)})
    assert exc.value.errors == [("dataset", f"dataset 'hub_subset_typo': subset 'eng' is not a config of "
                                            f"{hub_dir / 'hub_repo'} (its README.md configs: en, de); did you mean 'en'?")]
    with pytest.raises(DatasetError, match="^" + re.escape(exc.value.errors[0][1]) + "$"):
        load_examples("hub_subset_typo", hub_dir)  # the loader says the same line
    with pytest.raises(SpecError) as exc:
        validate_spec({"dataset": "hub_folder_typo", "dataset_dir": str(hub_dir)})
    assert exc.value.errors == [("dataset", f"dataset 'hub_folder_typo': hf_hub_url folder not found: "
                                            f"{hub_dir / 'hub_rep'}")]
    with pytest.raises(SpecError) as exc:  # a hub id typed with a typo, offline: the one offline line
        validate_spec({"dataset": "tuneboard-tests/alpaca-mnii", "dataset_dir": str(hub_dir)})
    assert len(exc.value.errors) == 1 and "tuneboard-tests/alpaca-mnii is on the Hugging Face Hub" in str(exc.value)


def test_offline_a_hub_entry_is_one_line_at_validate_and_in_the_form(hub_dir, monkeypatch):
    from webui import form

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)  # the line names the variable that made it offline
    line = ("dataset 'remote': tuneboard-tests/alpaca-mini is on the Hugging Face Hub and this machine is offline "
            "(HF_HUB_OFFLINE=1): where the hub is reachable, run with HF_HUB_OFFLINE=0 (datasets caches it), or "
            "download it (huggingface-cli download --repo-type dataset tuneboard-tests/alpaca-mini --local-dir DIR) and "
            "register it: hf_hub_url: DIR (the same subset / split / folder), or a local file with file_name in "
            "dataset_info.json")
    with pytest.raises(SpecError) as exc:
        validate_spec({"dataset": "remote", "dataset_dir": str(hub_dir)})
    assert exc.value.errors == [("dataset", line)]
    with pytest.raises(DatasetError, match="^" + line.replace("(", r"\(").replace(")", r"\)") + "$"):
        load_examples("remote", hub_dir)  # the loader says the same line
    with pytest.raises(SpecError, match="ms_hub_url AI-ModelScope/alpaca-gpt4-data-en: loading from ModelScope needs "
                                        "the modelscope package, which is not installed"):
        validate_spec({"dataset": "modelscope", "dataset_dir": str(hub_dir)})
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # downloads allowed, and the hub does not answer
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # the discard port: nothing listens there
    with pytest.raises(SpecError) as exc:
        validate_spec({"dataset": "remote", "dataset_dir": str(hub_dir)})
    assert exc.value.errors == [("dataset", line.replace("(HF_HUB_OFFLINE=1)", "(127.0.0.1 is unreachable)"))]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(sys.modules, "s3fs", None)  # Python's own mark of a module that cannot be imported
    with pytest.raises(SpecError, match=r"^dataset: dataset 'cloud': cloud_file_name s3://a-bucket/alpaca.json needs "
                                        r"the s3fs package \(fsspec's s3:// file system\), which is not installed"):
        validate_spec({"dataset": "cloud", "dataset_dir": str(hub_dir)})
    # the Train form (webui.form.check, as the Train tab validates) on `dataset: org/name` with the shipped data/
    spec, errors = form.check({"dataset": "tuneboard-tests/alpaca-mini"}, [])
    assert spec is None and errors == [("dataset", line.replace("'remote'", "'tuneboard-tests/alpaca-mini'"))]


def test_the_tokenized_cache_keys_a_hub_style_folder_by_its_files(hub_dir, tiny_llama):
    from transformers import AutoTokenizer

    from backend.dataprep.token_cache import cache_key, key_id

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    folder = validate_spec({"dataset": "hub_folder", "dataset_dir": str(hub_dir)}, check_files=False)
    parts, no_default = cache_key(folder, "sft", tokenizer)
    assert no_default is None and f"file {hub_dir / 'plain_repo' / 'data' / 'v2' / 'train-0.jsonl'}" in parts
    before = key_id(parts)
    shard = hub_dir / "plain_repo" / "data" / "v1" / "train.jsonl"  # not read by the other tests
    shard.write_text(shard.read_text() + json.dumps(_rows("v1", "train", 1, start=1)[0]) + "\n")
    assert key_id(cache_key(folder, "sft", tokenizer)[0]) != before  # a changed file is a new key
    remote = validate_spec({"dataset": "remote", "dataset_dir": str(hub_dir)}, check_files=False)
    assert "has no local file" in cache_key(remote, "sft", tokenizer)[1]  # a hub id can change unseen: no default cache
