"""Distillation: documents + a teacher endpoint -> validated pairs -> a registered dataset -> fine-tune ->
a student-vs-teacher scorecard (`tuneboard distill SPEC.yaml [key=value ...]`, and the web UI's Distill tab).

This package's top level is light (no torch, no transformers, no datasets): the web UI imports it for the
spec keys, the file names of a distill run folder and the readers of its progress. The heavy steps live in
the submodules: documents (loading, chunking), teacher (the HTTP client), pipeline (generation), scorecard.

A distill run folder (output_dir) holds, written by the backend only:
    distill_spec.yaml   the resolved spec (it never holds an API key: the spec cannot carry one)
    status.json, running_log.txt   as a training run (backend.core.rundir)
    progress.json       counts (chunks, asked, accepted, rejected by reason), tokens used, ETA, the latest pairs
    cache/<hash>.json   one file per answered chunk (hash of chunk + task + teacher): a restart resumes
    rejected.jsonl      every rejected pair or chunk with its reason
    pairs.jsonl         every accepted pair (train and eval) with its chunk and document
    teacher_server.log  the local teacher's output (teacher: local)
    train/              the fine-tuning run (step train)
    distill_report.json the scorecard (step score)
"""
from __future__ import annotations

from pathlib import Path

from backend.core.atomic import read_json_dict
from backend.core.rundir import DISTILL_REPORT_FILE

SPEC_FILE = "distill_spec.yaml"
PROGRESS_FILE = "progress.json"
REJECTED_FILE = "rejected.jsonl"
PAIRS_FILE = "pairs.jsonl"
CACHE_DIRNAME = "cache"
REPORT_FILE = DISTILL_REPORT_FILE  # the scorecard; the Evaluate tab finds it by this name too
TEACHER_LOG = "teacher_server.log"
TRAIN_DIRNAME = "train"

# Why a pair (or a chunk) was not kept. The first five are the teacher's answer failing validation.
REASONS = ("not JSON", "schema error", "empty", "duplicate", "too long", "teacher error")
STEPS = ("generate", "train", "score")


class DistillError(ValueError):
    """A user's mistake or a dead end, said in one line (no traceback)."""


def student_prompt(task: str, chunk: str) -> str:
    """What the student sees: the alpaca row's instruction and input joined as backend.dataprep.data joins them."""
    return f"{task.strip()}\n{chunk}"


def read_progress(run_dir: str | Path | None) -> dict:
    """progress.json of a distill run ({} when missing or half-written: it is replaced atomically, so a
    reader only ever sees a whole file or none)."""
    if not run_dir:
        return {}
    return read_json_dict(Path(run_dir) / PROGRESS_FILE)


def read_report(run_dir: str | Path | None) -> dict:
    """distill_report.json ({} when missing)."""
    if not run_dir:
        return {}
    return read_json_dict(Path(run_dir) / REPORT_FILE)


SCORE_METRICS = ("json_valid", "schema_valid", "field_f1", "exact_match", "tokens_per_s", "rows")


def report_rows(report: dict) -> list[list]:
    """The scorecard as table rows [metric, base, tuned] (empty cells where a model was not scored)."""
    out = []
    for metric in SCORE_METRICS:
        values = [(report.get(k) or {}).get(metric) for k in ("base", "tuned")]
        if any(v is not None for v in values):
            out.append([metric] + ["" if v is None else v for v in values])
    return out
