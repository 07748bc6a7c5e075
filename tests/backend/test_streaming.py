"""streaming: true (backend/dataprep/stream.py): a streamed SFT run trains on tiny_llama and says so; a resumed
run continues the stream at its next row (the same losses as the run it was cut from); interleave_probs mixes
two streams in those shares; packing works on the stream; a stream without max_steps is one line at validate."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from backend.core.rundir import LOG_FILE, RUNNING_LOG, RunDir
from backend.core.spec import SpecError, validate_spec

TUNEBOARD = [sys.executable, "-m", "backend.cli"]


def _data(folder: Path, **sizes: int) -> Path:
    """Alpaca jsonl datasets named by `sizes` (rows each), every row distinct, registered in dataset_info.json."""
    folder.mkdir(parents=True, exist_ok=True)
    info = {}
    for name, rows in sizes.items():
        with (folder / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for i in range(rows):
                f.write(json.dumps({"instruction": f"{name} question {i}: what is {i} plus {i % 7}?",
                                    "output": f"{i} plus {i % 7} is {i + i % 7}."}) + "\n")
        info[name] = {"file_name": f"{name}.jsonl"}
    (folder / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    return folder


def test_a_stream_without_max_steps_is_one_line_at_validate():
    with pytest.raises(SpecError) as err:
        validate_spec({"streaming": True})
    assert str(err.value) == ("max_steps: must be set (> 0) with streaming: true: a stream has no length to count "
                              "epochs by, so max_steps says how many optimizer steps to train")
    with pytest.raises(SpecError) as err:
        validate_spec({"streaming": True, "max_steps": 3, "val_size": 0.1})
    assert str(err.value).startswith("val_size: not supported with streaming: a share (0.1)")
    validate_spec({"streaming": True, "max_steps": 3, "val_size": 4})  # a row count from the stream's head


def _stream_spec(tiny_llama, data: Path, out: Path, **keys):
    return validate_spec({"model_name_or_path": str(tiny_llama), "dataset_dir": str(data), "template": "llama3",
                          "streaming": True, "max_steps": 1, "cutoff_len": 64, "output_dir": str(out), **keys})


def _tokenizer(spec, run_dir):
    from backend.stages.base import tokenizer_and_template

    return tokenizer_and_template(spec, run_dir)[1:]


@pytest.mark.parametrize("probs", ["0.8,0.2", "0.3,0.7"])
def test_interleave_probs_mix_two_streams_in_their_shares(tiny_llama, tmp_path, probs):
    from backend.dataprep.stream import SOURCE, token_stream

    data = _data(tmp_path / "data", a=300, b=300)
    spec = _stream_spec(tiny_llama, data, tmp_path / "out", dataset="a,b", mix_strategy="interleave_under",
                        interleave_probs=probs)
    run_dir = RunDir(tmp_path / "out")
    tokenizer, template = _tokenizer(spec, run_dir)
    first = list(token_stream(spec, "sft", tokenizer, template).take(200))
    run_dir.close()
    counts = Counter(row[SOURCE] for row in first)
    share_a = float(probs.split(",")[0])
    assert sum(counts.values()) == 200 and abs(counts["a"] - 200 * share_a) <= 25, counts
    assert all(row["labels"][-1] != -100 and -100 in row["labels"] for row in first)  # answer trained, prompt masked


def test_the_shuffle_buffer_orders_the_stream_by_its_size_and_seed(tiny_llama, tmp_path):
    from backend.dataprep.stream import streamed_rows

    data = _data(tmp_path / "data", a=30)
    run_dir = RunDir(tmp_path / "out")
    orders = {}
    for buffer, seed in ((1, 42), (16, 42), (16, 42), (16, 7)):
        spec = _stream_spec(tiny_llama, data, tmp_path / "out", dataset="a", buffer_size=buffer, seed=seed)
        tokenizer, template = _tokenizer(spec, run_dir)
        stream = streamed_rows(spec, run_dir, "sft", tokenizer, template)[0]
        orders.setdefault((buffer, seed), []).append([tuple(r["input_ids"]) for r in stream])
    run_dir.close()
    in_file = orders[(1, 42)][0]
    assert len(in_file) == 30 and len(set(in_file)) == 30
    shuffled, again = orders[(16, 42)]
    assert shuffled == again and shuffled != in_file and sorted(shuffled) == sorted(in_file)  # seeded, same rows
    assert orders[(16, 7)][0] != shuffled


def test_pt_stream_is_packed_window_by_window(tiny_llama, tmp_path):
    from backend.dataprep.stream import streamed_rows
    from backend.stages.base import batching

    data = _data(tmp_path / "data", a=40)
    spec = _stream_spec(tiny_llama, data, tmp_path / "out", dataset="a", stage="pt", cutoff_len=48, buffer_size=8)
    run_dir = RunDir(tmp_path / "out")
    tokenizer, _ = _tokenizer(spec, run_dir)
    stream, _, _ = streamed_rows(spec, run_dir, "pt", tokenizer)
    plain = list(stream)
    packed, _ = batching(spec, run_dir, stream, tokenizer)
    packed = list(packed)
    run_dir.close()
    assert len(plain) == 40 and len(packed) < len(plain)
    assert all(len(p["input_ids"]) <= 48 for p in packed)
    assert sum(len(p["input_ids"]) for p in packed) == sum(len(r["input_ids"]) for r in plain)
    assert sum(p["position_ids"].count(0) for p in packed) == 40
    assert "streaming: dataset a read lazily" in (tmp_path / "out" / RUNNING_LOG).read_text()


def _train(tiny_llama, data: Path, out: Path, *extra: str) -> list[float]:
    proc = subprocess.run(TUNEBOARD + ["train", f"model_name_or_path={tiny_llama}", f"output_dir={out}",
                                       f"dataset_dir={data}", "dataset=s", "template=llama3", "streaming=true",
                                       "buffer_size=16", "cutoff_len=64", "per_device_train_batch_size=2",
                                       "learning_rate=0.01", "lr_scheduler_type=constant", "max_steps=4",
                                       "save_steps=2", "logging_steps=1", "lora_rank=4", "plot_loss=false", *extra],
                          cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / LOG_FILE).read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


@pytest.mark.slow
def test_streaming_sft_trains_and_resumes_at_the_next_row(tiny_llama, tmp_path):
    data = _data(tmp_path / "data", s=40)
    whole = _train(tiny_llama, data, tmp_path / "whole")
    log = (tmp_path / "whole" / RUNNING_LOG).read_text()
    assert len(whole) == 4 and "streaming: dataset s read lazily" in log, log
    assert "padding-free batches" in log or "padded batches" in log
    assert "training: 4 steps, passes over the stream as max_steps needs" in log, log

    resumed_dir = tmp_path / "resumed"  # cut after step 2: a new run from the uninterrupted run's checkpoint-2
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = _train(tiny_llama, data, resumed_dir, "resume_from_checkpoint=true")
    assert resumed[-2:] == pytest.approx(whole[2:], rel=1e-4), (resumed, whole)
