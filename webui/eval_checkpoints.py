"""The Evaluate tab's Checkpoints part (issue 20 item 6): pick a training run under the saves folder and its
checkpoints (all or some), run `tuneboard eval checkpoints=...` as the tab's background job (the tab's own
Start, poll and re-attach), and show checkpoint_eval.json as it grows: a table checkpoint x metric (★ on the
best of each), a plot of one metric against the step, the progress with its ETA, and Promote for a picked
checkpoint (webui/promotion.py). Light: no torch."""
from __future__ import annotations

from pathlib import Path

import gradio as gr
import pandas as pd

from backend.core import paths
from backend.core.atomic import read_json_dict
from backend.core.checkpoint_pick import ALL, FINAL, available, is_model_run
from backend.core.methods import is_adapter
from backend.core.rundir import CHECKPOINT_EVAL_FILE, read_status
from webui import jobs, page_jobs, tools
from webui.i18n import headers, tr
from webui.live import fmt_duration
from webui.plots import empty_loss, plot_axes
from webui.promotion import promote_checkpoint

PARTS = ("loss", "predict")  # eval-ckpt_parts: do_eval (loss, perplexity) and do_predict (generation metrics)
RUN_KEYS = ("model_name_or_path", "template", "finetuning_type", "quantization_bit")  # taken from the run's spec
BEST = " ★"
NOT_SHOWN = ("checkpoint", "step", "stopped")


def run_pairs(root: Path | None = None) -> list[tuple[str, str]]:
    """(label, folder) of each training run under the saves folder that has complete adapter checkpoints,
    newest first, named as the Runs tab names them (the path under the saves folder)."""
    base = Path(root or paths.saves_dir())
    return [(str(run.relative_to(base)) if run.is_relative_to(base) else str(run), str(run))
            for run in jobs.iter_run_dirs(base) if available(run)]


NO_RUN = ("—", "")  # the picker's empty choice: an API call without a run gets the "pick a run" line


def run_update(current=None):
    """The run picker's choices now (runs trained since the page was built), the picked one kept."""
    pairs = run_pairs()
    folders = [f for _, f in pairs]
    return gr.update(choices=[NO_RUN, *pairs], value=current if current in folders else "")


def names_update(run):
    """The checkpoint picker for a run: its complete checkpoints and final; none picked = all."""
    return gr.update(choices=available(run), value=[])


def ckpt_flat(enabled, run, names, parts) -> dict:
    """The spec keys of a checkpoints eval ({} when the part is off): the run folder as adapter_name_or_path,
    the run's own base model, template and method (its run_spec.yaml), the names (none = all) and the parts. A
    full / freeze run's folder is the model itself (each checkpoint is loaded as the model)."""
    if not enabled:
        return {}
    spec = jobs.read_spec_dict(Path(run)) if run else {}
    flat = {k: spec.get(k) for k in RUN_KEYS} if spec else {}  # quantization_bit None too: not the top bar's
    picked = [n for n in (names or []) if n]
    parts = list(parts or [])
    where = {"model_name_or_path": run, "adapter_name_or_path": None} if run and is_model_run(run) else \
        {"adapter_name_or_path": run or None}
    return {**flat, **where, "checkpoints": ",".join(picked) or ALL, "do_eval": "loss" in parts,
            "do_predict": "predict" in parts}


def run_of(flat: dict) -> str | None:
    """The evaluated run folder of a checkpoints eval's spec."""
    return flat.get("adapter_name_or_path") if is_adapter(flat.get("finetuning_type")) else flat.get("model_name_or_path")


def refusals(flat: dict, lang: str = "en") -> str:
    """'' when the part can start; else one ✖ line saying what to pick."""
    if not run_of(flat):
        return tr(lang, "eval.ckpt_pick_run")
    if not (flat.get("do_eval") or flat.get("do_predict")):
        return tr(lang, "eval.ckpt_pick_parts")
    return ""


def read_report(part_dir: str | None) -> dict:
    return read_json_dict(Path(part_dir) / CHECKPOINT_EVAL_FILE) if part_dir else {}


def metric_names(report: dict) -> list[str]:
    return [m for m in tools.metric_names(report.get("checkpoints") or []) if m not in NOT_SHOWN]


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


def ranked(report: dict) -> dict:
    """The report's best per metric, for the metrics whose values differ between the adapters (a tie of all
    of them has no best to mark)."""
    entries = report.get("checkpoints") or []
    return {m: held for m, held in (report.get("best") or {}).items()
            if len(entries) < 2 or len({e.get(m) for e in entries}) > 1}


def table(report: dict, lang: str = "en") -> pd.DataFrame:
    """One line per evaluated adapter: checkpoint, step, each metric (★ on the best value of each)."""
    metrics = metric_names(report)
    best = ranked(report)
    rows = []
    for entry in report.get("checkpoints") or []:
        line = [entry.get("checkpoint"), entry.get("step")]
        for m in metrics:
            mark = BEST if (best.get(m) or {}).get("checkpoint") == entry.get("checkpoint") else ""
            line.append(_fmt(entry.get(m)) + mark if entry.get(m) is not None else "")
        rows.append(line)
    columns = ["checkpoint", "step"] + [m.removeprefix("predict_") for m in metrics]
    return headers(lang, pd.DataFrame(rows, columns=columns))


def plot_frame(report: dict, metric: str | None) -> pd.DataFrame:
    """`metric` of each evaluated adapter against its step (long format: step, value, series)."""
    rows = [(e.get("step"), e.get(metric), metric) for e in report.get("checkpoints") or []
            if metric and isinstance(e.get(metric), (int, float)) and isinstance(e.get("step"), int)]
    if not rows:
        return empty_loss()
    return pd.DataFrame(rows, columns=["step", "value", "series"])


