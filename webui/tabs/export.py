"""Export tab: merge the top bar's adapter into its base model and write safetensors or GGUF, verified by
the backend after writing (`tuneboard export`, a subprocess: the UI never holds a model). A gr.Timer
polls the process output for the `[export k/6]` steps, then shows the report's checks and PASSED/FAILED.

Per-browser state (gr.State): {"job": job dir | None, "export_dir": str, "log": FileTail | None,
"lines": [last lines]}, rebuilt from the job folder by attach() after a page reload (the job's
tool_spec.yaml names the export_dir; an ABORTED marker there says the user stopped it). build() lays out;
wire() binds.
"""
from __future__ import annotations

from pathlib import Path

import gradio as gr
import pandas as pd

from backend.core import allowed, paths
from backend.core.methods import is_adapter
from backend.core.llamacpp import QUANT_TYPES  # k-quants: refused at validate, with how, without llama.cpp
from backend.core.spec import RunSpec, SpecError, validate_spec
from webui import jobs, page_jobs, tools
from webui.i18n import headers, refusal, tr
from webui.tailer import job_log

TICK_S = 1.0
CHECK_COLUMNS = ["check", "result", "detail", "figures"]
LOG_LINES = 200


def empty_checks() -> pd.DataFrame:
    return pd.DataFrame([], columns=CHECK_COLUMNS)


def new_state() -> dict:
    return {"job": None, "export_dir": "", "log": None, "lines": []}


def build(ctx) -> dict:
    reg = ctx.reg
    c: dict = {}
    c["intro"] = reg.markdown("export-intro", elem_classes=["tb-section-note"])
    with gr.Row(equal_height=True):
        c["dir"] = reg.comp(gr.Textbox, "export-dir", value="", scale=4,
                            placeholder_fields={"path": paths.saves_dir() / "exports"})
        c["format"] = reg.dropdown("export-format", ["safetensors", "gguf"], value="safetensors", scale=1)
        c["gguf_type"] = reg.dropdown("export-gguf_type", ["f16", "q8_0", "bf16", "f32", *QUANT_TYPES], value="f16", scale=1,
                                      visible=False)
        c["imatrix"] = reg.comp(gr.Checkbox, "export-imatrix", value=False, scale=1, visible=False,
                                help=("export_imatrix", RunSpec.model_fields["export_imatrix"].description))
        c["size"] = reg.comp(gr.Number, "export-size", value=5, step=0.5, scale=1)
        c["device"] = reg.dropdown("export-device", ["cpu", "auto"], value="cpu", scale=1)
        c["overwrite"] = reg.comp(gr.Checkbox, "export-overwrite", value=False, scale=1)
    with gr.Row():
        c["start"] = reg.button("export-start", variant="primary")
        c["abort"] = reg.button("export-abort", variant="stop")
    c["message"] = gr.Markdown("", elem_id="export-message")
    c["progress"] = gr.HTML(tools.progress_html("idle", 0, 6), elem_id="export-progress")
    c["result"] = gr.Markdown("", elem_id="export-result")
    c["checks"] = reg.comp(gr.Dataframe, "export-checks", value=empty_checks(), interactive=False, wrap=True,
                         column_widths=["14%", "8%", "50%", "28%"])
    c["log"] = reg.comp(gr.Textbox, "export-log", lines=10, max_lines=10, autoscroll=True, interactive=False,
                        elem_classes=["tb-log"])
    c["state"] = gr.State(new_state())
    c["timer"] = gr.Timer(TICK_S, active=False)
    return c


# ------------------------------------------------------------------ handlers (plain functions)

def imatrix_offered(fmt, gguf_type) -> bool:
    """The importance-matrix box shows for the GGUF types llama.cpp's quantizer writes (validate refuses it elsewhere)."""
    return fmt == "gguf" and gguf_type in QUANT_TYPES


def export_flat(model, adapter, method, template, export_dir, fmt, gguf_type, size, device, overwrite,
                imatrix=False) -> dict:
    """The spec of one export, from the top bar and this tab's fields. An empty export dir becomes a
    fresh folder under saves/exports (never an existing one). The GGUF type counts only for a GGUF export, the shard
    size only for safetensors, a ticked importance-matrix box only where it is offered (a hidden box keeps its
    value; validate refuses the other format's key)."""
    adapter = (adapter or "").strip() or None
    if not (export_dir or "").strip():
        base = jobs.model_slug(model or "model")
        name = f"{base}-{Path(adapter).name}" if adapter else base
        export_dir = str(jobs.default_output_dir(name, fmt, root=paths.saves_dir() / "exports"))
    gguf = fmt == "gguf"  # each format's own field only: the other one's hidden box keeps its value
    return {"model_name_or_path": model, "adapter_name_or_path": adapter, "finetuning_type": method,
            "template": template or "auto", "export_dir": str(Path(export_dir).expanduser()),
            "export_format": fmt, **({"export_gguf_type": gguf_type} if gguf else {}),
            **({} if gguf else {"export_size": float(size) if size not in (None, "") else 5}),
            "export_device": device, "export_overwrite": bool(overwrite),
            **({"export_imatrix": True} if imatrix and imatrix_offered(fmt, gguf_type) else {})}


