"""The Evaluate tab's benchmarks (issue 20 item 3): lm-evaluation-harness tasks on the top bar's model, the base
and the adapter side by side. The spec keys from the tab's inputs (`tuneboard eval` with tasks runs only the
benchmark, base then tuned, in one process: the tab's usual background job), and what its lm_eval_results.json
shows: per task and metric the base and tuned values with their standard errors, and the delta. Light: no torch,
no lm-eval.
"""
from __future__ import annotations

import gradio as gr
import pandas as pd

from backend.core.atomic import read_json_dict
from backend.core.benchmark_tasks import SHIPPED_TASK, lm_eval_missing, split_tasks
from backend.core.rundir import LM_EVAL_FILE
from webui import page_jobs, tools
from webui.i18n import tr

COLUMNS = ["task", "metric", "n", "base", "tuned", "delta"]
# the keys of a held-out-rows eval that a benchmark run does not read
ROW_KEYS = ("eval_dataset", "dataset", "val_size", "max_samples", "max_new_tokens", "do_sample")


def task_choices() -> list[tuple[str, str]]:
    """(label, value) of the tasks offered: the shipped one; anything else is typed (a name or a YAML path)."""
    return [("tuneboard_mc (TuneBoard's 30 questions, offline)", str(SHIPPED_TASK))]


def _number(text, cast, name: str, lang: str):
    text = str(text if text is not None else "").strip()
    if not text:
        return None, ""
    try:
        return cast(text), ""
    except ValueError:
        return None, tr(lang, "eval.bench_bad_number", field=name, value=text)


def bench_flat(tasks, num_fewshot, limit, lang: str = "en") -> tuple[dict, str]:
    """(the spec keys of a benchmark eval, '') or ({}, why not, one line)."""
    names = split_tasks(tasks or [])
    if not names:
        return {}, tr(lang, "eval.bench_no_task")
    missing = lm_eval_missing()
    if missing:
        return {}, f"✖ {missing}"
    shots, why = _number(num_fewshot, int, "num_fewshot", lang)
    if why:
        return {}, why
    share, why = _number(limit, float, "limit", lang)
    if why:
        return {}, why
    return {"tasks": ",".join(names), "num_fewshot": shots, "limit": share, "do_eval": False,
            "do_predict": False}, ""


def apply(flat: dict, bench: dict) -> dict:
    """The eval spec of the tab turned into a benchmark run (the held-out rows' keys dropped)."""
    out = {k: v for k, v in flat.items() if k not in ROW_KEYS}
    out.update(bench)
    return out


def _cell(value, stderr=None) -> str:
    if not isinstance(value, (int, float)):
        return ""
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")


def rows_frame(report: dict) -> pd.DataFrame:
    """One line per task and metric: base and tuned (± standard error) and tuned − base."""
    out = []
    for r in report.get("rows") or []:
        delta = r.get("delta")
        out.append([r.get("task"), r.get("metric"), r.get("n"), _cell(r.get("base"), r.get("base_stderr")),
                    _cell(r.get("tuned"), r.get("tuned_stderr")),
                    f"{delta:+.4f}" if isinstance(delta, (int, float)) else ""])
    return pd.DataFrame(out, columns=COLUMNS)


def summary_md(report: dict, lang: str = "en") -> str:
    if not report:
        return ""
    text = tr(lang, "eval.bench_head", tasks=", ".join(report.get("tasks") or []),
              model=report.get("model"), adapter=report.get("adapter") or "—")
    if report.get("stopped"):
        text += "  \n" + tr(lang, "eval.bench_stopped", why=report["stopped"])
    return text


def refresh(st: dict, lang: str = "en"):
    """Timer tick (and a page's first poll, so a reload shows it again): the benchmark's results once the
    file exists. Outputs: summary, table."""
    parts = (st or {}).get("parts") or []
    if not parts or not (st.get("spec") or {}).get("tasks"):
        return gr.skip(), gr.skip()
    report = read_json_dict(f"{parts[0].get('dir')}/{LM_EVAL_FILE}") if parts[0].get("dir") else {}
    if not report:
        return gr.skip(), gr.skip()
    return summary_md(report, lang), rows_frame(report)


# ------------------------------------------------------------------ the tab's part (build, start, wire)

def build(reg) -> dict:
    """The Benchmarks section's components (inside the tab's accordion)."""
    c: dict = {}
    with gr.Row(equal_height=True):
        c["bench_tasks"] = gr.Dropdown(choices=task_choices(), value=[str(SHIPPED_TASK)], multiselect=True,
                                       allow_custom_value=True, scale=3, label=reg.label("eval-bench_tasks"),
                                       elem_id="eval-bench_tasks")
        reg._add(c["bench_tasks"], "label")
        c["bench_num_fewshot"] = reg.comp(gr.Textbox, "eval-bench_num_fewshot", value="", scale=1)
        c["bench_limit"] = reg.comp(gr.Textbox, "eval-bench_limit", value="", scale=1)
    c["bench_start"] = reg.button("eval-bench_start", variant="primary")
    c["bench_summary"] = gr.Markdown("", elem_id="eval-bench_summary")
    c["bench_rows"] = reg.comp(gr.Dataframe, "eval-bench_rows", value=pd.DataFrame([], columns=COLUMNS),
                               interactive=False)
    return c


def start(st, lang, eval_flat, start_eval, flat_values, tasks, num_fewshot, limit) -> tuple:
    """Run Benchmarks: the top bar's model (+ adapter) through `tuneboard eval` with tasks, as the tab's
    background job (one part: the benchmark scores the base and then the adapter itself). Outputs: the tab's
    view (state, progress, message, metrics, rows, log, timer)."""
    bench, why = bench_flat(tasks, num_fewshot, limit, lang)
    if why:
        return st, gr.skip(), why, gr.skip(), gr.skip(), gr.skip(), gr.skip()
    flat = apply(eval_flat(*flat_values), bench)
    st, message, started = start_eval(st, flat, False, lang)
    if not started:
        return st, gr.skip(), message, gr.skip(), gr.skip(), gr.skip(), gr.skip()
    what = tr(lang, "eval.bench_both") if flat.get("adapter_name_or_path") else tr(lang, "eval.bench_base_only")
    message = tr(lang, "eval.bench_started", tasks=", ".join(split_tasks(bench["tasks"])), what=what)
    return (st, tools.progress_html("starting", 0, None, f"{st['parts'][0]['name']}: loading…"), message,
            pd.DataFrame([], columns=["metric"]), pd.DataFrame([], columns=["#"]), "", gr.Timer(active=True))


def wire(c: dict, view: list, inputs: list, eval_flat, start_eval, lang) -> None:
    """Run Benchmarks with the tab's own inputs (`inputs`: what eval_flat takes) and job (`start_eval`), and
    the results table on the tab's timer (so a reloaded page shows them again)."""
    n = len(inputs)

    def on_start(st, lang_, *values):
        return start(st, lang_, eval_flat, start_eval, values[:n], *values[n:])

    c["bench_start"].click(page_jobs.starting("eval", on_start, 0),
                           [c["state"], lang, *inputs, c["bench_tasks"], c["bench_num_fewshot"], c["bench_limit"]],
                           view)
    c["bench_start"].click(lambda: ("", pd.DataFrame([], columns=COLUMNS)), None,
                           [c["bench_summary"], c["bench_rows"]], show_progress="hidden")
    c["timer"].tick(page_jobs.ticking("eval", refresh, 2), [c["state"], lang], [c["bench_summary"], c["bench_rows"]],
                    show_progress="hidden")
