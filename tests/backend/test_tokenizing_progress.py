"""preprocessing_batch_size and the tokenizing progress: rows are handed out preprocessing_batch_size at a time, in one
process or several, and each finished batch moves the run's status.json "tokenizing" progress (the Train tab's bar)."""
from __future__ import annotations

import json
import os

import pytest

from backend.core import rundir
from backend.core.rundir import STATUS_FILE, RunDir
from backend.core.spec import SpecError, validate_spec
from backend.dataprep.preprocess import build_sft_dataset, tokenizing
from backend.dataprep.templates import get_template
from backend.training.models import load_tokenizer, resolve_model

ROWS = 2000


def _examples(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}],
             "_source": "sums", "_row": i} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_and_template(tiny_qwen2):
    tokenizer = load_tokenizer(resolve_model(str(tiny_qwen2)))
    return tokenizer, get_template("chatml", tokenizer)


@pytest.mark.parametrize("workers", [1, 2])
def test_each_batch_moves_the_status_progress(tokenizer_and_template, tmp_path, monkeypatch, workers):
    if workers > (os.cpu_count() or 1):
        pytest.skip("in_workers uses at most one process per CPU")
    tokenizer, template = tokenizer_and_template
    monkeypatch.setattr(rundir, "TOKENIZING_EVERY", 0)  # every report written (a run writes at most twice a second)
    run_dir = RunDir(tmp_path / "run")
    run_dir.start()
    written = []

    def report(done: int, total: int) -> None:
        run_dir.tokenizing_progress(done, total)
        written.append(json.loads((tmp_path / "run" / STATUS_FILE).read_text())["tokenizing"])

    examples = _examples(ROWS)
    with tokenizing(batch_size=300, report=report):
        rows, stats = build_sft_dataset(examples, template, tokenizer, 64, num_workers=workers)
    # 300 rows a batch: the progress moves by 300 (the last batch: the 200 left), from 0 to every row
    assert [w["done"] for w in written] == [0, 300, 600, 900, 1200, 1500, 1800, 2000]
    assert {w["total"] for w in written} == {ROWS}
    assert all(w["rows_per_s"] > 0 and w["eta_s"] >= 0 for w in written[1:])
    assert written[-1]["eta_s"] == 0 and written[0]["rows_per_s"] is None
    assert stats.workers == workers and len(rows) == ROWS
    # rows from a tokenizing process weigh what rows made here do: labels share the input_ids' ints
    assert all(label is i or label == -100 for row in rows for i, label in zip(row["input_ids"], row["labels"]))
    assert len({id(label) for row in rows for label in row["labels"] if label == -100}) == 1
    # the same rows as one process with the default batch size and no progress
    assert rows == build_sft_dataset(examples, template, tokenizer, 64)[0]


def test_progress_is_written_at_most_every_half_second_but_always_at_the_ends(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.start()
    status = lambda: json.loads((tmp_path / STATUS_FILE).read_text())["tokenizing"]  # noqa: E731
    run_dir.tokenizing_progress(0, 1000)
    assert status()["done"] == 0
    run_dir.tokenizing_progress(10, 1000)  # right after the start: not written
    assert status()["done"] == 0
    run_dir.tokenizing_progress(1000, 1000)  # the end always is
    assert status()["done"] == 1000 and status()["eta_s"] == 0
    run_dir.start()  # a resumed run's status starts without the earlier process's progress
    assert "tokenizing" not in json.loads((tmp_path / STATUS_FILE).read_text())


def test_a_stream_refuses_a_batch_size():
    spec = {"stage": "sft", "dataset": "identity", "streaming": True, "max_steps": 2}
    assert validate_spec(dict(spec)).preprocessing_batch_size == 1000
    with pytest.raises(SpecError, match="preprocessing_batch_size: not supported with streaming: .*drop preprocessing_batch_size"):
        validate_spec(dict(spec, preprocessing_batch_size=64))
