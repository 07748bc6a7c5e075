"""The Train tab's pre-flight data check: the lint's summary for the run's data (backend/dataprep/lint.py), which
Start shows once per (data files, spec) before it starts: counts per severity, the worst findings in one line each,
and where to see them all with their rows (the Data tab's Check). Only errors and warnings about the data's rows
hold Start (a model-level one, such as the template auto picks for a model without one, is listed with them but
holds nothing alone: the Data tab's preview and the run log say it too); pressed again, it starts. What would stop
the run at once on this data (the lint's `refused`: the run's own loading of it failed, e.g. a mapped column no row
has, no usable row, a val_size that leaves no training rows) never starts: Start refuses it as it refuses a form
error (refusal). A lint that could not run for another reason (its tokenizer, a package) holds nothing.

The lint loads a tokenizer and the data stack, which this process never imports: `tuneboard lint --json --load-check
--max-rows MAX_ROWS` runs as a subprocess into <saves>/.cache/lint/<key>/, keyed by what it reads (the spec's data
keys, and each data file's state as the tokenized cache keys it: backend/core/tokenized.py), and its result there is
reused by every later Start of the same data. The first MAX_ROWS rows of each dataset are linted, so a big set costs
a Start no more than a small one (its load check is skipped where it would read all of a bigger set); a Start waits
at most WAIT_S for a lint that has not finished (it finishes in the background, for the next press). One lint runs
at a time: a newer one stops the older."""
from __future__ import annotations

import hashlib
import html
import json
import os
import shutil
import signal
import subprocess
import threading
from collections import Counter
from pathlib import Path

from backend.core import paths
from backend.core.atomic import read_json_dict, write_json_atomic, write_text_atomic
from backend.core.dataset_info import DatasetError, read_dataset_info, resolve_dataset_dir
from backend.core.tokenized import data_files, file_state
from webui import jobs
from webui.i18n import has, tr

MAX_ROWS = 2000  # rows of each dataset the pre-flight lints
WAIT_S = 15.0  # the longest a Start waits for a lint that is still running
KEEP = 16  # results kept under <saves>/.cache/lint (the newest)
WORST = 3  # findings named in the summary, worst first
HOLDS = ("error", "warning")  # the severities that hold Start once
MODEL = "-"  # the lint's dataset of a finding about the model (its template), not about rows
RESULT, SPEC, LOG = "lint.json", "spec.yaml", "lint_output.log"
# what the lint reads of a spec, besides the data files (the rest of a spec does not change its findings)
DATA_KEYS = ("stage", "dataset", "eval_dataset", "val_size", "seed", "model_name_or_path", "template", "cutoff_len",
             "train_on_prompt", "mask_history", "identity_name", "identity_author", "default_system",
             "new_special_tokens", "enable_thinking", "max_samples", "mix_strategy", "interleave_probs", "streaming")
# the form field a refusal of the run's data is shown beside: the spec key its message starts with, else `dataset`
REFUSAL_FIELDS = ("val_size", "max_samples", "mix_strategy", "interleave_probs", "eval_dataset")

_running: dict[str, tuple[subprocess.Popen, threading.Event]] = {}
_lock = threading.Lock()


def root() -> Path:
    return paths.saves_dir() / ".cache" / "lint"


def key(spec) -> str:
    """What the lint's findings depend on: the spec's data keys, the dataset folder, each dataset's entry and its
    files' state (size and content hash), and the row cap."""
    parts: dict = {k: getattr(spec, k, None) for k in DATA_KEYS}
    parts["max_rows"] = MAX_ROWS
    try:
        folder = resolve_dataset_dir(spec.resolved_dataset_dir())
        parts["dataset_dir"] = str(folder)
        raw = read_dataset_info(folder).raw
        for name in dict.fromkeys(spec.dataset_names + spec.eval_dataset_names):
            entry = raw.get(name)
            parts[f"entry {name}"] = entry
            files = data_files(entry, folder) if isinstance(entry, dict) else None
            parts[f"files {name}"] = [[str(p), *file_state(p)] for p in files or []]
    except (DatasetError, OSError, KeyError) as exc:  # the lint says what is wrong: the key only has to differ
        parts["unreadable"] = str(exc)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def result(k: str) -> dict | None:
    """The finished lint's JSON for key `k` ({"error": ...} when it could not lint), or None (none yet)."""
    return read_json_dict(root() / k / RESULT) or None