def start_export(st: dict, flat: dict, lang: str = "en") -> tuple[dict, str, bool]:
    """Validate (export_dir under the allowed roots, model / adapter as backend.core.allowed says), then launch
    `tuneboard export`. Returns (state, message, started)."""
    if tools.alive((st or {}).get("job")):
        return st, tr(lang, "msg.export_running"), False
    refused = allowed.spec_refusals(flat)
    if refused:
        return st, "  \n".join(refusal(lang, exc) for exc in refused), False
    if is_adapter(flat.get("finetuning_type")) and not flat.get("adapter_name_or_path"):
        return st, tr(lang, "msg.export_no_adapter"), False
    # the folder first, in the tab's words (naming its Overwrite box): validate refuses it too, naming the spec key
    taken = folder_refusal(flat["export_dir"], flat.get("export_overwrite"), lang)
    if taken:
        return st, taken, False
    try:
        spec = validate_spec(flat)
    except SpecError as exc:
        return st, "✖ " + "; ".join(f"`{f}`: {m}" for f, m in exc.errors), False
    job = tools.new_job_dir("export")
    tools.start("export", job, spec.to_yaml(include_defaults=False))
    st = {"job": str(job), "export_dir": str(spec.export_dir), "log": None, "lines": []}
    return st, tr(lang, "msg.exporting", dir=spec.export_dir), True


def folder_refusal(export_dir: str, overwrite: bool, lang: str = "en") -> str:
    """Why the export could not write to its folder, in the tab's words, or "": a file there, or a folder with
    something in it while the Overwrite box is not ticked (validate and `tuneboard export` refuse both:
    backend/core/export_rules.py; refused here, nothing is launched)."""
    out = Path(export_dir).expanduser()
    if out.exists() and not out.is_dir():
        return tr(lang, "msg.export_dir_file", dir=out)
    if not overwrite and out.is_dir() and any(out.iterdir()):
        return tr(lang, "msg.export_not_empty", dir=out, overwrite=tr(lang, "export-overwrite"))
    return ""


def job_report(st: dict) -> dict:
    """The export report in the state's export_dir when this job wrote it: one older than the job's launch is an
    earlier export's (this one failed before writing its own) and is not shown as this one's checks."""
    report = tools.read_report(st.get("export_dir"))
    launched = jobs.read_json(Path(st["job"]) / jobs.LAUNCH_FILE).get("launched_at")
    try:
        written = (Path(st["export_dir"]) / tools.EXPORT_REPORT).stat().st_mtime
    except (OSError, KeyError, TypeError):
        return report
    # a second's slack: the file system's clock ticks coarser than time.time(); a re-export takes longer to press
    return report if not isinstance(launched, (int, float)) or written >= launched - 1.0 else {}


def attach(job_dir: str | None) -> dict:
    """The tab's state for an existing job folder (a page reload or a UI restart): its log is read again
    from the start by the next poll."""
    if not job_dir:
        return new_state()
    spec = tools.read_tool_spec(job_dir)
    return {"job": str(job_dir), "export_dir": str(spec.get("export_dir") or ""), "log": None, "lines": []}


def attached_message(st: dict, lang: str = "en") -> str:
    return tr(lang, "msg.export_attached", dir=st.get("export_dir"))


def abort(st: dict, lang: str = "en") -> tuple[dict, str]:
    """Kills the export's process group (SIGTERM, then SIGKILL) and leaves the ABORTED marker in the job
    folder. Returns (state, message)."""
    job = (st or {}).get("job")
    if tools.stop(job):
        tools.mark_aborted(job)
        st["aborted"] = True
        return st, tr(lang, "msg.export_stopping")
    return st, tr(lang, "msg.export_none")


