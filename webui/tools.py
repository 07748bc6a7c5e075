"""Export and eval jobs: `tuneboard export|eval tool_spec.yaml` subprocesses, launched and stopped like
training runs (webui/jobs.py: argv list, new session, output to process_output.log, pid in launch.json),
and what their files say (progress, outcome, report, metrics, predictions) as plain functions.

Each job gets a folder saves/.tools/<kind>-<time>/ (hidden: it is not a training run, so the Runs tab, the
adapter picker and the re-attach on page load never mistake it for one). An eval writes its output_dir
files (status.json, eval_results.json, generated_predictions.jsonl) into that same folder; an export
writes into the export_dir the user chose.

What a tab needs to pick a job up again after a page reload or a UI restart is on disk too: the job's
tool_spec.yaml (export), plan.json (eval: its parts and which were launched) and an ABORTED marker once
the user pressed Abort. `find_job` says which job a freshly loaded page re-attaches to (see its rule).
"""
from __future__ import annotations

import functools
import html
import json
import re
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

from backend.core import paths
from backend.core.atomic import write_text_atomic
from backend.core.rundir import EVAL_RESULTS_FILE, EXPORT_REPORT_FILE, PREDICTIONS_FILE, stamp, unique_dir
from webui import jobs
from backend.core.rundir import reward_model_folder
from webui.choices import dataset_info
from webui.i18n import has, tr
from webui.live import state_word

TOOLS_DIRNAME = ".tools"
TOOL_SPEC = "tool_spec.yaml"
EXPORT_REPORT = EXPORT_REPORT_FILE
EVAL_RESULTS = EVAL_RESULTS_FILE
PREDICTIONS = PREDICTIONS_FILE
PLAN_FILE = "plan.json"
ABORTED_FILE = "ABORTED"
ATTACH_WINDOW_S = 3600.0  # a job that ended less than this ago is still shown after a reload

EXPORT_STEP = re.compile(r"^\[export (\d+)/(\d+)\]\s*(.*)$")
CHECK_LINE = re.compile(r"^\s+(ok|FAIL)\s+([^:]+):\s*(.*)$")


# ---------------------------------------------------------------- launching and stopping

def new_job_dir(kind: str, root: Path | None = None, now: datetime | None = None) -> Path:
    """saves/.tools/<kind>-<time>, unique."""
    return unique_dir(Path(root or paths.saves_dir()) / TOOLS_DIRNAME / f"{kind}-{stamp(now)}")


def tool_argv(command: str, spec_path: str | Path) -> list[str]:
    """`tuneboard export|eval SPEC.yaml` as an argv list (also what the tab shows as the command)."""
    return jobs.tuneboard_argv() + [command, str(spec_path)]


def start(command: str, job_dir: str | Path, spec_yaml: str) -> int:
    """Writes job_dir/tool_spec.yaml and launches `tuneboard <command>` on it in its own session.
    Returns the pid."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    spec_path = job_dir / TOOL_SPEC
    write_text_atomic(spec_path, spec_yaml)
    return jobs.launch(job_dir, tool_argv(command, spec_path))


def alive(job_dir: str | Path | None) -> bool:
    if not job_dir:
        return False
    rec = jobs.read_json(Path(job_dir) / jobs.LAUNCH_FILE)
    return jobs.pid_alive(rec.get("pid"), rec.get("launched_at"))


def stop(job_dir: str | Path | None, grace_s: float = 5.0, wait: bool = False) -> bool:
    """SIGTERM to the job's process group now, SIGKILL after `grace_s` if it is still there (an export
    or eval has nothing worth saving, so there is no wait for the STOP file). Returns False if nothing ran.
    The STOP file is still written first: it tells the launcher's watcher this end was asked for, so a job
    that ends without a final status of its own (an export keeps none) is marked aborted, not failed."""
    if not alive(job_dir):
        return False
    jobs.request_stop(job_dir)
    rec = jobs.read_json(Path(job_dir) / jobs.LAUNCH_FILE)
    args = (rec["pid"], rec.get("launched_at"), 0.0, grace_s)
    if wait:
        jobs._escalate(*args)
    else:
        threading.Thread(target=jobs._escalate, args=args, name=f"stop-{rec['pid']}", daemon=True).start()
    return True


def mark_aborted(job_dir: str | Path) -> None:
    """The ABORTED marker: the user stopped this job (read back by `was_aborted`, also after a reload)."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(job_dir / ABORTED_FILE, f"aborted at {datetime.now().isoformat()}\n")


