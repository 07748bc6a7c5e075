"""Evaluate tab: run `tuneboard eval` on the top bar's model (+ adapter) over held-out rows, as a
subprocess; show its progress (status.json: step = rows predicted), the metrics (eval_results.json) and
the rows (generated_predictions.jsonl: prompt, reference, prediction, per-row score), worst first on
request. "Compare base vs tuned" runs the same rows twice, with and without the adapter, one after the
other (two processes at once would only halve the speed of each), and shows both side by side. "Compare with
adapter" runs them with a second adapter instead of the base model (an SFT adapter against the GRPO run that
continued it): on JSON answers the metrics put JSON validity and field F1 of both side by side.

A reward model (the top bar's adapter / model is stage rm's output: tools.is_reward_model) is evaluated
with `stage: rm` on a ranking dataset: the rows become chosen / rejected pairs with both scores, the margin
and whether the chosen answer won, and the metrics are pairwise accuracy and mean margin. There is no
"compare with base" for it: the base model has no trained score head.

Per-browser state (gr.State): {"parts": [{"name": "tuned"|"base", "dir": str, "adapter": str|None,
"launched": bool}], "spec": flat dict, "aborted": bool, "rows": [...], "results": {name: dict}}.
The job folder keeps what the state is rebuilt from after a page reload (attach()): plan.json (parts,
spec; rewritten when a part is launched) and an ABORTED marker on Abort. The next part of a compare is
launched by whichever page polls the job (the folder of a part is claimed with an exclusive mkdir, so two
pages watching the same job never launch it twice).
"""
from __future__ import annotations

import html
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from backend.core import allowed, paths
from backend.distill import read_report, report_rows
from backend.core.rundir import DISTILL_REPORT_FILE, PHASE_ANSWERING, PHASE_JUDGING
from backend.core.spec import SpecError, validate_spec
from webui import bench_view
from webui import choices, eval_checkpoints, jobs, judge_view, page_jobs, tools
from webui.i18n import headers, refusal, tr
from webui.tailer import job_log
import re

TICK_S = 1.0
LOG_LINES = 120


def new_state() -> dict:
    return {"parts": [], "spec": {}, "aborted": False, "rows": {}, "results": {}, "lines": [], "log": None,
            "log_dir": None}


def empty_frame(columns) -> pd.DataFrame:
    return pd.DataFrame([], columns=columns)


def build(ctx) -> dict:
    reg = ctx.reg
    c: dict = {}
    c["intro"] = reg.markdown("eval-intro", elem_classes=["tb-section-note"])
    names = choices.dataset_names()
    with gr.Row(equal_height=True):
        c["dataset"] = gr.Dropdown(choices=names, value=["identity"] if "identity" in names else [],
                                   multiselect=True, allow_custom_value=True, scale=3,
                                   label=reg.label("eval-dataset"), elem_id="eval-dataset")
        reg._add(c["dataset"], "label")
        # no bounds on gr.Number (its refusal is a toast that names no field): the spec refuses, naming the key
        c["max_samples"] = reg.comp(gr.Number, "eval-max_samples", value=20, precision=0, scale=1)
        c["max_new_tokens"] = reg.comp(gr.Number, "eval-max_new_tokens", value=128, precision=0, scale=1)
        c["val_size"] = reg.comp(gr.Number, "eval-val_size", value=0, scale=1,
                                 help=("eval-val_size", "0 = the first rows of the dataset; 0.1 = the 10% training holds out"))
        c["compare"] = reg.comp(gr.Checkbox, "eval-compare", value=False, scale=1)
    with gr.Row(equal_height=True):
        # a second adapter on the same base: its column replaces the base model's (SFT vs the GRPO run after it)
        c["compare_adapter"] = gr.Dropdown(choices=choices.adapter_pairs(), value="", allow_custom_value=True,
                                           label=reg.label("eval-compare_adapter"), elem_id="eval-compare_adapter")
        reg._add(c["compare_adapter"], "label")
    with reg.accordion("eval-group-judge", open=False):  # the judge mode: webui/judge_view.py
        c["judge"] = reg.comp(gr.Checkbox, "eval-judge", value=False)
        with gr.Row(equal_height=True):
            c["judge_url"] = reg.comp(gr.Textbox, "eval-judge_url", value="", scale=3)
            c["judge_model"] = reg.comp(gr.Textbox, "eval-judge_model", value="", scale=2)
            c["judge_max_requests"] = reg.comp(gr.Number, "eval-judge_max_requests", value=0, precision=0, scale=1)
        with gr.Row(equal_height=True):
            c["judge_api_key_env"] = reg.comp(gr.Textbox, "eval-judge_api_key_env", value="OPENAI_API_KEY")
            c["judge_api_key_file"] = reg.comp(gr.Textbox, "eval-judge_api_key_file", value="")
            c["judge_reference"] = reg.comp(gr.Checkbox, "eval-judge_reference", value=False)
        c["judge_summary"] = gr.Markdown("", elem_id="eval-judge_summary")
        c["judge_rows"] = reg.comp(gr.Dataframe, "eval-judge_rows", value=empty_frame(judge_view.ROW_COLUMNS),
                                   interactive=False, wrap=True, max_height=520)
    with reg.accordion("eval-group-checkpoints", open=False):  # a run's checkpoints: webui/eval_checkpoints.py
        c.update(eval_checkpoints.build(reg))
    with reg.accordion("eval-group-bench", open=False):  # lm-eval benchmarks, base vs tuned: webui/bench_view.py
        c.update(bench_view.build(reg))
    c["rm_note"] = gr.Markdown("", visible=False, elem_id="eval-rm-note")
    with gr.Row():
        c["start"] = reg.button("eval-start", variant="primary")
        c["abort"] = reg.button("eval-abort", variant="stop")
    c["message"] = gr.Markdown("", elem_id="eval-message")
    c["progress"] = gr.HTML(tools.progress_html("idle", 0, None), elem_id="eval-progress")
    c["metrics"] = reg.comp(gr.Dataframe, "eval-metrics", value=empty_frame(["metric"]), interactive=False)
    c["worst_first"] = reg.comp(gr.Checkbox, "eval-worst_first", value=False)
    c["rows"] = reg.comp(gr.Dataframe, "eval-rows", value=empty_frame(["#"]), interactive=False, wrap=True,
                         max_chars=80, max_height=520)
    c["detail"] = gr.HTML("", elem_id="eval-detail")
    with reg.accordion("eval-group-log", open=False):
        c["log"] = reg.comp(gr.Textbox, "eval-log", lines=10, max_lines=10, autoscroll=True, interactive=False,
                            elem_classes=["tb-log"])
    with reg.accordion("eval-group-distill", open=False) as c["distill_group"]:
        c["distill_report"] = gr.Dropdown(choices=[], value=None, label=reg.label("eval-distill_report"),
                                          elem_id="eval-distill_report")
        reg._add(c["distill_report"], "label")
        c["distill_summary"] = gr.Markdown("", elem_id="eval-distill_summary")
        c["distill_card"] = reg.comp(gr.Dataframe, "eval-distill_card", value=empty_frame(DISTILL_COLUMNS),
                                     interactive=False)
    c["state"] = gr.State(new_state())
    c["timer"] = gr.Timer(TICK_S, active=False)
    return c


