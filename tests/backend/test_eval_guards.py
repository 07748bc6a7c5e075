"""`tuneboard eval` never loses a record: an output_dir that holds a training run is refused in one line (its
status.json, logs and every other file left byte for byte as they were, whatever the mode and even with
overwrite_output_dir), and a judge that answers no request fails the eval in one line with the first error
(as distill does when its teacher answers nothing), while a judge that fails only some rows still completes,
with the count of failures. Real subprocesses of the CLI, a real tiny training run, a closed port and a tiny
local HTTP server as the judge."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from backend.core.paths import REPO_ROOT
from backend.core.rundir import EVAL_RESULTS_FILE, JUDGE_FILE, LOG_FILE, STATUS_FILE
from backend.evaluation.judge import JudgeSettings, judge_pairs

TUNEBOARD = [sys.executable, "-m", "backend.cli"]
ROWS = [{"instruction": "Say something nice.", "output": "A good day to you."},
        {"instruction": "How is the weather?", "output": "Sunny and good."},
        {"instruction": "Name a colour.", "output": "Blue is a good colour."}]


def _files(folder: Path) -> dict[str, str]:
    """Every file under `folder` -> the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _closed_port_url() -> str:
    """A local URL nothing listens on (the port was free a moment ago): connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# ------------------------------------------------------------------------ 1. a training run's folder
def test_eval_into_a_training_run_is_refused_and_the_run_is_left_as_it_was(lora_checkpoints_run, tiny_qwen2, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lora_checkpoints_run, run)
    before = _files(run)
    status = json.loads((run / STATUS_FILE).read_text())
    assert status["state"] == "completed" and "train_loss" in status["final_metrics"]  # a real training record
    modes = {"parts": [], "overwrite": ["overwrite_output_dir=true"], "checkpoints": ["checkpoints=all"],
             "judge": ["do_judge=true", "judge_url=http://127.0.0.1:9/v1", "judge_model=m"]}
    for name, extra in modes.items():
        proc = subprocess.run(TUNEBOARD + ["eval", f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={run}",
                                           "dataset=identity", "max_samples=2", "max_new_tokens=2",
                                           f"output_dir={run}", *extra],
                              cwd="/tmp", capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 1, (name, output[-3000:])
        lines = [line for line in output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: output_dir {run} holds a training run"), (name, output)
        assert "leave output_dir out" in lines[0] and "Traceback" not in output
        assert _files(run) == before, name  # status.json, trainer_log.jsonl, running_log.txt, ... untouched

    # an eval's own folder is no training run: the same eval again there (overwrite_output_dir) is not refused
    out = tmp_path / "eval"
    for extra in ([], ["overwrite_output_dir=true"]):
        proc = subprocess.run(TUNEBOARD + ["eval", f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={run}",
                                           "dataset=identity", "max_samples=2", "max_new_tokens=2", "do_eval=true",
                                           f"output_dir={out}", *extra],
                              cwd="/tmp", capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len((out / LOG_FILE).read_text().splitlines()) == 2  # one eval_loss line per eval
    assert _files(run) == before


# ------------------------------------------------------------------------ 2. a judge that answers nothing
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval_guards")
    (root / "rows.json").write_text(json.dumps(ROWS))
    (root / "dataset_info.json").write_text(json.dumps({"judged": {"file_name": "rows.json"}}))
    return root


def _judge_eval(tiny_llama, data: Path, out: Path, url: str) -> tuple[subprocess.CompletedProcess, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEBOARD_TEACHER")}
    proc = subprocess.run(TUNEBOARD + ["eval", f"model_name_or_path={tiny_llama}", "template=llama3",
                                       f"dataset_dir={data}", "dataset=judged", "eval_dataset=judged", f"output_dir={out}",
                                       "do_judge=true", "judge_against=reference", "max_new_tokens=2",
                                       f"judge_url={url}", "judge_model=judge-model", "judge_api_key_env="],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    return proc, proc.stdout + proc.stderr


def test_a_judge_that_answers_no_request_fails_the_eval_in_one_line(tiny_llama, data, tmp_path):
    url = _closed_port_url()
    out = tmp_path / "judged"
    proc, output = _judge_eval(tiny_llama, data, out, url)
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output
    failed = [line for line in output.splitlines() if "FAILED" in line]
    assert len(failed) == 1, output[-3000:]
    assert "answered no request" in failed[0] and "3 of 3 rows failed" in failed[0]
    assert "first error: cannot connect to" in failed[0]
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1 and "answered no request" in status["error"]
    report = json.loads((out / JUDGE_FILE).read_text())  # the answers are kept all the same
    assert report["judged"] == 0 and report["failed"] == 3 and report["answered"] == 0 and len(report["per_row"]) == 3
    results = json.loads((out / EVAL_RESULTS_FILE).read_text())
    assert "answered no request" in results["judge_error"] and results["judge_failed"] == 3


class _Judge:
    """A judge that answers `Verdict: A` except for the rows whose conversation holds `fail_on` (HTTP 500)."""

    def __init__(self, fail_on: str):
        fail, self.requests = fail_on, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                owner.requests.append(body)
                if fail in body["messages"][-1]["content"]:
                    status, reply = 500, {"error": {"message": "judge overloaded"}}
                else:
                    status, reply = 200, {"id": "x", "object": "chat.completion", "model": body.get("model"),
                                          "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                              "role": "assistant", "content": "A is better.\nVerdict: A"}}]}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_judge_that_fails_some_rows_still_completes_with_the_count(tiny_llama, data, tmp_path):
    judge = _Judge(fail_on="Name a colour.")
    try:
        out = tmp_path / "partial"
        proc, output = _judge_eval(tiny_llama, data, out, judge.url)
    finally:
        judge.stop()
    assert proc.returncode == 0, output[-3000:]
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["state"] == "completed"
    assert any("1 rows failed at the judge" in w for w in status["warnings"]), status["warnings"]
    report = json.loads((out / JUDGE_FILE).read_text())
    assert report["judged"] == 2 and report["failed"] == 1 and not report["complete"] and not report["error"]
    assert "HTTP 500" in report["first_error"]
    results = json.loads((out / EVAL_RESULTS_FILE).read_text())
    assert results["judge_failed"] == 1 and results["judge_judged"] == 2 and "judge_error" not in results


def test_judging_stops_once_the_judge_has_answered_none_of_the_first_rows(tmp_path):
    """As distill's teacher: max(3, concurrency) rows failed and none answered end the judging; the rest is not
    asked, the report says why with the first error."""
    prompts = [[{"role": "user", "content": f"Question {i}?"}] for i in range(8)]
    settings = JudgeSettings(url=_closed_port_url(), model="m", api_key_env=None, cache_dir=tmp_path / "cache",
                             max_retries=0, backoff=0.0, concurrency=1)
    report = judge_pairs(prompts, ["a"] * 8, ["b"] * 8, settings, log=lambda m: None)
    assert report["judged"] == 0 and report["failed"] == 3 and report["requests"] == 3 and report["answered"] == 0
    assert "answered none of the first 3" in report["stopped"] and "cannot connect to" in report["stopped"]
    assert report["first_error"].startswith("cannot connect to")


def test_training_keys_given_to_eval_are_refused_saying_what_eval_does(tiny_qwen2, tmp_path, capsys):
    """`tuneboard eval SPEC eval_metric=judge judge_url=...` ran eval and predict and asked no judge: a key eval never
    reads, given on its command line away from its default, is refused before anything runs, naming the key and what
    eval does instead (the counterpart of train refusing do_judge, tasks, checkpoints). The same keys in a recipe file
    are its training run's: the recipe still validates for eval."""
    from backend.evaluation.evaluate import main

    out = tmp_path / "eval"
    base = [f"model_name_or_path={tiny_qwen2}", "dataset=identity", f"output_dir={out}"]
    for given, key, says in ((["eval_metric=judge", "judge_url=http://127.0.0.1:9/v1", "judge_model=m"], "eval_metric",
                              "set do_judge=true"),
                             (["eval_samples=3", "load_best_model_at_end=true"], "eval_samples", "every held-out row"),
                             (["--learning_rate=0.1"], "learning_rate", "trains nothing")):
        assert main(base + given) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {key}: ") and says in err[0], err
    assert not out.exists()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_qwen2}\ndataset: identity\nlearning_rate: 0.1\n")
    from backend.core.eval_rules import eval_command_errors
    from backend.core.spec import RunSpec, load_spec

    assert load_spec(recipe).learning_rate == 0.1
    assert eval_command_errors({"eval_metric": None, "learning_rate": RunSpec.model_fields["learning_rate"].default},
                               RunSpec.model_fields) == []  # the defaults change nothing: not refused
