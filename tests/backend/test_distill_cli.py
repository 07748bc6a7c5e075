"""tuneboard distill through the real CLI (slow tier): the whole loop with the real `tuneboard api` as the local
teacher (documents of several kinds -> pairs -> a registered dataset -> a few LoRA steps -> the scorecard), and a
kill -9 in the middle of generation followed by a rerun that ends with the dataset of an uninterrupted run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from fake_teacher import SCHEMA, TASK, FakeTeacher, make_docs, no_key_under
from test_distill import generate

from backend.distill import CACHE_DIRNAME, REPORT_FILE, read_progress
from backend.paths import DEFAULT_MODEL_ID

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


def test_kill_9_mid_generation_then_rerun_gives_the_uninterrupted_dataset(tmp_path, tiny_qwen2, monkeypatch):
    key = "sk-kill-test-secret-987"
    teacher = FakeTeacher("slow", key=key, delay=0.5).start()
    try:
        docs = make_docs(tmp_path / "docs")

        def args(name: str) -> list[str]:
            return [f"documents={docs}", "text_column=body", f"task={TASK}", f"json_schema={json.dumps(SCHEMA)}",
                    f"teacher={teacher.url}", "teacher_model=fake", "teacher_api_key_env=KILL_TEST_KEY",
                    f"model_name_or_path={tiny_qwen2}", "cutoff_len=128", "answer_tokens=40", "concurrency=1",
                    "eval_ratio=0.3", "dataset_name=facts", f"dataset_dir={tmp_path / name / 'data'}",
                    f"output_dir={tmp_path / name / 'run'}"]

        env = {**os.environ, "KILL_TEST_KEY": key}
        cache = tmp_path / "killed" / "run" / CACHE_DIRNAME
        proc = subprocess.Popen(TUNEBOARD + ["distill", *args("killed")], cwd="/tmp", env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and len(list(cache.glob("*.json"))) < 2 and proc.poll() is None:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(1.0)  # a request already on the wire reaches the fake teacher's list before we count
        answered = len(list(cache.glob("*.json")))
        assert 2 <= answered < 6, "the kill came too late to test a resume"
        assert not (tmp_path / "killed" / "data" / "facts.json").exists()
        asked_before = len(teacher.requests)

        rerun = distill(*args("killed"), env={"KILL_TEST_KEY": key})
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        assert f"{answered} chunks answered from the cache" in rerun.stdout
        assert len(teacher.requests) - asked_before == 6 - answered  # only the rest was asked

        from backend.spec import parse_overrides

        monkeypatch.setenv("KILL_TEST_KEY", key)
        assert generate(parse_overrides(args("whole")))[0] == 0  # the uninterrupted run (in-process: faster)
        for name in ("facts.json", "facts_eval.json"):
            assert (tmp_path / "killed" / "data" / name).read_bytes() == (tmp_path / "whole" / "data" / name).read_bytes()
        no_key_under(tmp_path / "killed", tmp_path / "whole", key=key)
        assert key not in rerun.stdout + rerun.stderr
    finally:
        teacher.stop()