# ------------------------------------------------------------------ distillation scorecards (distill_report.json)

DISTILL_COLUMNS = ["metric", "base", "tuned"]


def distill_reports() -> list[tuple[str, str]]:
    """(label, folder) of each distill run folder under the saves folder that holds a scorecard
    (saves/distill/<dataset> by default; any folder one or two levels down), newest first."""
    root = paths.saves_dir()
    found = []
    for pattern in (f"*/{DISTILL_REPORT_FILE}", f"*/*/{DISTILL_REPORT_FILE}"):
        for report in root.glob(pattern):
            try:
                found.append((report.stat().st_mtime, report.parent))
            except OSError:  # removed while listed
                continue
    found.sort(key=lambda x: x[0], reverse=True)
    return [(str(folder.relative_to(root)), str(folder)) for _, folder in found]


def list_distill_reports(current, lang: str = "en"):
    """The scorecards found under the saves folder; the one shown stays picked, else the newest is.
    Inputs: picked folder, language. Outputs: report picker, summary."""
    pairs = distill_reports()
    folders = [f for _, f in pairs]
    value = current if current in folders else (folders[0] if folders else None)
    return (gr.update(choices=pairs, value=value),
            gr.skip() if folders else tr(lang, "eval.distill_none", saves=paths.saves_dir()))


def distill_card(folder, lang: str = "en") -> tuple[str, pd.DataFrame]:
    """A distill run's scorecard: who was scored (student, adapter, teacher, dataset, held-out rows) and the
    table metric | base | tuned, the student's answers scored against the teacher's (JSON validity, schema
    validity, field F1, exact match, tokens/s). Inputs: folder, language. Outputs: summary, table."""
    empty = headers(lang, empty_frame(DISTILL_COLUMNS))
    if not folder:
        return "", empty
    try:
        allowed.check_read(folder, "distill report")
    except allowed.PathRefused as exc:
        return refusal(lang, exc), empty
    report = read_report(folder)
    if not report:
        return tr(lang, "eval.distill_missing", path=Path(folder) / DISTILL_REPORT_FILE), empty
    summary = tr(lang, "eval.distill_summary", student=report.get("student", "?"),
                 adapter=report.get("adapter") or "—", teacher=report.get("teacher", "?"),
                 dataset=report.get("dataset", "?"), rows=report.get("rows", "?"))
    return summary, headers(lang, pd.DataFrame(report_rows(report), columns=DISTILL_COLUMNS))


# ------------------------------------------------------------------ handlers (plain functions)