def was_aborted(job_dir: str | Path | None) -> bool:
    return bool(job_dir) and (Path(job_dir) / ABORTED_FILE).exists()


def write_plan(job_dir: str | Path, plan: dict) -> None:
    """job_dir/plan.json (atomically): what an eval tab needs to rebuild its state (parts, spec)."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(job_dir / PLAN_FILE, json.dumps(plan, indent=1))


def read_plan(job_dir: str | Path | None) -> dict:
    return jobs.read_json(Path(job_dir) / PLAN_FILE) if job_dir else {}


def read_tool_spec(job_dir: str | Path | None) -> dict:
    """The job's tool_spec.yaml as a dict ({} when missing or unreadable)."""
    if not job_dir:
        return {}
    try:
        value = yaml.safe_load((Path(job_dir) / TOOL_SPEC).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------- finding a job again after a reload

def job_dirs(kind: str, root: Path | None = None) -> list[Path]:
    """saves/.tools/<kind>-<time>[-n] folders, newest first (by the time in the name, then n)."""
    base = Path(root or paths.saves_dir()) / TOOLS_DIRNAME
    pattern = re.compile(rf"^{re.escape(kind)}-(\d{{8}}-\d{{6}})(?:-(\d+))?$")
    found = []
    if base.is_dir():
        for d in base.iterdir():
            m = pattern.match(d.name)
            if m and d.is_dir():
                found.append(((m.group(1), int(m.group(2) or 1)), d))
    return [d for _, d in sorted(found, reverse=True)]


def job_alive(job_dir: str | Path) -> bool:
    """Any process of the job (the export, or any eval part) still running."""
    job_dir = Path(job_dir)
    return alive(job_dir) or any(alive(d) for d in job_dir.iterdir() if d.is_dir())


def last_change(job_dir: str | Path) -> float:
    """Newest modification time of the job folder's files and of its parts' files (0 when empty)."""
    newest = 0.0
    job_dir = Path(job_dir)
    for d in [job_dir] + [p for p in job_dir.iterdir() if p.is_dir()]:
        for f in d.iterdir():
            try:
                newest = max(newest, f.stat().st_mtime)
            except OSError:
                continue
    return newest


def find_job(kind: str, root: Path | None = None, now: float | None = None,
             window_s: float = ATTACH_WINDOW_S) -> str | None:
    """The job a freshly loaded page re-attaches to, or None. Rule: only the newest <kind> job (by the
    time in its folder name) is considered; it is taken when one of its processes is alive, or when its
    files last changed less than `window_s` ago (it ended recently: a reload right after the end still
    shows the result; an eval between two parts counts too, and its next part then starts). An older
    job is never picked instead: the tab shows what was done last, or nothing."""
    dirs = job_dirs(kind, root)
    if not dirs:
        return None
    job = dirs[0]
    try:
        if job_alive(job):
            return str(job)
        return str(job) if last_change(job) >= (now or time.time()) - window_s else None
    except OSError:  # removed while we looked
        return None


def clean_line(line: str) -> str:
    """A progress bar rewrites its line with carriage returns: keep what the terminal would show."""
    return line.rsplit("\r", 1)[-1].rstrip()


# ---------------------------------------------------------------- export

def export_progress(lines: list[str]) -> tuple[int, int, str]:
    """(k, n, step message) of the newest `[export k/n] message` line; (0, 6, "") before the first."""
    for line in reversed(lines):
        m = EXPORT_STEP.match(clean_line(line))
        if m:
            return int(m.group(1)), int(m.group(2)), m.group(3)
    return 0, 6, ""


def export_outcome(lines: list[str]) -> tuple[str | None, str]:
    """("passed" | "failed" | None, the line that says so). The CLI's last word is one of
    `export PASSED: ...`, `export FAILED...`."""
    for line in reversed(lines):
        text = clean_line(line)
        if text.startswith("export PASSED"):
            return "passed", text
        if text.startswith("export FAILED"):
            return "failed", text
    return None, ""


def export_outcome_words(outcome: str | None, line: str, lang: str = "en") -> str:
    """export_outcome's line in `lang`: its `export PASSED` / `export FAILED` word translated (`export.passed`,
    `export.failed`), what follows it as the export wrote it."""
    if outcome not in ("passed", "failed") or lang in (None, "en"):
        return line
    detail = line.removeprefix(f"export {outcome.upper()}").lstrip(" :")
    return tr(lang, f"export.{outcome}", detail=detail)


def read_report(export_dir: str | Path | None) -> dict:
    return jobs.read_json(Path(export_dir) / EXPORT_REPORT) if export_dir else {}


def checks_rows(report: dict, lines: list[str] | None = None, lang: str = "en") -> list[list]:
    """The report's checks as table rows [check, result, detail, figures]; from the `ok/FAIL` log lines
    when there is no report (a run that failed before writing it). The check's name (by its id: locale key
    `export.check.<name>`) and its result in `lang`; the detail is the export's own text."""
    rows = []
    for c in report.get("checks") or []:
        # a check's figures are its other keys (backend/exporting/export.py: max_abs_diff, tolerance, identical, ...)
        figures = c.get("figures") if isinstance(c.get("figures"), dict) else \
            {k: v for k, v in c.items() if k not in ("name", "ok", "detail", "figures")}
        fig = ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        rows.append([check_name(c.get("name", ""), lang), tr(lang, "export.ok" if c.get("ok") else "export.fail"),
                     c.get("detail", ""), fig])
    if not rows:
        for line in lines or []:
            m = CHECK_LINE.match(clean_line(line))
            if m:
                result = tr(lang, "export.ok" if m.group(1) == "ok" else "export.fail")
                rows.append([check_name(m.group(2), lang), result, m.group(3), ""])
    return rows


def check_name(name: str, lang: str = "en") -> str:
    """An export check's name in `lang` (its id where the locale has none: a check added after the translations)."""
    return tr(lang, f"export.check.{name}") if has(f"export.check.{name}") else name


def export_step_words(k: int, step: str, lang: str = "en") -> str:
    """What export step `k` does, in `lang`: English keeps the export's own line (`step`, with its model, folder,
    format); another language names the step by its number (locale key `export.step.<k>`; the log has the line)."""
    if lang in (None, "en") or not has(f"export.step.{k}"):
        return step
    return tr(lang, f"export.step.{k}")


def _fmt(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------- eval

def read_results(out_dir: str | Path | None) -> dict:
    return jobs.read_json(Path(out_dir) / EVAL_RESULTS) if out_dir else {}


METRIC_ORDER = ("eval_accuracy", "eval_margin", "eval_rewards/chosen", "eval_rewards/rejected",  # a reward model
                "eval_loss", "perplexity", "predict_bleu-4", "predict_rouge-1", "predict_rouge-2",
                "predict_rouge-l", "predict_exact_match", "predict_json_valid", "predict_field_precision",
                "predict_field_recall", "predict_field_f1")
NOT_METRICS = ("rows", "seconds", "eval_tokens", "predict_rows")


def metric_names(results: list[dict]) -> list[str]:
    """Numeric metrics present in any of the results, known ones first in a fixed order."""
    present = []
    for r in results:
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS \
                    and k not in present:
                present.append(k)
    known = [k for k in METRIC_ORDER if k in present]
    return known + [k for k in present if k not in known]


def is_reward_model(model: str | None, adapter: str | None) -> bool:
    """Whether the top bar's model (+ adapter) is a reward model (stage rm's output), from its JSON / YAML
    files (backend.core.rundir.is_reward_model_dir: the same check the backend's eval and export use)."""

    return reward_model_folder(model, adapter) is not None


def ranking_datasets(dataset_dir: str | Path | None = None) -> list[str]:
    """The datasets of dataset_info.json with chosen / rejected pairs ("ranking": true): what a reward model
    is evaluated on."""

    return [n for n, e in dataset_info(dataset_dir).items() if isinstance(e, dict) and e.get("ranking") is True]


def pair_score(row: dict) -> float:
    """A scored pair's margin (chosen score - rejected score); worst first = most wrongly ranked first."""
    v = row.get("margin")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def read_predictions(out_dir: str | Path | None) -> list[dict]:
    """Rows of generated_predictions.jsonl (a malformed line is skipped: the file is written as it goes)."""
    if not out_dir:
        return []
    path = Path(out_dir) / PREDICTIONS
    rows = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except FileNotFoundError:
        return []
    return rows


@functools.lru_cache(maxsize=1)
def _turn_markers() -> tuple[tuple[str, str, str], ...]:
    """(user prefix, user suffix, assistant prefix) of each template in templates/, the literal text around
    {content} (up to a placeholder such as {eos_token}), longest user prefix first."""
    out = []
    for path in paths.TEMPLATES_DIR.glob("*.yaml"):
        try:
            t = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            continue
        user, assistant = str(t.get("user") or ""), str(t.get("assistant_prefix") or "")
        if "{content}" not in user:
            continue
        before, after = user.split("{content}", 1)
        before = before.split("}")[-1]  # the literal part next to {content}
        if len(before.strip()) < 2:
            continue
        out.append((before, after.split("{")[0], assistant.split("{")[0]))
    return tuple(sorted(out, key=lambda m: -len(m[0])))


_TRAILING_TOKENS = re.compile(r"(\s*(<\|[^|>]*\|>|</s>|<[a-z_]+>))+\s*$")


def last_user_turn(prompt) -> str:
    """The user's last message in a rendered eval prompt (the table shows the question, not the start of a
    system prompt every row shares), found with the turn markers of the templates; the prompt's end when
    no template's markers fit."""
    text = "" if prompt is None else str(prompt)
    tail = text.rstrip()
    for before, after, assistant in _turn_markers():
        if before not in text or (assistant.strip() and not tail.endswith(assistant.strip())):
            continue
        start = text.rfind(before) + len(before)
        end = text.find(after, start) if after.strip() else -1
        if end < 0:
            end = text.rfind(assistant.strip()) if assistant.strip() else len(text)
        question = _TRAILING_TOKENS.sub("", text[start:max(end, start)]).strip()
        if question:
            return question
    return text[-300:].strip()


ROW_SCORE = "rouge-l"  # the per-row score the table sorts by (0..100)


def row_score(row: dict) -> float:
    v = row.get(ROW_SCORE)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def short(text, limit: int = 400) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ---------------------------------------------------------------- a progress block shared by both tabs

def progress_html(state: str, done: int, total: int | None, text: str = "", lang: str = "en") -> str:
    """Badge + bar + one line, with data-state/data-step for tests (same look as the training bar)."""

    pct = round(100 * min(done / total, 1.0), 1) if total else 0.0
    cls = {"running": "running", "starting": "running", "passed": "ok", "completed": "ok",
           "aborted": "warn", "failed": "bad"}.get(state, "idle")
    of = f"{done} / {total}" if total else f"{done}"
    return (f'<div class="tb-progress" data-state="{html.escape(state)}" data-step="{done}">'
            f'<div class="tb-progress-head"><span class="tb-badge tb-{cls}">{html.escape(state_word(state, lang))}'
            '</span>'
            f'<span class="tb-run-name">{html.escape(text)}</span></div>'
            f'<div class="tb-bar"><div class="tb-bar-fill" style="width:{pct}%"></div></div>'
            f'<div class="tb-stats"><span><b>{of}</b></span><span>{pct}%</span></div></div>')