def start(spec_yaml: str, k: str) -> None:
    """Launches the lint of `spec_yaml` for key `k` unless it runs already; stops any other that runs."""
    folder = root() / k
    with _lock:
        if k in _running and _running[k][0].poll() is None:
            return
        for proc, _ in _running.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except OSError:
                    pass
        _prune()
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / SPEC, spec_yaml)
        argv = jobs.tuneboard_argv() + ["lint", str(folder / SPEC), "--json", "--max-rows", str(MAX_ROWS),
                                          "--load-check"]
        with open(folder / LOG, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(paths.REPO_ROOT), close_fds=True)
        done = threading.Event()
        _running[k] = (proc, done)
    threading.Thread(target=_finish, args=(proc, folder, done), name=f"lint-{proc.pid}", daemon=True).start()


def _finish(proc: subprocess.Popen, folder: Path, done: threading.Event) -> None:
    """Reaps the lint and writes its result: the JSON line it printed, or its last lines as the error (nothing
    when it was stopped for a newer one)."""
    code = proc.wait()
    try:
        lines = (folder / LOG).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    found = None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                found = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if found is None and code >= 0:
        found = {"error": " ".join(lines[-3:]).strip() or f"exit {code}"}
    if isinstance(found, dict):
        write_json_atomic(folder / RESULT, found)
    done.set()


def _prune() -> None:
    if not root().is_dir():
        return
    folders = sorted((d for d in root().iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
    for old in folders[KEEP:]:
        if old.name not in _running:
            shutil.rmtree(old, ignore_errors=True)


def before_start(spec, wait_s: float | None = None) -> tuple[str, dict | None]:
    """(key, the lint's result or None): the cached result of this data, else the lint started (or already running)
    and waited for up to `wait_s` (WAIT_S by default)."""
    wait_s = WAIT_S if wait_s is None else wait_s
    k = key(spec)
    found = result(k)
    if found is None:
        start(spec.to_yaml(), k)
        with _lock:
            done = _running[k][1] if k in _running else None
        if done is not None:
            done.wait(wait_s)
        found = result(k)
    return k, found


def refusal(found: dict | None, lang: str = "en") -> tuple[str, str] | None:
    """(form field, message) when the lint found what would stop the run at once on this data (its `refused`: the
    run's own loading failed), else None. Start refuses it like a form error: nothing is launched."""
    refused = (found or {}).get("refused")
    if not refused:
        return None
    refused = str(refused)
    field = next((f for f in REFUSAL_FIELDS if refused.startswith(f)), "dataset")
    return field, tr(lang, "pf.lint_refused", error=refused[:500])  # plain text, as validate's


def summary_md(found: dict | None, lang: str = "en") -> str:
    """The pre-flight's lines for a lint result that holds Start (errors or warnings about rows), else ""."""
    findings = (found or {}).get("findings") or []
    worst = [f for f in findings if f.get("severity") in HOLDS]
    if not any(f.get("dataset") != MODEL for f in worst):
        return ""
    by = Counter(f.get("severity") for f in findings)
    rows = found.get("max_rows")
    text = tr(lang, "pf.lint", n=len(findings), errors=by["error"], warnings=by["warning"], infos=by["info"],
              datasets=html.escape(", ".join(found.get("datasets") or {})))
    if rows:
        text += " " + tr(lang, "pf.lint_rows", rows=rows)
    icon = {"error": "✖", "warning": "⚠"}
    lines = []
    for f in worst[:WORST]:
        check, summary = finding_words(f, lang)
        lines.append(f"{icon[f['severity']]} <b>{html.escape(check)}</b>: {html.escape(summary)}")
    return f'<span class="tb-mem-warn" id="train-data-check">{text}<br>{"<br>".join(lines)}<br>' \
           f'{tr(lang, "pf.lint_more")}</span>'


def finding_words(f: dict, lang: str = "en") -> tuple[str, str]:
    """(check, what it found) of one lint finding in `lang`, from the lint JSON's fields: the check's name by its id
    (locale key `lint.<check>`), and its summary by the id and severity (`lint.msg.<check>`, the row count as {n}).
    English keeps the lint's own message, figures and all (its shares, cutoff_len, scripts are in no field of their
    own); so does a check without a translated summary (the template check: its message is the template picker's)."""
    check, message = str(f.get("check")), str(f.get("message"))
    name = tr(lang, f"lint.{check}") if has(f"lint.{check}") else check
    key = f"lint.msg.{check}" + ("_missing" if check == "pt_eos" and f.get("severity") == "error" else "")
    if lang in (None, "en") or not has(key):
        return name, message
    return name, tr(lang, key, n=f.get("count", len(f.get("rows") or [])))


def pending_md(found: dict | None, lang: str = "en") -> str:
    """What the started message adds about the check: not finished in time, or failed ("" otherwise)."""
    if found is None:
        return " " + tr(lang, "pf.lint_pending", s=int(WAIT_S))
    if "error" in found:
        return " " + tr(lang, "pf.lint_failed", error=html.escape(str(found["error"])[:300]))
    return ""