def eval_flat(model, adapter, method, quant, template, datasets, max_samples, max_new_tokens,
              val_size=None) -> dict:
    """The spec of one eval from the top bar and this tab (greedy decoding: scores that do not move between
    two runs of the same rows). `val_size` > 0: the datasets' held-out split (the rows a training run with
    the same val_size and seed set aside), else their first rows."""
    if isinstance(datasets, str):
        datasets = [datasets]
    names = ",".join(d for d in datasets or [] if d) or None
    held_out = float(val_size) if val_size not in (None, "") and float(val_size) != 0 else None  # < 0: refused
    flat = {"model_name_or_path": model, "adapter_name_or_path": (adapter or "").strip() or None,
            "finetuning_type": method, "quantization_bit": None if quant in (None, "", "none") else int(quant),
            "template": template or "auto", "eval_dataset": names,
            "max_samples": int(max_samples) if max_samples not in (None, "") else None,
            "max_new_tokens": int(max_new_tokens) if max_new_tokens not in (None, "") else 128,
            "do_eval": True, "do_predict": True, "do_sample": False}
    if held_out:  # backend.evaluation.evaluate: no eval_dataset -> the val_size split of dataset
        flat.update(eval_dataset=None, dataset=names, val_size=int(held_out) if held_out >= 1 else held_out)
    if tools.is_reward_model(model, flat["adapter_name_or_path"]):  # pairs are scored, nothing is generated
        flat["stage"] = "rm"
        del flat["max_new_tokens"], flat["do_sample"]
        flat["dataset"] = names  # validate checks `dataset` against the stage's data kind too
    return flat


def is_rm(flat: dict | None) -> bool:
    """An eval of a reward model (eval_flat set stage rm)."""
    return (flat or {}).get("stage") == "rm"


RM_NOTE = ("**Reward model**: the eval scores the chosen and the rejected answer of each pair of a ranking "
           "dataset ({datasets}) and reports pairwise accuracy (chosen scored higher) and the mean margin. "
           "No compare with base: the base model has no trained score head.")


def reward_mode_update(model, adapter, datasets):
    """The tab for the top bar's model (+ adapter): for a reward model, the note, compare off and hidden,
    max new tokens hidden and a ranking dataset picked (unless one is); else the plain eval form (and the
    default dataset again if only ranking ones were picked: a causal LM eval cannot use them).
    Inputs: top bar model, adapter, datasets. Outputs: rm note, compare, max new tokens, dataset."""
    ranking = tools.ranking_datasets()
    datasets = [d for d in ([datasets] if isinstance(datasets, str) else datasets or []) if d]
    picked = [d for d in datasets if d in ranking]
    if not tools.is_reward_model(model, adapter):
        plain = ["identity"] if "identity" in choices.dataset_names() else []
        return (gr.update(visible=False, value=""), gr.update(visible=True), gr.update(visible=True),
                gr.update(value=plain) if datasets and len(picked) == len(datasets) else gr.skip())
    return (gr.update(visible=True, value=RM_NOTE.format(datasets=", ".join(f"`{d}`" for d in ranking) or "none")),
            gr.update(visible=False, value=False), gr.update(visible=False),
            gr.skip() if picked else gr.update(value=ranking[:1]))


def rows_scored(flat: dict, lang: str = "en") -> str:
    """Which rows an eval scores, in words (the intro cannot know: it depends on val_size)."""
    n = flat.get("max_samples")
    if is_rm(flat) and not flat.get("val_size"):
        return tr(lang, "eval.rows_rm_first" if n else "eval.rows_rm_all", n=n, dataset=flat.get("eval_dataset"))
    if flat.get("val_size"):
        v = flat["val_size"]
        share = tr(lang, "eval.share_rows", n=f"{v:g}") if v >= 1 else f"{100 * v:g}%"
        return tr(lang, "eval.rows_held", share=share, dataset=flat.get("dataset"),
                  first=tr(lang, "eval.from_first", n=n) if n else "")
    return tr(lang, "eval.rows_first" if n else "eval.rows_all", n=n, dataset=flat.get("eval_dataset"))


def part_names(adapter: str, other: str) -> tuple[str, str]:
    """Column names of two adapters compared: their run folders' names (a checkpoint-N with its run's), kept
    distinct, made of characters a folder name may hold."""

    def name(path: str) -> str:
        p = Path(path.rstrip("/"))
        text = f"{p.parent.name}-{p.name}" if p.name.startswith("checkpoint-") else p.name
        return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:60] or "adapter"

    first, second = name(adapter), name(other)
    if second == first:
        second += "-2"
    return first, second


# plan()'s refusals that the locales translate (English text -> key)
PLAN_REFUSALS = {
    "✖ Pick at least one dataset to evaluate on.": "eval.no_dataset",
    "✖ Compare with base is not available for a reward model: the base model has no trained score head.":
        "eval.rm_compare",
    "✖ Compare needs an adapter: pick one in the top bar (**Adapter / checkpoint**).": "eval.need_adapter",
}


