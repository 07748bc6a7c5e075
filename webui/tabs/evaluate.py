"""Evaluate tab: run `tuneboard eval` on the top bar's model (+ adapter) over held-out rows, as a
subprocess; show its progress (status.json: step = rows predicted), the metrics (eval_results.json) and
the rows (generated_predictions.jsonl: prompt, reference, prediction, per-row score), worst first on
request. "Compare base vs tuned" runs the same rows twice, with and without the adapter, one after the
other (two processes at once would only halve the speed of each), and shows both side by side.

Per-browser state (gr.State): {"parts": [{"name": "tuned"|"base", "dir": str, "adapter": str|None,
"launched": bool}], "spec": flat dict, "aborted": bool, "rows": [...], "results": {name: dict}}.
"""
from __future__ import annotations

from pathlib import Path

import gradio as gr
import pandas as pd

from backend.spec import SpecError, validate_spec
from webui import choices, jobs, tools
from webui.tailer import FileTail

TICK_S = 1.0
LOG_LINES = 120


def new_state() -> dict:
    return {"parts": [], "spec": {}, "aborted": False, "rows": {}, "results": {}, "lines": [], "log": None,
            "log_part": None}


def empty_frame(columns) -> pd.DataFrame:
    return pd.DataFrame([], columns=columns)


def build(reg) -> dict:
    c: dict = {}
    c["intro"] = reg.markdown("eval-intro", elem_classes=["tb-section-note"])
    names = choices.dataset_names()
    with gr.Row(equal_height=True):
        c["dataset"] = gr.Dropdown(choices=names, value=["identity"] if "identity" in names else [],
                                   multiselect=True, allow_custom_value=True, scale=3,
                                   label=reg.label("eval-dataset"), elem_id="eval-dataset")
        reg._add(c["dataset"], "label")
        c["max_samples"] = reg.comp(gr.Number, "eval-max_samples", value=20, precision=0, minimum=1, scale=1)
        c["max_new_tokens"] = reg.comp(gr.Number, "eval-max_new_tokens", value=128, precision=0, minimum=1,
                                       scale=1)
        c["compare"] = reg.comp(gr.Checkbox, "eval-compare", value=False, scale=1)
    with gr.Row():
        c["start"] = reg.button("eval-start", variant="primary")
        c["abort"] = reg.button("eval-abort", variant="stop")
    c["message"] = gr.Markdown("", elem_id="eval-message")
    c["progress"] = gr.HTML(tools.progress_html("idle", 0, None), elem_id="eval-progress")
    c["metrics"] = reg.comp(gr.Dataframe, "eval-metrics", value=empty_frame(["metric"]), interactive=False)
    c["worst_first"] = reg.comp(gr.Checkbox, "eval-worst_first", value=False)
    c["rows"] = reg.comp(gr.Dataframe, "eval-rows", value=empty_frame(["#"]), interactive=False, wrap=True,
                         max_chars=80, max_height=520)
    with reg.accordion("eval-group-log", open=False):
        c["log"] = reg.comp(gr.Textbox, "eval-log", lines=10, max_lines=10, autoscroll=True, interactive=False,
                            elem_classes=["tb-log"])
    c["state"] = gr.State(new_state())
    c["timer"] = gr.Timer(TICK_S, active=False)
    return c


# ------------------------------------------------------------------ handlers (plain functions)

def eval_flat(model, adapter, method, quant, template, datasets, max_samples, max_new_tokens) -> dict:
    """The spec of one eval from the top bar and this tab (greedy decoding: scores that do not move between
    two runs of the same rows)."""
    if isinstance(datasets, str):
        datasets = [datasets]
    return {"model_name_or_path": model, "adapter_name_or_path": (adapter or "").strip() or None,
            "finetuning_type": method, "quantization_bit": None if quant in (None, "", "none") else int(quant),
            "template": template or "auto", "eval_dataset": ",".join(d for d in datasets or [] if d) or None,
            "max_samples": int(max_samples) if max_samples not in (None, "") else None,
            "max_new_tokens": int(max_new_tokens) if max_new_tokens not in (None, "") else 128,
            "do_eval": True, "do_predict": True, "do_sample": False}