def poll(st: dict, lang: str = "en") -> tuple:
    """One timer tick: new output lines -> (state, progress html, result md, checks df|skip, log, timer)."""
    job = (st or {}).get("job")
    if not job:
        return st, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=False)
    log = job_log(st, job, LOG_LINES)
    running = tools.alive(job)
    aborted = st.get("aborted") or tools.was_aborted(job)
    k, n, step = tools.export_progress(st["lines"])
    outcome, line = tools.export_outcome(st["lines"])
    if aborted and outcome != "passed":
        outcome = None  # what a stopped process printed on its way out is not the result
    if running:
        state = "running"
    else:
        state = outcome or ("aborted" if aborted else "failed")
        k = n if outcome == "passed" else k
    words = tools.export_step_words(k, step, lang)
    bar = tools.progress_html(state, k, n, tr(lang, "msg.export_step", k=k, n=n, step=words) if step
                              else tr(lang, "msg.export_starting"), lang)
    if running:
        return st, bar, "", gr.skip(), log, gr.Timer(active=True)
    report = job_report(st)
    rows = tools.checks_rows(report, st["lines"], lang)
    if outcome == "passed":
        result = f"✓ **{tools.export_outcome_words(outcome, line, lang)}**"
    elif outcome == "failed":
        result = f"✗ **{tools.export_outcome_words(outcome, line, lang)}**"
    elif aborted:
        result = tr(lang, "msg.export_aborted")
    else:
        result = tr(lang, "msg.export_no_result")
    for w in report.get("warnings") or []:
        result += f"\n\n⚠ {w}"
    if (report.get("source") or {}).get("weights"):  # the bundled default is a dequantized 4-bit GGUF: say so
        result += f"\n\nℹ {report['source']['weights']}"
    for adapter, checkpoint in ((report.get("source") or {}).get("promoted") or {}).items():  # tuneboard promote
        result += "\n\nℹ " + tr(lang, "msg.export_promoted", adapter=adapter, checkpoint=checkpoint)
    return st, bar, result, headers(lang, pd.DataFrame(rows, columns=CHECK_COLUMNS)), log, gr.Timer(active=False)


def ended_message(st: dict, lang: str = "en") -> str:
    """The message line once the export has ended (the result line below says how)."""
    return tr(lang, "msg.export_ended", dir=st.get("export_dir"))


def wire(ctx, c: dict) -> None:
    top = ctx.top
    c["format"].change(lambda f, g: (gr.update(visible=f == "gguf"), gr.update(visible=imatrix_offered(f, g))),
                       [c["format"], c["gguf_type"]], [c["gguf_type"], c["imatrix"]], show_progress="hidden")
    c["gguf_type"].change(lambda f, g: gr.update(visible=imatrix_offered(f, g)), [c["format"], c["gguf_type"]],
                          [c["imatrix"]], show_progress="hidden")
    inputs = [top["model_name_or_path"], top["adapter_name_or_path"], top["finetuning_type"], top["template"],
              c["dir"], c["format"], c["gguf_type"], c["size"], c["device"], c["overwrite"], c["imatrix"]]
    view = [c["state"], c["progress"], c["result"], c["checks"], c["log"], c["timer"]]

    def on_start(st, lang, *values):
        """Inputs: state, language, top bar (model, adapter, method, template), export fields. Outputs:
        message, then the view (state, progress, result, checks, log, timer)."""
        st, message, started = start_export(st, export_flat(*values), lang)
        if not started and tools.alive((st or {}).get("job")):  # the export that runs keeps its view
            return message, st, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        if not started:  # refused: an earlier export's result and checks are not this one's
            return (message, new_state(), tools.progress_html("idle", 0, 6, lang=lang), "",
                    headers(lang, empty_checks()), "", gr.Timer(active=False))
        return (message, st, tools.progress_html("starting", 0, 6, tr(lang, "msg.export_starting"), lang), "",
                headers(lang, empty_checks()), "",
                gr.Timer(active=True))

    c["start"].click(page_jobs.starting("export", on_start, 1), [c["state"], top["lang"], *inputs],
                     [c["message"], *view], api_name="export_start")

    def on_abort(st, lang):
        """Kills the export's process group (SIGTERM, then SIGKILL). Inputs: state, language. Outputs:
        message, state."""
        st, message = abort(st, lang)
        return message, st

    c["abort"].click(on_abort, [c["state"], top["lang"]], [c["message"], c["state"]])
    def tick(st, lang):
        """poll(), and the message line cleared once the export has ended ("Exporting to ..." / "Stopping
        ..." are not left on screen next to the result). Inputs: state. Outputs: the view, message."""
        out = poll(st, lang)
        ended = bool((st or {}).get("job")) and not tools.alive(st["job"])
        return (*out, ended_message(st, lang) if ended else gr.skip())

    c["timer"].tick(page_jobs.ticking("export", tick, len(view) + 1), [c["state"], top["lang"]],
                    [*view, c["message"]], show_progress="hidden")

    def relabel_idle(st, lang):
        """Before any export: the idle card and the empty checks table in the new language. Inputs: state,
        language. Outputs: progress, checks."""
        if (st or {}).get("job"):
            return gr.skip(), gr.skip()
        return tools.progress_html("idle", 0, 6, lang=lang), headers(lang, empty_checks())

    top["lang"].change(relabel_idle, [c["state"], top["lang"]], [c["progress"], c["checks"]], show_progress="hidden")