def plan(flat: dict, compare: bool, other_adapter: str | None = None) -> tuple[list[dict] | None, str]:
    """The eval parts to run ([tuned] / [base] / [tuned, base] / [adapter, other adapter]) or (None, why
    not)."""
    other_adapter = (other_adapter or "").strip() or None
    if not (flat.get("eval_dataset") or flat.get("dataset") or flat.get("tasks")):  # tasks: lm-eval's own data
        return None, "✖ Pick at least one dataset to evaluate on."
    if compare and is_rm(flat):
        return None, ("✖ Compare with base is not available for a reward model: the base model has no trained "
                      "score head.")
    if compare and not flat.get("adapter_name_or_path"):
        return None, "✖ Compare needs an adapter: pick one in the top bar (**Adapter / checkpoint**)."
    if other_adapter and is_rm(flat):
        return None, "✖ Compare with another adapter is for generated answers, not for a reward model."
    if other_adapter and not flat.get("adapter_name_or_path"):
        return None, ("✖ Compare with adapter needs an adapter in the top bar too (**Adapter / checkpoint**): the "
                      "two are evaluated on the same base model.")
    if other_adapter and other_adapter == flat.get("adapter_name_or_path"):
        return None, "✖ The adapter to compare with is the one in the top bar: pick another one."
    try:
        validate_spec(flat)
    except SpecError as exc:
        return None, "✖ " + "; ".join(f"`{f}`: {m}" for f, m in exc.errors)
    if other_adapter:
        try:
            validate_spec(dict(flat, adapter_name_or_path=other_adapter))
        except SpecError as exc:
            return None, "✖ " + "; ".join(f"`{f}`: {m}" for f, m in exc.errors)
        job = tools.new_job_dir("eval")
        first, second = part_names(flat["adapter_name_or_path"], other_adapter)
        return [{"name": first, "dir": str(job / first), "adapter": flat["adapter_name_or_path"], "launched": False},
                {"name": second, "dir": str(job / second), "adapter": other_adapter, "launched": False}], ""
    job = tools.new_job_dir("eval")
    adapter = flat.get("adapter_name_or_path")
    name = "tuned" if adapter or is_rm(flat) else "base"  # a reward model is always a trained one
    parts = [{"name": name, "dir": str(job / name), "adapter": adapter, "launched": False}]
    if compare:
        parts.append({"name": "base", "dir": str(job / "base"), "adapter": None, "launched": False})
    return parts, ""


def start_eval(st: dict, flat: dict, compare: bool, lang: str = "en",
               other_adapter: str | None = None) -> tuple[dict, str, bool]:
    """Plans the parts, writes plan.json and launches the first part. Returns (state, message, started).
    The model and adapter must be what backend.core.allowed lets the UI read."""
    if st and any(tools.alive(p["dir"]) for p in st.get("parts", [])):
        return st, tr(lang, "eval.running"), False
    refused = allowed.spec_refusals(flat)
    if not refused and (other_adapter or "").strip():
        refused = allowed.spec_refusals(dict(flat, adapter_name_or_path=other_adapter.strip()))
    if refused:
        return st, "  \n".join(refusal(lang, exc) for exc in refused), False
    parts, why = plan(flat, compare, other_adapter)
    if parts is None:
        return st, tr(lang, PLAN_REFUSALS[why]) if why in PLAN_REFUSALS else why, False
    st = new_state()
    st["parts"], st["spec"] = parts, flat
    save_plan(st)
    launch_part(st, parts[0])
    if is_rm(flat):
        return st, tr(lang, "eval.rm_started", rows=rows_scored(flat, lang)), True
    what = tr(lang, "eval.and").join(p["name"] for p in parts)
    return st, tr(lang, "eval.started", what=what, rows=rows_scored(flat, lang)), True


def job_dir(st: dict) -> str | None:
    """The eval's job folder (the parent of its parts' folders)."""
    return page_jobs.job_of(st)


def save_plan(st: dict) -> None:
    tools.write_plan(job_dir(st), {"parts": st["parts"], "spec": st["spec"]})


