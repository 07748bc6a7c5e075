"""Turns what the tailer read from a run directory into what the live view shows: plot frames, a
progress bar, a status line. Pure functions of (records, status), so they are tested without a browser."""
from __future__ import annotations

import html
import math
import re
from datetime import datetime

import pandas as pd

from backend.core.curves import smooth
from backend.core.paths import DEFAULT_MODEL_ID
from backend.core.rundir import PHASE_LOADING, PHASE_SAVING, PHASE_TRAINING
from backend.stages import STAGES, get_stage, matches
from webui.i18n import has, tr
import json
from pathlib import Path
from backend.core.rundir import COMPLETIONS_FILE

MAX_POINTS = 2000  # a LinePlot value is sent whole each tick: thin long runs instead of sending 100k points


def _num(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _thin(df: pd.DataFrame) -> pd.DataFrame:
    if len(df) <= MAX_POINTS:
        return df
    stride = math.ceil(len(df) / MAX_POINTS)
    return pd.concat([df.iloc[::stride], df.iloc[[-1]]]).drop_duplicates()


SIGNIFICANT = 4  # digits a plotted value keeps: the plot's hover text and labels read "2.78", not "2.779534"


def readable(value: float) -> float:
    """A value rounded to SIGNIFICANT significant digits (the files keep the full value)."""
    return float(f"{value:.{SIGNIFICANT}g}")


def _long_frame(rows: list[tuple[int, float, str]]) -> pd.DataFrame:
    """(step, value, series) rows -> a frame with numeric columns even when empty: an untyped empty frame
    concatenated with others turns `value` into objects, and the plot then draws it as categories (a y
    axis sorted as text, upside down). Steps are integers (the axis reads 1, not 1.000000), values readable."""
    return pd.DataFrame({"step": pd.Series([int(r[0]) for r in rows], dtype="int64"),
                         "value": pd.Series([readable(r[1]) for r in rows], dtype="float64"),
                         "series": pd.Series([r[2] for r in rows], dtype="str")})


def series_name(key: str, lang: str = "en") -> str:
    """The legend name of one of the loss plot's own series (loss, smoothed, eval_loss) in `lang`; metric keys
    logged by a stage (rewards/chosen, ...) are the trainer's own names and stay as they are."""
    return tr(lang, f"plot.series_{key}")


def loss_frame(records: list[dict], log_scale: bool = False, run_label: str | None = None,
               lang: str = "en") -> pd.DataFrame:
    """Long-format frame (step, value, series) for the loss plot: loss, its smoothed curve, eval loss (series
    named in `lang`). Zero losses are real values and are kept (on a log axis they are drawn at 1e-8)."""
    loss = [(int(r["step"]), _num(r.get("loss"))) for r in records if _num(r.get("step")) is not None]
    loss = [(s, v) for s, v in loss if v is not None]
    evals = [(int(r["step"]), _num(r.get("eval_loss"))) for r in records if _num(r.get("step")) is not None]
    evals = [(s, v) for s, v in evals if v is not None]
    rows = []
    prefix = f"{run_label} " if run_label else ""
    if loss:
        steps, values = zip(*loss)
        rows += [(s, v, prefix + series_name("loss", lang)) for s, v in loss]
        if run_label is None:
            rows += [(s, v, series_name("smoothed", lang)) for s, v in zip(steps, smooth(list(values)))]
    rows += [(s, v, prefix + series_name("eval_loss", lang)) for s, v in evals]
    if log_scale:
        rows = [(s, math.log10(max(v, 1e-8)), name) for s, v, name in rows]
    df = _long_frame(rows)
    return _thin(df)


def metric_frame(records: list[dict], keys, run_label: str | None = None) -> pd.DataFrame:
    """Long-format frame (step, value, series) of metric keys as logged in trainer_log.jsonl (e.g.
    rewards/chosen), each with its eval_ variant when the run evaluated. One series per key present, named
    by the key; with a run label (the Runs overlay, one metric of several runs) by the run, and
    "<run> eval" for the eval variant, so the legend stays short enough to be read whole."""
    wanted = []
    present = dict.fromkeys(k for r in records for k in r)
    keys = [k for pattern in keys for k in ([pattern] if "*" not in pattern else
                                            sorted(k for k in present if matches(k, pattern)))]
    for key in keys:
        wanted += [key] if key.startswith("eval_") else [key, f"eval_{key}"]
    rows = []
    for key in dict.fromkeys(wanted):
        name = key if run_label is None else run_label + (" eval" if key.startswith("eval_") else "")
        for r in records:
            step, value = _num(r.get("step")), _num(r.get(key))
            if step is not None and value is not None:
                rows.append((int(step), value, name))
    return _thin(_long_frame(rows))


# ------------------------------------------------------------------ the stage's own plots (backend/stages)

def plot_names() -> tuple[str, ...]:
    """Every plot some stage declares, in declaration order: the Train tab has one LinePlot per name and
    shows those of the attached run's stage."""
    return tuple(dict.fromkeys(name for s in STAGES.values() for name, _ in s.plots))


def plot_elem_id(name: str) -> str:
    return "train-plot_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def stage_plots(stage_id: str | None) -> dict[str, tuple[str, ...]]:
    """plot name -> metric keys of a stage; {} for an unknown stage or one with no plots (pt)."""
    try:
        return dict(get_stage(stage_id).plots) if stage_id else {}
    except KeyError:
        return {}


def plots_when_logged(stage_id: str | None) -> tuple[str, ...]:
    """The stage's plots shown only once the run logged one of their keys (sft's task metric)."""
    try:
        return get_stage(stage_id).plots_when_logged if stage_id else ()
    except KeyError:
        return ()


COMPLETION_COLUMNS = ("step", "reward", "rewards", "completion")


def completions_frame(run_dir, n: int = 8, max_chars: int = 400) -> pd.DataFrame:
    """The newest `n` completions of a GRPO run (backend.core.rundir.COMPLETIONS_FILE) for the table under the plots:
    step, total reward, each function's reward, the completion (cut at max_chars). Reads only the file's
    last 256 KiB, whatever its size; an unreadable line is skipped."""


    path = Path(run_dir) / COMPLETIONS_FILE
    rows = []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            lines = f.read().decode("utf-8", errors="replace").splitlines()[-n:]
    except OSError:
        lines = []
    for line in reversed(lines):  # newest first
        try:
            r = json.loads(line)
        except ValueError:
            continue
        per = ", ".join(f"{k} {v:.3g}" if isinstance(v, (int, float)) else f"{k} –"
                        for k, v in (r.get("rewards") or {}).items())
        text = str(r.get("completion", ""))
        rows.append((r.get("step"), _num(r.get("reward")), per,
                     text[:max_chars] + ("…" if len(text) > max_chars else "")))
    return pd.DataFrame(rows, columns=list(COMPLETION_COLUMNS))


# Bookkeeping columns of trainer_log.jsonl that are not worth a curve in the Runs overlay.
NOT_METRICS = ("step", "total_steps", "elapsed_s", "eta_s", "eval_seconds")


def metric_keys(records: list[dict]) -> list[str]:
    """The numeric keys of these records that can be plotted, loss first; an eval_ key whose train key
    is also there is left out (it is drawn with it)."""
    keys = dict.fromkeys(k for r in records for k, v in r.items() if k not in NOT_METRICS and _num(v) is not None)
    out = [k for k in keys if not (k.startswith("eval_") and k[len("eval_"):] in keys)]
    return sorted(out, key=lambda k: (k not in ("loss", "eval_loss"), k))


def lr_frame(records: list[dict]) -> pd.DataFrame:
    """(step, lr) frame for the learning-rate plot: integer steps, readable values, typed even when empty."""
    rows = [(int(r["step"]), _num(r.get("lr"))) for r in records if _num(r.get("step")) is not None]
    rows = [(s, v) for s, v in rows if v is not None]
    return _thin(pd.DataFrame({"step": pd.Series([s for s, _ in rows], dtype="int64"),
                               "lr": pd.Series([readable(v) for _, v in rows], dtype="float64")}))


def fmt_duration(seconds) -> str:
    s = _num(seconds)
    if s is None:
        return "–"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _parse_time(value) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def progress(records: list[dict], status: dict, now: float | None = None) -> dict:
    """step/total, fraction, elapsed, ETA and tokens/s from the newest log record and status.json."""
    last = records[-1] if records else {}
    step = _num(status.get("step")) or _num(last.get("step")) or 0
    if records and (_num(last.get("step")) or 0) > step:
        step = _num(last.get("step"))
    total = _num(status.get("total_steps")) or _num(last.get("total_steps"))
    elapsed = _num(last.get("elapsed_s"))
    started = _parse_time(status.get("started_at"))
    finished = _parse_time(status.get("finished_at"))
    if started is not None:
        end = finished if finished else (now if now is not None else datetime.now().timestamp())
        if status.get("state") in ("running", "pending") or finished:
            elapsed = max(elapsed or 0.0, end - started)
    if elapsed is not None:  # a resumed run: the time of its earlier processes too (backend.core.rundir.run_seconds)
        elapsed += _num(status.get("earlier_s")) or 0.0
    eta = _num(last.get("eta_s"))
    if eta is None and total and step and elapsed:
        eta = elapsed / step * max(total - step, 0)
    if status.get("state") not in (None, "running", "pending", "starting"):
        eta = 0.0 if status.get("state") == "completed" else None
    frac = min(step / total, 1.0) if total else 0.0
    return {"step": int(step), "total": int(total) if total else None, "fraction": frac,
            "elapsed": elapsed, "eta": eta, "tokens_per_s": _num(last.get("tokens_per_s")),
            "epoch": _num(last.get("epoch"))}


# ------------------------------------------------------------------ before the first step: what the run is doing

_STAMP = re.compile(r"^\[\d\d:\d\d:\d\d\] ")
_DATASET = re.compile(r"^dataset \S+ .*?(\d+) kept")
_TOTAL = re.compile(r"^datasets total: (\d+) examples kept")


def tokenizing_share(status: dict | None) -> float | None:
    """The share of rows tokenized so far while a run tokenizes (status.json "tokenizing", written by
    backend.core.rundir.RunDir.tokenizing_progress), else None (not tokenizing, or done)."""
    prep = (status or {}).get("tokenizing")
    if (status or {}).get("phase") not in (None, PHASE_LOADING) or not isinstance(prep, dict):
        return None
    done, total = _num(prep.get("done")), _num(prep.get("total"))
    if done is None or not total or done >= total:
        return None
    return done / total


def _tokenizing_text(status: dict, lang: str) -> str:
    prep = status["tokenizing"]
    done, total, eta = int(_num(prep.get("done")) or 0), int(_num(prep.get("total")) or 0), _num(prep.get("eta_s"))
    if eta is None:
        return tr(lang, "phase.tokenizing_rows", done=f"{done:,}", total=f"{total:,}")
    return tr(lang, "phase.tokenizing_eta", done=f"{done:,}", total=f"{total:,}", eta=fmt_duration(eta))


def phase(log_lines: list[str], total: int | None = None, model: str = "", lang: str = "en",
          status: dict | None = None) -> str:
    """What a training process is doing, for the progress card. The trainer writes its phase into status.json
    at each transition (backend.core.rundir PHASE_*): once it says "training", step N+1 of the total is in progress
    (N = the status's steps done); "saving" after the last step. Before that ("loading", or a status from before
    phases) the log lines the backend writes at each loading step tell which (backend/training/train.py, backend/stages):
    starting, loading the tokenizer (a GGUF model is converted once), tokenizing N rows, loading the model,
    adding the adapter, the reference model, then preparing the trainer (TRL tokenizes or packs there too) until
    the first step begins. While the rows are tokenized, the rows done of all and the time left (status.json
    "tokenizing")."""
    status = status or {}
    if tokenizing_share(status) is not None:
        return _tokenizing_text(status, lang)
    if status.get("phase") == PHASE_SAVING:
        return tr(lang, "phase.saving")
    if status.get("phase") == PHASE_TRAINING:
        step = int(_num(status.get("step")) or 0) + 1
        return tr(lang, "phase.step", step=step, total=total) if total else tr(lang, "phase.step_open", step=step)
    gguf = str(model).lower().endswith(".gguf") or str(model) == DEFAULT_MODEL_ID
    what, rows = tr(lang, "phase.starting"), 0
    for raw in log_lines:
        if not _STAMP.match(raw):
            continue
        line = _STAMP.sub("", raw)
        if line.startswith("stage "):
            what = tr(lang, "phase.tokenizer") + (" " + tr(lang, "phase.gguf") if gguf else "")
        elif line.startswith("template: "):
            what = tr(lang, "phase.dataset")
        elif _DATASET.match(line):
            rows += int(_DATASET.match(line).group(1))
            what = tr(lang, "phase.tokenizing", n=rows)
        elif _TOTAL.match(line):
            rows = int(_TOTAL.match(line).group(1))
            what = tr(lang, "phase.tokenizing", n=rows)
        elif line.startswith(("train rows: ", "train pairs: ", "train blocks: ", "packed into ")):
            what = tr(lang, "phase.model")
        elif line.startswith("model: "):
            what = tr(lang, "phase.adapter")
        elif line.startswith(("trainable parameters", "resuming from")):
            what = tr(lang, "phase.trainer")
        elif line.startswith("reference model: "):
            what = tr(lang, "phase.reference")
    return what


def state_word(state: str, lang: str = "en") -> str:
    """A state badge's text in `lang` ("failed (...)" keeps its reason)."""
    head, sep, rest = state.partition(" ")
    key = f"state.{head}"
    return tr(lang, key) + sep + rest if has(key) else state


# Third-party lines that are not worth a status line (they stay in the full log): bitsandbytes' kernels
# notice, progress bars (tqdm), warnings of libraries.
NOISE = re.compile(r"gemm_4bit_forward|kernels-community|No module named 'kernels'|\d+%\|.*\||\bit/s\]|\bs/it\]|^\s*warnings\.warn|"
                   r"Warning:|UserWarning|FutureWarning|DeprecationWarning|^\s*$")


def status_line(lines: list[str]) -> str:
    """The newest line of a process's output that says something to a user (noise skipped), or ""."""
    for line in reversed(lines):
        text = line.rsplit("\r", 1)[-1].strip()
        if text and not NOISE.search(text):
            return text
    return ""


STATE_CLASS = {"running": "running", "starting": "running", "pending": "running", "completed": "ok",
               "aborted": "warn", "queued": "queued"}


def progress_html(p: dict, state: str, run_name: str = "", phase_text: str = "", lang: str = "en",
                  phase_share: float | None = None) -> str:
    """The progress bar and its numbers, as one small HTML block (one component update per tick).
    `phase_text`: what the run does before its first step (see phase()); `phase_share`: how far that is, drawn as
    a second bar under it (the rows tokenized: tokenizing_share())."""
    pct = round(100 * p["fraction"], 1)
    total = p["total"] if p["total"] else "?"
    doing = (f'<div class="tb-phase" data-phase="{html.escape(phase_text)}">{html.escape(phase_text)}…</div>'
             if phase_text else "")
    if phase_text and phase_share is not None:
        doing += (f'<div class="tb-bar tb-phase-bar" data-share="{phase_share:.3f}">'
                  f'<div class="tb-bar-fill" style="width:{100 * phase_share:.1f}%"></div></div>')

    def w(key: str) -> str:
        return html.escape(tr(lang, key))
    tps = f"{p['tokens_per_s']:.0f}" if p.get("tokens_per_s") is not None else "–"
    epoch = f"{p['epoch']:.2f}" if p.get("epoch") is not None else "–"
    cls = STATE_CLASS.get(state, "bad" if state.startswith("failed") else "idle")
    return (
        f'<div class="tb-progress" data-state="{html.escape(state)}" data-step="{p["step"]}">'
        f'<div class="tb-progress-head"><span class="tb-badge tb-{cls}">{html.escape(state_word(state, lang))}</span>'
        f'<span class="tb-run-name">{html.escape(run_name)}</span></div>'
        f'<div class="tb-bar"><div class="tb-bar-fill" style="width:{pct}%"></div></div>'
        f'<div class="tb-stats"><span>{w("card.step")} <b>{p["step"]}</b> / {total}</span>'
        f'<span>{pct}%</span><span>{w("card.epoch")} {epoch}</span>'
        f'<span>{w("card.elapsed")} {fmt_duration(p["elapsed"])}</span>'
        f'<span>{w("card.eta")} {fmt_duration(p["eta"])}</span>'
        f'<span>{tps} {w("card.tokens_s")}</span></div>{doing}</div>'
    )


METRIC_NAMES = {"final_loss": "final loss (last logged)", "smoothed_loss": "smoothed loss (the plot's curve, last point)",
                "min_loss": "lowest logged loss", "train_loss": "mean train loss (whole run)"}
LOSS_FIRST = ("final_loss", "smoothed_loss", "min_loss")  # the summary's first rows, in this order
# the HF Trainer's timings cover the steps of the process that ended the run: after a resume, those past it alone
LAST_PROCESS_ONLY = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def metric_name(key: str, status: dict) -> str:
    """A final metric's row name: what it is, and for a resumed run's timings which steps they cover."""
    name = METRIC_NAMES.get(key, key)
    resumed = [r for r in status.get("resumed_at") or () if isinstance(r, int)]
    if key in LAST_PROCESS_ONLY and resumed:
        last = (status.get("final_metrics") or {}).get("global_step") or status.get("step")
        steps = f"steps {resumed[-1] + 1}-{last}" if isinstance(last, int) else f"the steps after step {resumed[-1]}"
        name += f" ({steps} only: resumed at step {resumed[-1]})"
    return name


def final_metrics_md(status: dict) -> str:
    metrics = status.get("final_metrics") or {}
    lines = []
    if status.get("error"):
        lines.append(f"**Error:** {status['error']}")
    for w in status.get("warnings") or []:
        lines.append(f"⚠ {w}")
    if metrics:
        lines.append("| metric | value |\n|---|---|")
        # the last logged loss first; the trainer's train_loss is the mean over the run, and says so
        for k in sorted(metrics, key=lambda k: LOSS_FIRST.index(k) if k in LOSS_FIRST else len(LOSS_FIRST)):
            v, name = metrics[k], metric_name(k, status)
            lines.append(f"| {name} | {v:.6g} |" if isinstance(v, float) else f"| {name} | {v} |")
    return "\n".join(lines)
