"""The tokenized cache (tokenized_path, overwrite_cache, and the default one under the saves folder): a second run
of the same data loads the saved rows and says so; a changed setting re-tokenizes and says why; a cache path that
is a file is one line at validate. Tokenization only (no model, no training)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets

from backend.core import paths
from backend.core.rundir import RUNNING_LOG, RunDir
from backend.core.spec import SpecError, validate_spec
from backend.dataprep.resolve import pick_template
from backend.stages import pt, sft
from backend.training.models import load_tokenizer, resolve_model

import pytest


def _tokenize(stage, tiny_llama, out, **keys):
    spec = validate_spec(dict(model_name_or_path=str(tiny_llama), dataset="identity" if stage is sft else "c4_demo",
                              stage="sft" if stage is sft else "pt", template="llama3", max_samples=12,
                              output_dir=str(out), **keys))
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    run_dir = RunDir(out)
    if stage is sft:
        template = pick_template(spec.template, resolved, tokenizer, warn=run_dir.warn)
        rows = sft.tokenized(spec, run_dir, tokenizer, template)[0]
    else:
        rows = pt.tokenized(spec, run_dir, tokenizer)[0]
    run_dir.close()
    # the first run as a second: the rows the Trainer gets are the saved cache, memory-mapped (never a list of all)
    assert isinstance(rows, datasets.Dataset) and rows.cache_files, type(rows)
    cache = Path(keys.get("tokenized_path") or paths.saves_dir() / ".cache" / "tokenized")
    assert all(Path(f["filename"]).is_relative_to(cache) for f in rows.cache_files), rows.cache_files
    return rows.to_list(), (out / RUNNING_LOG).read_text(encoding="utf-8")


def test_second_run_loads_the_cache_and_a_changed_cutoff_retokenizes(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path / "saves"))
    first, log1 = _tokenize(sft, tiny_llama, tmp_path / "r1", cutoff_len=64)
    assert "tokenizing (key" in log1 and "no tokenized cache of these datasets yet" in log1, log1
    assert "saved the tokenized dataset to" in log1
    second, log2 = _tokenize(sft, tiny_llama, tmp_path / "r2", cutoff_len=64)
    assert second == first and "loaded the tokenized dataset from" in log2 and "tokenizing" not in log2, log2
    assert str(paths.saves_dir() / ".cache" / "tokenized") in log2
    assert "train rows: 12 rows" in log2  # the stats of the tokenizing run, shown again
    third, log3 = _tokenize(sft, tiny_llama, tmp_path / "r3", cutoff_len=16)
    assert "loaded" not in log3 and "cutoff_len 64 -> 16" in log3, log3
    assert third != first and max(len(r["input_ids"]) for r in third) <= 16
    _, log4 = _tokenize(sft, tiny_llama, tmp_path / "r4", cutoff_len=64, overwrite_cache=True)
    assert "tokenizing (key" in log4 and "overwrite_cache is true" in log4, log4
    _, log5 = _tokenize(sft, tiny_llama, tmp_path / "r5", cutoff_len=64, train_on_prompt=True)
    assert "train_on_prompt False -> True" in log5, log5


def test_tokenized_path_is_checked_against_the_data(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path / "saves"))
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(paths.DATA_DIR / "c4_demo.jsonl", data)
    info = json.loads((paths.DATA_DIR / "dataset_info.json").read_text())
    (data / "dataset_info.json").write_text(json.dumps({"c4_demo": info["c4_demo"]}))
    cache = tmp_path / "tok"
    keys = dict(tokenized_path=str(cache), dataset_dir=str(data), cutoff_len=32)
    first, _ = _tokenize(pt, tiny_llama, tmp_path / "r1", **keys)
    assert (cache / "meta.json").is_file() and (cache / "train").is_dir()
    again, log = _tokenize(pt, tiny_llama, tmp_path / "r2", **keys)
    assert again == first and f"loaded the tokenized dataset from {cache}" in log, log
    data_file = data / "c4_demo.jsonl"
    data_file.write_text(data_file.read_text().replace("a", "b", 1))  # the data changed: never a stale cache
    changed, log = _tokenize(pt, tiny_llama, tmp_path / "r3", **keys)
    assert "loaded" not in log and f"{data_file} changed" in log and changed != first, log
    assert not (paths.saves_dir() / ".cache").exists()  # tokenized_path set: no default cache written

    with pytest.raises(SpecError) as err:
        validate_spec({"tokenized_path": str(data_file)})
    assert str(err.value) == (f"tokenized_path: {data_file} is a file: tokenized_path names a folder "
                              "(the tokenized dataset is saved there in Arrow files)")


def test_rows_from_two_spawned_tokenizer_processes_are_those_of_one(tiny_llama, tmp_path, monkeypatch):
    """The cache's rows come back from the tokenizer processes as Arrow tables (spawned processes: the tokenizer and
    template sent once, the examples with each batch), written in order: the same rows as one process."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("in_workers uses at most one process per CPU")
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path / "saves"))
    one, _ = _tokenize(sft, tiny_llama, tmp_path / "r1", cutoff_len=64, tokenized_path=str(tmp_path / "c1"))
    two, log = _tokenize(sft, tiny_llama, tmp_path / "r2", cutoff_len=64, tokenized_path=str(tmp_path / "c2"),
                         preprocessing_num_workers=2, preprocessing_batch_size=5)
    assert "tokenized in 2 processes" in log and two == one and len(one) == 12, log
    assert not list(tmp_path.glob(".c2.rows-*"))  # the batches' Arrow file is gone once the cache is saved