def launch_part(st: dict, part: dict, claim_wait_s: float = 5.0) -> None:
    """Launches one part, unless another page already did (its folder exists: then this waits up to
    `claim_wait_s` for that launch to be recorded). Marks it launched in the state and in plan.json."""
    try:
        Path(part["dir"]).mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        deadline = time.monotonic() + claim_wait_s
        while not (Path(part["dir"]) / jobs.LAUNCH_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        part["launched"] = True
        return
    flat = dict(st["spec"], adapter_name_or_path=part["adapter"], output_dir=part["dir"])
    spec = validate_spec(flat)
    tools.start("eval", part["dir"], spec.to_yaml(include_defaults=False))
    part["launched"] = True
    save_plan(st)


def attach(job: str | None) -> dict:
    """The tab's state for an existing eval job folder (a page reload or a UI restart), from its
    plan.json; a part whose folder holds launch.json counts as launched even if plan.json lags behind.
    A folder without plan.json yields its tuned/ and base/ parts as they are (nothing more is launched)."""
    st = new_state()
    if not job:
        return st
    plan = tools.read_plan(job)
    parts = [p for p in plan.get("parts") or [] if isinstance(p, dict) and p.get("name") and p.get("dir")]
    if not parts:
        parts = [{"name": n, "dir": str(Path(job) / n), "adapter": None, "launched": True}
                 for n in ("tuned", "base") if (Path(job) / n / tools.TOOL_SPEC).exists()]
    for p in parts:
        p["launched"] = bool(p.get("launched")) or (Path(p["dir"]) / jobs.LAUNCH_FILE).exists()
    st["parts"], st["spec"] = parts, dict(plan.get("spec") or {})
    st["aborted"] = tools.was_aborted(job)
    return st


def attached_message(st: dict, lang: str = "en") -> str:
    if is_rm(st["spec"]):
        return tr(lang, "eval.attached_rm", rows=rows_scored(st["spec"], lang))
    what = tr(lang, "eval.and").join(p["name"] for p in st["parts"])
    return tr(lang, "eval.attached", what=what, rows=rows_scored(st["spec"], lang))


def abort(st: dict, lang: str = "en") -> tuple[dict, str]:
    """Stops the running eval process and any part still to come; leaves the ABORTED marker in the job
    folder. Returns (state, message)."""
    if not st or not st.get("parts") or not _pending(st):
        return st, tr(lang, "eval.none")
    st["aborted"] = True
    tools.mark_aborted(job_dir(st))
    stopped = any([tools.stop(p["dir"]) for p in st["parts"]])
    return st, tr(lang, "eval.stopping" if stopped else "eval.stopped_next")


def _pending(st: dict) -> bool:
    """A part is running, or one is still to come after parts that all completed (a finished or failed
    eval is not aborted after the fact)."""
    if any(tools.alive(p["dir"]) for p in st["parts"]):
        return True
    launched = [p for p in st["parts"] if p["launched"]]
    return len(launched) < len(st["parts"]) and all(part_status(p).get("state") == "completed" for p in launched)


def _current(st: dict) -> dict | None:
    """The part that is running or next to run; None when all are done."""
    for part in st["parts"]:
        if not part["launched"] or tools.alive(part["dir"]):
            return part
    return None


def part_status(part: dict) -> dict:
    return jobs.read_json(Path(part["dir"]) / jobs.STATUS_FILE)


def metrics_frame(st: dict) -> pd.DataFrame:
    results = [st["results"].get(p["name"], {}) for p in st["parts"]]
    names = tools.metric_names(results)
    cols = ["metric"] + [p["name"] for p in st["parts"]]
    rows = []
    for k in names:
        rows.append([k.removeprefix("predict_")] + [_fmt(r.get(k)) for r in results])
    return pd.DataFrame(rows, columns=cols)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


ROW_WIDTHS = {7: ["5%", "22%", "25%", "25%", "9%", "8%", "6%"],
              8: ["4%", "19%", "20%", "20%", "10%", "10%", "9%", "8%"],  # a reward model's pairs
              9: ["4%", "14%", "17%", "17%", "8%", "7%", "6%", "16%", "11%"]}


def rows_update(st: dict, worst_first: bool, lang: str = "en"):
    """rows_frame with column widths that fit the page (a table that grew past it hid the predictions)."""
    frame = rows_frame(st, worst_first)
    return gr.update(value=headers(lang, frame), column_widths=ROW_WIDTHS.get(len(frame.columns)))


def rows_frame(st: dict, worst_first: bool) -> pd.DataFrame:
    """One line per row: prompt, reference, prediction, per-row score (rouge-l) and, comparing, the base
    model's prediction and score beside it. Worst first = lowest score first. A reward model: pair_frame."""
    if is_rm(st.get("spec")):
        return pair_frame(st, worst_first)
    parts = st["parts"]
    cols = ["#", "question", "reference", "prediction", tools.ROW_SCORE, "bleu-4", "exact"]
    if len(parts) > 1:
        cols += [f"{parts[1]['name']} prediction", f"{parts[1]['name']} {tools.ROW_SCORE}"]
    main = st["rows"].get(parts[0]["name"], []) if parts else []
    other = {r.get("index"): r for r in st["rows"].get(parts[1]["name"], [])} if len(parts) > 1 else {}
    order = sorted(main, key=tools.row_score) if worst_first else main
    out = []
    for r in order:
        line = [r.get("index"), tools.short(tools.last_user_turn(r.get("prompt"))), tools.short(r.get("label")),
                tools.short(r.get("predict")), round(tools.row_score(r), 2), _fmt(r.get("bleu-4")),
                "✓" if r.get("exact_match") else "✗"]
        if len(parts) > 1:
            b = other.get(r.get("index"), {})
            line += [tools.short(b.get("predict")), round(tools.row_score(b), 2) if b else ""]
        out.append(line)
    return pd.DataFrame(out, columns=cols)


PAIR_COLUMNS = ["#", "question", "chosen", "rejected", "chosen score", "rejected score", "margin", "correct"]


def pair_frame(st: dict, worst_first: bool) -> pd.DataFrame:
    """A reward model's pairs, one line each: question, the two answers, their scores, the margin (chosen -
    rejected) and whether the chosen answer scored higher. Worst first = smallest margin first."""
    parts = st.get("parts") or []
    rows = st["rows"].get(parts[0]["name"], []) if parts else []
    order = sorted(rows, key=tools.pair_score) if worst_first else rows
    out = [[r.get("index"), tools.short(r.get("question")), tools.short(r.get("chosen")),
            tools.short(r.get("rejected")), _fmt(r.get("chosen_score")), _fmt(r.get("rejected_score")),
            _fmt(r.get("margin")), "✓" if r.get("correct") else "✗"] for r in order]
    return pd.DataFrame(out, columns=PAIR_COLUMNS)


def pair_detail(st: dict, index, lang: str = "en") -> str:
    """One scored pair in full: the question, each answer with its score, the margin."""
    parts = (st or {}).get("parts") or []
    rows = {r.get("index"): r for r in (st.get("rows") or {}).get(parts[0]["name"], [])} if parts else {}
    r = rows.get(index)
    if r is None:
        return ""
    esc = html.escape
    w = lambda key, **kw: esc(tr(lang, key, **kw))  # noqa: E731
    where = " · " + tr(lang, "eval.source_row", source=r["source"], row=r.get("row")) if r.get("source") else ""
    verdict = w("eval.chosen_higher" if r.get("correct") else "eval.rejected_higher")
    return (f'<div class="tb-row-detail" data-index="{esc(str(index))}"><h4>{w("eval.pair", n=index)}{esc(where)}</h4>'
            f"<b>{w('eval.question')}</b><pre>{esc(str(r.get('question') or ''))}</pre>"
            f"<b>{w('eval.chosen')}</b> <small>{w('eval.score', score=_fmt(r.get('chosen_score')))}</small>"
            f"<pre>{esc(str(r.get('chosen') or ''))}</pre>"
            f"<b>{w('eval.rejected')}</b> <small>{w('eval.score', score=_fmt(r.get('rejected_score')))}</small>"
            f"<pre>{esc(str(r.get('rejected') or ''))}</pre>"
            f"<p>{w('eval.margin', margin=_fmt(r.get('margin')))}: {verdict}</p></div>")


def row_detail(st: dict, index, lang: str = "en") -> str:
    """One scored row in full (a click on the table): the whole prompt as the model saw it, the reference,
    each part's answer and its per-row scores. A reward model: pair_detail."""
    if is_rm((st or {}).get("spec")):
        return pair_detail(st, index, lang)
    parts = (st or {}).get("parts") or []
    rows = {p["name"]: {r.get("index"): r for r in (st.get("rows") or {}).get(p["name"], [])} for p in parts}
    main = rows.get(parts[0]["name"], {}).get(index) if parts else None
    if main is None:
        return ""
    esc = html.escape
    w = lambda key, **kw: esc(tr(lang, key, **kw))  # noqa: E731
    where = " · " + tr(lang, "eval.source_row", source=main["source"], row=main.get("row")) if main.get("source") else ""
    out = [f'<div class="tb-row-detail" data-index="{esc(str(index))}"><h4>{w("eval.row", n=index)}{esc(where)}</h4>',
           f"<b>{w('eval.question')}</b><pre>{esc(tools.last_user_turn(main.get('prompt')))}</pre>",
           f"<details><summary>{w('eval.full_prompt')}</summary><pre>{esc(str(main.get('prompt') or ''))}"
           "</pre></details>",
           f"<b>{w('eval.reference')}</b><pre>{esc(str(main.get('label') or ''))}</pre>"]
    for p in parts:
        r = rows[p["name"]].get(index) or {}
        scores = " · ".join(f"{k} {_fmt(r.get(k))}" for k in ("rouge-1", "rouge-2", "rouge-l", "bleu-4")
                            if r.get(k) is not None)
        exact = w("eval.exact") + (" ✓" if r.get("exact_match") else " ✗")
        out.append(f"<b>{esc(p['name'])}</b> <small>{esc(scores)} · {exact}</small><pre>{esc(str(r.get('predict') or ''))}</pre>")
    return "".join(out) + "</div>"


def poll(st: dict, worst_first: bool, lang: str = "en") -> tuple:
    """Timer tick: launch the next part when the previous one ended, read progress.
    Outputs: state, progress, message, metrics, rows, log, timer."""
    if not st or not st.get("parts"):
        return st, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=False)
    st["aborted"] = st.get("aborted") or tools.was_aborted(job_dir(st))  # also an Abort on another page
    part = _current(st)
    if st["aborted"]:
        if part is None or not tools.alive(part["dir"]):
            return _finish(st, worst_first, lang=lang)
        return st, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=True)
    # a part that failed stops the chain
    for p in st["parts"]:
        if p["launched"] and not tools.alive(p["dir"]):
            s = part_status(p)
            if s.get("state") != "completed":
                return _finish(st, worst_first, failed=p, lang=lang)
    if part is None:
        return _finish(st, worst_first, lang=lang)
    if not part["launched"]:
        launch_part(st, part)
    log = job_log(st, part["dir"], LOG_LINES)
    s = part_status(part)
    total, done = s.get("total_steps"), s.get("step") or 0
    n = len(st["parts"])
    idx = st["parts"].index(part) + 1
    doing = "eval.progress_pair" if is_rm(st.get("spec")) else "eval.progress_row"
    doing = "eval.progress_model" if (st.get("spec") or {}).get("tasks") else doing  # benchmarks: models, no rows
    # the judge's parts (backend.core.rundir's eval phases): the answers it compares, then the comparisons
    doing = {PHASE_ANSWERING: "eval.progress_answer", PHASE_JUDGING: "eval.progress_judge"}.get(s.get("phase"), doing)
    label = tr(lang, doing if total else "eval.progress_loading", name=part["name"], idx=idx, n=n, done=done,
               total=total, who=s.get("answering") or "")
    return (st, tools.progress_html("running", int(done), total, label, lang), gr.skip(), gr.skip(), gr.skip(), log,
            gr.Timer(active=True))




