"""preprocessing_num_workers: the forked tokenizer processes end, in a run that handles SIGTERM itself.

The run installs a SIGTERM handler that only sets a flag (backend.training.callbacks.StopSwitch); forked pool workers
inherited it, and a pool ended with terminate() (a `with Pool` block) SIGTERMs workers waiting on the queue
lock it holds: they swallowed the signal and the run hung (one rank of each 2-process run, and within ~15 pools
in the loop below). Each check runs in a subprocess with a timeout, so a regression fails instead of hanging.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LOOP = """
import signal
from backend.dataprep.preprocess import Stats, in_workers
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # what backend.training.callbacks.StopSwitch.install() does
def build(examples):
    return [{"x": e} for e in examples], Stats()
for i in range(100):
    rows, stats = in_workers(build, list(range(40)), 2)
    assert rows == [{"x": e} for e in range(40)] and stats.workers == 2, (i, rows, stats.workers)
print("pools done")
"""


def test_tokenizer_pools_end_under_a_swallowing_sigterm_handler():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("in_workers uses at most one process per CPU")
    try:
        proc = subprocess.run([sys.executable, "-c", LOOP], cwd=REPO, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a tokenizer pool never ended (a worker swallowed the pool's SIGTERM)")
    assert proc.returncode == 0 and "pools done" in proc.stdout, proc.stderr[-3000:]


def _train(model: Path, out: Path, workers: int) -> subprocess.CompletedProcess:
    args = [f"model_name_or_path={model}", f"output_dir={out}", "dataset=identity", "template=llama3",
            "cutoff_len=128", "max_steps=1", "lora_rank=4", "per_device_train_batch_size=2",
            f"preprocessing_num_workers={workers}", "preprocessing_batch_size=16",
            "overwrite_cache=true"]  # tokenized here, not loaded
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        return subprocess.run([sys.executable, "-m", "backend.cli", "train", *args], cwd="/tmp", env=env,
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`tuneboard train preprocessing_num_workers={workers}` did not end (hung tokenizer pool?)")


def _rows_line(out: Path) -> str:
    line = next(x for x in (out / "running_log.txt").read_text().splitlines() if "train rows:" in x)
    return line.split("train rows:", 1)[1]


@pytest.mark.slow
def test_a_run_with_two_tokenizer_processes_completes_with_the_rows_of_one(tiny_llama, tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("in_workers uses at most one process per CPU")
    runs = {n: (tmp_path / f"workers{n}", _train(tiny_llama, tmp_path / f"workers{n}", n)) for n in (2, 1)}
    for n, (out, proc) in runs.items():
        assert proc.returncode == 0, (n, proc.stdout[-3000:], proc.stderr[-3000:])
        status = json.loads((out / "status.json").read_text())
        assert status["state"] == "completed"
        # the rows tokenized, 16 at a time, reached the status the Train tab's card reads (all of them at the end)
        assert status["tokenizing"]["done"] == status["tokenizing"]["total"] > 16, status["tokenizing"]
    two, one = _rows_line(runs[2][0]), _rows_line(runs[1][0])
    assert two.endswith("tokenized in 2 processes"), two
    counts = re.compile(r"^(.*tokens, [\d,]+ trained)")
    assert counts.match(two).group(1) == counts.match(one).group(1), (two, one)
    seen = [json.loads((out / "status.json").read_text())["final_metrics"]["num_input_tokens_seen"]
            for out, _ in runs.values()]
    assert seen[0] == seen[1] > 0, seen