def plan(flat: dict, compare: bool) -> tuple[list[dict] | None, str]:
    """The eval parts to run ([tuned] / [base] / [tuned, base]) or (None, why not)."""
    if not flat.get("eval_dataset"):
        return None, "⛔ Pick at least one dataset to evaluate on."
    if compare and not flat.get("adapter_name_or_path"):
        return None, "⛔ Compare needs an adapter: pick one in the top bar (**Adapter / checkpoint**)."
    try:
        validate_spec(flat)
    except SpecError as exc:
        return None, "⛔ " + "; ".join(f"`{f}`: {m}" for f, m in exc.errors)
    job = tools.new_job_dir("eval")
    adapter = flat.get("adapter_name_or_path")
    parts = [{"name": "tuned" if adapter else "base", "dir": str(job / ("tuned" if adapter else "base")),
              "adapter": adapter, "launched": False}]
    if compare:
        parts.append({"name": "base", "dir": str(job / "base"), "adapter": None, "launched": False})
    return parts, ""


def launch_part(st: dict, part: dict) -> None:
    flat = dict(st["spec"], adapter_name_or_path=part["adapter"], output_dir=part["dir"])
    spec = validate_spec(flat)
    tools.start("eval", part["dir"], spec.to_yaml(include_defaults=False))
    part["launched"] = True


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


def rows_frame(st: dict, worst_first: bool) -> pd.DataFrame:
    """One line per row: prompt, reference, prediction, per-row score (rouge-l) and, comparing, the base
    model's prediction and score beside it. Worst first = lowest score first."""
    parts = st["parts"]
    cols = ["#", "prompt", "reference", "prediction", tools.ROW_SCORE, "bleu-4", "exact"]
    if len(parts) > 1:
        cols += ["base prediction", f"base {tools.ROW_SCORE}"]
    main = st["rows"].get(parts[0]["name"], []) if parts else []
    other = {r.get("index"): r for r in st["rows"].get(parts[1]["name"], [])} if len(parts) > 1 else {}
    order = sorted(main, key=tools.row_score) if worst_first else main
    out = []
    for r in order:
        line = [r.get("index"), tools.short(r.get("prompt")), tools.short(r.get("label")),
                tools.short(r.get("predict")), round(tools.row_score(r), 2), _fmt(r.get("bleu-4")),
                "✓" if r.get("exact_match") else ""]
        if len(parts) > 1:
            b = other.get(r.get("index"), {})
            line += [tools.short(b.get("predict")), round(tools.row_score(b), 2) if b else ""]
        out.append(line)
    return pd.DataFrame(out, columns=cols)


def poll(st: dict, worst_first: bool) -> tuple:
    """Timer tick: launch the next part when the previous one ended, read progress.
    Outputs: state, progress, message, metrics, rows, log, timer."""
    if not st or not st.get("parts"):
        return st, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=False)
    part = _current(st)
    if st["aborted"]:
        if part is None or not tools.alive(part["dir"]):
            return _finish(st, worst_first)
        return st, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=True)
    # a part that failed stops the chain
    for p in st["parts"]:
        if p["launched"] and not tools.alive(p["dir"]):
            s = part_status(p)
            if s.get("state") != "completed":
                return _finish(st, worst_first, failed=p)
    if part is None:
        return _finish(st, worst_first)
    if not part["launched"]:
        launch_part(st, part)
    log = _read_log(st, part)
    s = part_status(part)
    total, done = s.get("total_steps"), s.get("step") or 0
    n = len(st["parts"])
    idx = st["parts"].index(part) + 1
    label = f"{part['name']} ({idx}/{n}): " + (f"predicting row {done} of {total}" if total else "loading…")
    return (st, tools.progress_html("running", int(done), total, label), gr.skip(), gr.skip(), gr.skip(), log,
            gr.Timer(active=True))