def _finish(st: dict, worst_first: bool, failed: dict | None = None, lang: str = "en") -> tuple:
    for p in st["parts"]:
        st["results"][p["name"]] = tools.read_results(p["dir"])
    st["rows"] = {p["name"]: tools.read_predictions(p["dir"]) for p in st["parts"]}
    shown = failed or next((p for p in reversed(st["parts"]) if p["launched"]), st["parts"][0])
    log = job_log(st, shown["dir"], LOG_LINES)
    if failed is not None:
        err = part_status(failed).get("error") or tr(lang, "eval.no_result")
        state, message = "failed", tr(lang, "eval.failed", name=failed["name"], error=err)
    elif st["aborted"]:
        state, message = "aborted", tr(lang, "eval.aborted")
    else:
        state = "completed"
        n_rows = len(st["rows"].get(st["parts"][0]["name"], []))
        where = Path(st["parts"][0]["dir"]).parent
        message = tr(lang, "eval.done", n=n_rows, dir=where)
        if (st.get("spec") or {}).get("tasks"):  # lm-eval benchmarks (webui/bench_view.py): no rows
            message = tr(lang, "eval.bench_done", dir=where)
        if is_rm(st.get("spec")):
            acc = st["results"].get(st["parts"][0]["name"], {}).get("eval_accuracy")
            acc = tr(lang, "eval.rm_accuracy", acc=f"{acc:.3f}") if isinstance(acc, (int, float)) else ""
            message = tr(lang, "eval.rm_done", n=n_rows, acc=acc, dir=where)
    total = max((len(v) for v in st["rows"].values()), default=0)
    if not total and state == "completed":  # benchmarks write no rows: the bar counts what the status counted
        total = max((part_status(p).get("total_steps") or 0 for p in st["parts"]), default=0)
    bar = tools.progress_html(state, total if state == "completed" else 0, total or None,
                              " + ".join(p["name"] for p in st["parts"]), lang)
    st["parts_done"] = True
    return (st, bar, message, headers(lang, metrics_frame(st)), rows_update(st, worst_first, lang), log,
            gr.Timer(active=False))


