"""tuneboard distill through the real CLI (slow tier): the whole loop with the real `tuneboard api` as the local
teacher (documents of several kinds -> pairs -> a registered dataset -> a few LoRA steps -> the scorecard). The
kill -9 during generate and its rerun are in the fast tier (test_distill.py), with a teacher that holds a request
so the kill always lands mid-generate."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from fake_teacher import make_docs

from backend.distill import REPORT_FILE, read_progress
from backend.core.paths import DEFAULT_MODEL_ID

pytestmark = pytest.mark.slow
TUNEBOARD = [sys.executable, "-m", "backend.cli"]


def distill(*args: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(TUNEBOARD + ["distill", *args], cwd="/tmp", capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_local_teacher_documents_to_dataset_to_adapter_to_scorecard(tmp_path, tiny_qwen2, default_model_dir):
    """The default model served by `tuneboard api` writes short summaries (answer_format text); the tiny student
    trains 2 steps on them; the scorecard compares base and tuned on the held-out documents' chunks."""
    docs = make_docs(tmp_path / "all")
    (tmp_path / "docs").mkdir()
    for name in ("a.txt", "c.html", "d.pdf"):  # three kinds; one of the three documents is held out
        (docs / name).rename(tmp_path / "docs" / name)
    docs = tmp_path / "docs"
    out, data = tmp_path / "run", tmp_path / "data"
    spec = tmp_path / "distill.yaml"
    spec.write_text(f"documents: {docs}\ntext_column: body\ntask: Summarize the text in one short sentence.\n"
                    f"answer_format: text\nteacher: local\nteacher_local_model: {DEFAULT_MODEL_ID}\n"
                    f"model_name_or_path: {tiny_qwen2}\ncutoff_len: 160\nanswer_tokens: 64\neval_ratio: 0.34\n"
                    f"dataset_name: summaries\ndataset_dir: {data}\noutput_dir: {out}\nsteps: generate,train,score\n"
                    "train_args: {max_steps: 2, logging_steps: 1, lora_rank: 4, plot_loss: false}\n"
                    "score_max_rows: 2\nconcurrency: 2\n")
    proc = distill(str(spec))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "completed" and status["phase"] == "score"
    progress = read_progress(out)
    assert progress["documents"] == 3 and progress["to_ask"] == 3 and progress["eval_chunks"] == 1
    assert progress["accepted"] + sum(progress["rejected"].values()) == 3
    info = json.loads((data / "dataset_info.json").read_text())
    assert info["summaries"]["file_name"] == "summaries.json"
    rows = json.loads((data / "summaries.json").read_text())
    assert len(rows) == progress["dataset"]["train_rows"] >= 1 and all(r["output"].strip() for r in rows)
    # the local teacher really answered (its log says it served), and it is gone now
    assert "serving on http://127.0.0.1:" in (out / "teacher_server.log").read_text()
    # the training run and its adapter
    assert json.loads((out / "train" / "status.json").read_text())["state"] == "completed"
    assert (out / "train" / "adapter_config.json").is_file()
    # the scorecard: base and tuned on the held-out pairs
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["adapter"] == str(out / "train") and report["rows"] >= 1
    for model in ("base", "tuned"):
        assert report[model]["rows"] == report["rows"] and report[model]["tokens_per_s"] > 0
        assert 0.0 <= report[model]["exact_match"] <= 1.0 and "json_valid" not in report[model]
    # the local teacher's one-off key is in no file
    for f in [*out.rglob("*"), *data.rglob("*")]:
        if f.is_file() and f.suffix not in (".safetensors", ".bin"):
            assert not re.search(rb"tb-[0-9a-f]{32}", f.read_bytes()), f


def test_a_stopped_distill_stops_its_training_child_and_is_aborted(tmp_path, tiny_qwen2):
    """A stop of the distill run during step train (SIGINT/SIGTERM or the distill folder's STOP file: the
    switch) reaches `tuneboard train` as a STOP file in its run folder; the child saves and ends with 130, and
    the step says aborted, not failed."""
    from backend.core.rundir import RunDir
    from backend.distill.pipeline import train
    from backend.distill.spec import validate_distill

    data, out = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    rows = [{"instruction": "Say it.", "input": f"chunk {i}", "output": f"answer {i}"} for i in range(8)]
    (data / "facts.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"facts": {"file_name": "facts.json"}}))
    out.mkdir()
    (out / "progress.json").write_text(json.dumps({"dataset": {"name": "facts", "cutoff_len": 64}}))
    spec = validate_distill({"documents": str(data), "task": "Say it.", "model_name_or_path": str(tiny_qwen2),
                             "cutoff_len": 128, "answer_tokens": 32, "chunk_overlap": 8, "dataset_name": "facts",
                             "dataset_dir": str(data), "output_dir": str(out), "steps": "train",
                             "train_args": {"max_steps": 500, "logging_steps": 1, "lora_rank": 4,
                                            "plot_loss": False, "save_strategy": "no"}})
    run_dir = RunDir(out)
    run_dir.start()
    try:
        assert train(spec, run_dir, stop=lambda: True) == 130
    finally:
        run_dir.close()
    child = json.loads((out / "train" / "status.json").read_text())
    assert child["state"] == "aborted" and child["exit_code"] == 130 and child["step"] < 500
    assert "tuneboard train was stopped" in (out / "running_log.txt").read_text()