def _read_log(st: dict, part: dict) -> str:
    if st.get("log_part") != part["dir"]:
        st["log_part"] = part["dir"]
        st["log"] = FileTail(str(Path(part["dir"]) / jobs.PROCESS_LOG))
        st["lines"] = []
    lines = st["lines"] + [tools.clean_line(x) for x in st["log"].read_lines()]
    st["lines"] = lines[-LOG_LINES:]
    return "\n".join(st["lines"])


def _finish(st: dict, worst_first: bool, failed: dict | None = None) -> tuple:
    for p in st["parts"]:
        st["results"][p["name"]] = tools.read_results(p["dir"])
    st["rows"] = {p["name"]: tools.read_predictions(p["dir"]) for p in st["parts"]}
    shown = failed or next((p for p in reversed(st["parts"]) if p["launched"]), st["parts"][0])
    log = _read_log(st, shown)
    if failed is not None:
        err = part_status(failed).get("error") or "the eval process ended without a result (see the log)"
        state, message = "failed", f"✗ **{failed['name']} eval failed**: {err}"
    elif st["aborted"]:
        state, message = "aborted", "■ **Eval aborted.**"
    else:
        state = "completed"
        n_rows = len(st["rows"].get(st["parts"][0]["name"], []))
        message = f"✓ **Eval done**: {n_rows} rows, results in `{Path(st['parts'][0]['dir']).parent}`"
    total = max((len(v) for v in st["rows"].values()), default=0)
    bar = tools.progress_html(state, total if state == "completed" else 0, total or None,
                              " + ".join(p["name"] for p in st["parts"]))
    st["parts_done"] = True
    return (st, bar, message, metrics_frame(st), rows_frame(st, worst_first), log, gr.Timer(active=False))


def wire(c: dict, top: dict) -> None:
    inputs = [top["model_name_or_path"], top["adapter_name_or_path"], top["finetuning_type"],
              top["quantization_bit"], top["template"], c["dataset"], c["max_samples"], c["max_new_tokens"]]
    view = [c["state"], c["progress"], c["message"], c["metrics"], c["rows"], c["log"], c["timer"]]

    def on_start(st, compare, *values):
        """Inputs: state, compare, top bar (model, adapter, method, quantization, template), datasets,
        max samples, max new tokens. Outputs: the view."""
        if st and any(tools.alive(p["dir"]) for p in st.get("parts", [])):
            return (st, gr.skip(), "An eval is already running in this tab: wait for it or abort it.",
                    gr.skip(), gr.skip(), gr.skip(), gr.skip())
        flat = eval_flat(*values)
        parts, why = plan(flat, bool(compare))
        if parts is None:
            return st, gr.skip(), why, gr.skip(), gr.skip(), gr.skip(), gr.skip()
        st = new_state()
        st["parts"], st["spec"] = parts, flat
        launch_part(st, parts[0])
        what = " and ".join(p["name"] for p in parts)
        return (st, tools.progress_html("starting", 0, None, f"{parts[0]['name']}: loading…"),
                f"Evaluating {what} on `{flat['eval_dataset']}`…", empty_frame(["metric"]), empty_frame(["#"]),
                "", gr.Timer(active=True))

    c["start"].click(on_start, [c["state"], c["compare"], *inputs], view)

    def on_abort(st):
        """Stops the running eval process (and any part still to come). Outputs: message, state."""
        if not st or not st.get("parts"):
            return "No eval is running.", st
        st["aborted"] = True
        stopped = any(tools.stop(p["dir"]) for p in st["parts"])
        return ("Stopping the eval…" if stopped else "No eval is running."), st

    c["abort"].click(on_abort, [c["state"]], [c["message"], c["state"]])
    c["timer"].tick(poll, [c["state"], c["worst_first"]], view, show_progress="hidden")
    c["worst_first"].change(lambda st, w: rows_frame(st, w) if st and st.get("parts") else gr.skip(),
                            [c["state"], c["worst_first"]], [c["rows"]], show_progress="hidden")