def summary_md(report: dict, status: dict, lang: str = "en") -> str:
    """While running: the checkpoint being evaluated, how many are done and the ETA; after: the best checkpoint
    of each metric."""
    asked = report.get("asked") or []
    done = len(report.get("checkpoints") or [])
    lines = []
    if status.get("state") == "running":
        lines.append(tr(lang, "eval.ckpt_running", checkpoint=status.get("checkpoint") or "…", done=done,
                        n=len(asked) or "?", eta=fmt_duration(status.get("eta_s"))))
    for metric, held in ranked(report).items():
        lines.append(tr(lang, "eval.ckpt_best", metric=metric.removeprefix("predict_"),
                        checkpoint=held.get("checkpoint"), value=_fmt(held.get("value"))))
    if report.get("stopped"):
        lines.append(tr(lang, "eval.ckpt_stopped", done=done, n=len(asked), why=report["stopped"]))
    return "  \n".join(lines)


def _part_dir(st: dict) -> str | None:
    parts = (st or {}).get("parts") or []
    if not parts or not (st.get("spec") or {}).get("checkpoints"):
        return None
    return parts[0].get("dir")


def view(st: dict, metric: str | None, lang: str = "en") -> tuple:
    """Summary, table, plot, metric picker and promote picker of the tab's checkpoints eval (five skips when
    the tab's job is not one)."""
    part = _part_dir(st)
    if part is None:
        return (gr.skip(),) * 5
    report, status = read_report(part), read_status(part)
    metrics = metric_names(report)
    metric = metric if metric in metrics else (metrics[0] if metrics else None)
    names = [e.get("checkpoint") for e in report.get("checkpoints") or [] if e.get("checkpoint") != FINAL]
    best = (ranked(report).get(metric) or {}).get("checkpoint")
    return (summary_md(report, status, lang), table(report, lang),
            gr.update(value=plot_frame(report, metric), **plot_axes("ckpt_plot", lang)),
            gr.update(choices=metrics, value=metric),
            gr.update(choices=names, value=best if best in names else (names[-1] if names else None)))


def promote_picked(st: dict, checkpoint: str | None, lang: str = "en") -> str:
    """Make the picked checkpoint the evaluated run's adapter (webui/promotion.py, backend/core/promote.py); the
    message says what happened or why not."""
    run = run_of((st or {}).get("spec") or {}) if _part_dir(st) else None
    return promote_checkpoint(run, checkpoint, lang=lang)[1]


def build(reg) -> dict:
    """The part's components (inside the tab's accordion)."""
    c: dict = {}
    c["ckpt_mode"] = reg.comp(gr.Checkbox, "eval-ckpt_mode", value=False)
    with gr.Row(equal_height=True):
        c["ckpt_run"] = reg.comp(gr.Dropdown, "eval-ckpt_run", choices=[NO_RUN, *run_pairs()], value="",
                                   scale=3)
        c["ckpt_names"] = reg.comp(gr.Dropdown, "eval-ckpt_names", choices=[], value=[], multiselect=True, scale=2)
        c["ckpt_parts"] = reg.dropdown("eval-ckpt_parts", list(PARTS), value=list(PARTS), multiselect=True, scale=2)
    c["ckpt_summary"] = gr.Markdown("", elem_id="eval-ckpt_summary")
    c["ckpt_table"] = reg.comp(gr.Dataframe, "eval-ckpt_table", value=pd.DataFrame([], columns=["checkpoint", "step"]),
                               interactive=False)
    with gr.Row(equal_height=True):
        c["ckpt_metric"] = reg.comp(gr.Dropdown, "eval-ckpt_metric", choices=[], value=None, scale=1)
        c["ckpt_plot"] = reg.comp(gr.LinePlot, "eval-ckpt_plot", value=empty_loss(), x="step", y="value",
                                  height=300, scale=3, **plot_axes("ckpt_plot"))
    with gr.Row(equal_height=True):
        c["ckpt_promote_pick"] = reg.comp(gr.Dropdown, "eval-ckpt_promote_pick", choices=[], value=None, scale=2)
        c["ckpt_promote"] = reg.button("eval-ckpt_promote", scale=1)
    c["ckpt_message"] = gr.Markdown("", elem_id="eval-ckpt_message")
    return c


def wire(c: dict, start, state, timer, lang) -> None:
    """The part's own events: the pickers, the view on the tab's timer (cleared by Start), the metric shown,
    Promote."""
    c["ckpt_run"].focus(run_update, [c["ckpt_run"]], [c["ckpt_run"]], show_progress="hidden")
    c["ckpt_run"].change(names_update, [c["ckpt_run"]], [c["ckpt_names"]], show_progress="hidden")
    outputs = [c["ckpt_summary"], c["ckpt_table"], c["ckpt_plot"], c["ckpt_metric"], c["ckpt_promote_pick"]]
    start.click(lambda: ("", pd.DataFrame([], columns=["checkpoint", "step"]), empty_loss(), ""), None,
                [c["ckpt_summary"], c["ckpt_table"], c["ckpt_plot"], c["ckpt_message"]], show_progress="hidden")
    timer.tick(page_jobs.ticking("eval", view, len(outputs)), [state, c["ckpt_metric"], lang], outputs,
               show_progress="hidden")
    c["ckpt_metric"].input(view, [state, c["ckpt_metric"], lang], outputs, show_progress="hidden")
    lang.change(view, [state, c["ckpt_metric"], lang], outputs, show_progress="hidden")
    c["ckpt_promote"].click(promote_picked, [state, c["ckpt_promote_pick"], lang], [c["ckpt_message"]])