def wire(ctx, c: dict) -> None:
    top = ctx.top
    inputs = [top["model_name_or_path"], top["adapter_name_or_path"], top["finetuning_type"],
              top["quantization_bit"], top["template"], c["dataset"], c["max_samples"], c["max_new_tokens"],
              c["val_size"]]
    view = [c["state"], c["progress"], c["message"], c["metrics"], c["rows"], c["log"], c["timer"]]
    judge_inputs = [c["judge"], c["judge_url"], c["judge_model"], c["judge_api_key_env"], c["judge_api_key_file"],
                    c["judge_max_requests"], c["judge_reference"]]
    ckpt_inputs = [c["ckpt_mode"], c["ckpt_run"], c["ckpt_names"], c["ckpt_parts"]]

    def on_start(st, compare, lang, *values):
        """Inputs: state, compare, language, top bar (model, adapter, method, quantization, template),
        datasets, max samples, max new tokens, val size, the adapter to compare with, then the judge mode's
        inputs, then the checkpoints part's (last: the API's earlier parameters keep their places). Outputs: the
        view."""
        values, checking = values[:-len(ckpt_inputs)], values[-len(ckpt_inputs):]  # the checkpoints part: last
        values, judging = values[:-len(judge_inputs)], values[-len(judge_inputs):]
        *values, other = values
        flat, judge = eval_flat(*values), judge_view.judge_flat(*judging)
        ckpt = eval_checkpoints.ckpt_flat(*checking)
        if ckpt:  # the run's checkpoints on its own base model, one part: no compare
            refused = eval_checkpoints.refusals(ckpt, lang)
            if refused:
                return st, gr.skip(), refused, gr.skip(), gr.skip(), gr.skip(), gr.skip()
            flat.update(ckpt)
            compare, other = False, None
        if judge:  # the judge compares the tuned answers with the base's itself: no compare part
            refused = judge_view.refusals(judge, lang)
            if refused:
                return st, gr.skip(), refused, gr.skip(), gr.skip(), gr.skip(), gr.skip()
            flat.update(judge)
            compare, other = False, None
        st, message, started = start_eval(st, flat, bool(compare), lang, other_adapter=other)
        if not started:
            return st, gr.skip(), message, gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return (st, tools.progress_html("starting", 0, None, f"{st['parts'][0]['name']}: loading…"),
                message, empty_frame(["metric"]), empty_frame(["#"]), "", gr.Timer(active=True))

    c["start"].click(page_jobs.starting("eval", on_start, 0),
                     [c["state"], c["compare"], top["lang"], *inputs, c["compare_adapter"], *judge_inputs,
                      *ckpt_inputs],
                     view, api_name="eval_start")
    c["start"].click(lambda lang: ("", headers(lang, empty_frame(judge_view.ROW_COLUMNS))), [top["lang"]],
                     [c["judge_summary"], c["judge_rows"]], show_progress="hidden")

    def judge_refresh(st, lang):
        """judge_view.refresh, the rows table's headers in the page's language. Inputs: state, language. Outputs:
        summary, rows table."""
        summary, rows = judge_view.refresh(st, lang)
        return summary, headers(lang, rows) if isinstance(rows, pd.DataFrame) else rows

    c["timer"].tick(page_jobs.ticking("eval", judge_refresh, 2), [c["state"], top["lang"]],
                    [c["judge_summary"], c["judge_rows"]],
                    show_progress="hidden")
    c["start"].click(lambda: "", None, [c["detail"]], show_progress="hidden")  # the last eval's row
    eval_checkpoints.wire(c, c["start"], c["state"], c["timer"], top["lang"])
    # adapters trained since the page was built are offered too
    c["compare_adapter"].focus(lambda: gr.update(choices=choices.adapter_pairs()), None, [c["compare_adapter"]],
                               show_progress="hidden")

    def on_abort(st, lang):
        """Stops the running eval process (and any part still to come). Inputs: state, language. Outputs:
        message, state."""
        st, message = abort(st, lang)
        return message, st

    c["abort"].click(on_abort, [c["state"], top["lang"]], [c["message"], c["state"]])
    c["timer"].tick(page_jobs.ticking("eval", poll, len(view)), [c["state"], c["worst_first"], top["lang"]], view,
                    show_progress="hidden")
    bench_view.wire(c, view, inputs, eval_flat, start_eval, top["lang"])

    def relabel_idle(st, lang):
        """Before any eval: the idle card and the empty metrics and judge tables in the new language. Inputs:
        state, language. Outputs: progress, metrics, judge rows."""
        if (st or {}).get("parts"):
            return gr.skip(), gr.skip(), gr.skip()
        return (tools.progress_html("idle", 0, None, lang=lang), headers(lang, empty_frame(["metric"])),
                headers(lang, empty_frame(judge_view.ROW_COLUMNS)))

    top["lang"].change(relabel_idle, [c["state"], top["lang"]], [c["progress"], c["metrics"], c["judge_rows"]],
                       show_progress="hidden")

    def pick_row(st, lang, evt: gr.SelectData):
        """A click on a row shows it in full below the table. Inputs: state, language (+ the click). Outputs:
        detail."""
        index = evt.row_value[0] if getattr(evt, "row_value", None) else None
        return row_detail(st, index, lang) if index is not None else gr.skip()

    c["rows"].select(pick_row, [c["state"], top["lang"]], [c["detail"]])
    c["worst_first"].change(lambda st, w, lang: rows_update(st, w, lang) if st and st.get("parts") else gr.skip(),
                            [c["state"], c["worst_first"], top["lang"]], [c["rows"]], show_progress="hidden")

    # distillation scorecards: listed when the section is opened, shown when picked, relabelled on a language switch
    c["distill_group"].expand(list_distill_reports, [c["distill_report"], top["lang"]],
                              [c["distill_report"], c["distill_summary"]], show_progress="hidden")
    c["distill_report"].change(distill_card, [c["distill_report"], top["lang"]],
                               [c["distill_summary"], c["distill_card"]], show_progress="hidden")
    top["lang"].change(distill_card, [c["distill_report"], top["lang"]], [c["distill_summary"], c["distill_card"]],
                       show_progress="hidden")

    # a reward model (top bar) switches the tab to scoring pairs: reward_mode_update says how
    for source in (top["model_name_or_path"], top["adapter_name_or_path"]):
        source.change(reward_mode_update, [top["model_name_or_path"], top["adapter_name_or_path"], c["dataset"]],
                      [c["rm_note"], c["compare"], c["max_new_tokens"], c["dataset"]], show_progress="hidden")