@pytest.mark.slow
@pytest.mark.parametrize("keys", [["stage=pt", "dataset=c4_demo"],  # pt packs: pack_rows reads the Arrow rows as lists
                                  ["dataset=identity", "template=llama3", "val_size=0.25", "eval_strategy=steps",
                                   "eval_steps=1"]])  # an eval split: the Trainer evaluates on the Arrow rows too
def test_first_and_second_run_train_on_the_memory_mapped_cache(tiny_llama, tmp_path, keys):
    """`tuneboard train` on the rows of the cache it has just written (first run) and on the cache loaded (second
    run): both train, on the same tokens."""
    seen, logs = [], []
    for n in (1, 2):
        out = tmp_path / f"r{n}"
        args = [f"model_name_or_path={tiny_llama}", f"output_dir={out}", *keys, "cutoff_len=64", "max_samples=16",
                "max_steps=2", "lora_rank=4", "per_device_train_batch_size=2", f"tokenized_path={tmp_path / 'tok'}"]
        proc = subprocess.run([sys.executable, "-m", "backend.cli", "train", *args], cwd="/tmp", capture_output=True,
                              text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, (n, proc.stdout[-3000:], proc.stderr[-3000:])
        status = json.loads((out / "status.json").read_text())
        assert status["state"] == "completed", status
        seen.append(status["final_metrics"]["num_input_tokens_seen"])
        logs.append((out / RUNNING_LOG).read_text(encoding="utf-8"))
    assert "saved the tokenized dataset" in logs[0] and "loaded the tokenized dataset" in logs[1], logs
    assert seen[0] == seen[1] > 0, seen


DIES = """
import os, sys, tempfile
from backend.dataprep.preprocess import Stats, in_workers, rows_in_arrow

def build(examples):  # a tokenizer process that dies (killed, out of memory)
    os._exit(3)

if __name__ == "__main__":
    with rows_in_arrow(tempfile.mkdtemp()):
        try:
            in_workers(build, list(range(40)), 2)
        except RuntimeError as exc:
            print("ERROR", exc)
"""


def test_a_tokenizer_process_that_dies_is_an_error_not_a_hang(tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("in_workers uses at most one process per CPU")
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, str(script)], cwd=repo, timeout=120, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=repo))
    assert proc.returncode == 0 and "ERROR a tokenizer process ended unexpectedly" in proc.stdout, (
        proc.stdout, proc.stderr[-2000:])
