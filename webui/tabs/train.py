"""Train tab: the field-table form (accordions), Preview / Save / Load / Start / Abort, and the live view
of the attached run (progress, loss and lr plots, log tail, final metrics). build() lays out; wire() binds.

Per-browser state (`gr.State`): {"run_dir": str | None, "tail": RunTail | None}. Everything else is read
from the run directory on each timer tick through the incremental tailer."""
from __future__ import annotations

import hashlib
import html
import time
from pathlib import Path

import gradio as gr

from backend.core import allowed, paths
from backend.core.rundir import PHASE_SAVING, PLOT_FILE, unique_dir
from backend.core.spec import SpecError, load_spec, read_spec_file
from backend.stages import STAGES
from webui import choices, data_check, jobs, live, preflight
from webui import datasets as D
from webui import fields as F
from webui.form import (SPEC_SUFFIXES, check, collect, dataset_for_stage, error_updates, errors_md, looks_like_spec,
                         preset_flat, preview_of, save_target_check, spec_to_inputs)
from webui.i18n import refusal, tr
from webui.plots import empty_loss, empty_lr, legend_update, plot_axes, series_of
from webui.tailer import RunTail, run_state
from webui import choices
from backend.core.rundir import checkpoints
from backend.core import launch

TICK_S = 1.5


# Spec fields whose widget is a dropdown of the registered datasets that fit the stage, still taking a typed
# value (a comma-separated list, a set registered later); its value stays the spec's string.
DATASET_PICKERS = ("dataset",)


def _widget(reg, row: F.FieldRow, value):
    kw = dict(help=(row.name, row.description),
              visible=row.visible_for(F.PRESET["stage"], F.PRESET["finetuning_type"]))
    if row.name in DATASET_PICKERS:
        return reg.comp(gr.Dropdown, row.elem_id, value=value, allow_custom_value=True,
                        choices=D.fitting_datasets(F.PRESET["stage"], choices.dataset_info()), **kw)
    if row.kind == "checkbox":
        return reg.comp(gr.Checkbox, row.elem_id, value=value, **kw)
    if row.kind in ("dropdown", "tristate"):
        return reg.dropdown(row.elem_id, F.dropdown_ids(row), value=value,
                            allow_custom_value=row.custom, **kw)
    if row.kind in ("int", "float"):
        # Bounds are not given to gr.Number: it would reject the whole event with a generic error; the
        # spec checks them and the message appears next to the field instead. No precision either: precision=0
        # rounded a typed 2.5 to 2 and the run took it silently; the spec names a fraction in a whole-number key.
        num = {}
        if "step" in F.OVERRIDES.get(row.name, {}):
            num["step"] = F.OVERRIDES[row.name]["step"]
        return reg.comp(gr.Number, row.elem_id, value=value, **num, **kw)
    return reg.comp(gr.Textbox, row.elem_id, value=value, lines=1,
                    placeholder=F.OVERRIDES.get(row.name, {}).get("placeholder", ""), **kw)


def plot_axes_updates(lang: str = "en") -> list:
    """Outputs of a language switch for the live view's plots: loss, lr, then each stage plot."""
    return [gr.update(**plot_axes(p, lang)) for p in ("loss_plot", "lr_plot", *live.plot_names())]


def build(ctx) -> dict:
    """Layout only (the tab contract: webui/tab_context.py). ctx.top: the shared top-bar components (field
    name -> component, plus "booster"). Returns the components wire() needs."""
    reg, top = ctx.reg, ctx.top
    c: dict = {"top": top}
    rows = F.form_rows()
    names = [r.name for r in rows]
    values = F.preset_values(names)
    c["fields"] = {}
    with gr.Row(equal_height=False):
        with gr.Column(scale=5, min_width=480):
            by_name = dict(zip(names, zip(rows, values)))
            basic = [by_name[n] for n in F.BASIC_FIELDS if n in by_name]
            with gr.Group(elem_id="train-basic"):
                # stage and dataset (long choice labels) two to a row, the numbers three: four to a row cut
                # "Supervised fine-tuning" and pushed a scrollbar under the fields
                for chunk in (basic[:2], basic[2:5], basic[5:8], basic[8:]):
                    if chunk:
                        with gr.Row():
                            for row, value in chunk:
                                c["fields"][row.name] = _widget(reg, row, value)
            for group in F.ACCORDIONS:
                group_rows = [(r, v) for r, v in zip(rows, values)
                              if r.group == group and r.name not in F.BASIC_FIELDS]
                if not group_rows:
                    continue
                with reg.accordion(f"train-group-{group}", open=group in F.OPEN_ACCORDIONS):
                    for i in range(0, len(group_rows), 3):
                        with gr.Row():
                            for row, value in group_rows[i:i + 3]:
                                c["fields"][row.name] = _widget(reg, row, value)
                    if group == "distributed":  # the GPUs nvidia-smi lists; hidden on a machine without
                        gpus = device_choices()
                        c["devices"] = reg.comp(gr.CheckboxGroup, "train-devices", choices=gpus, value=[],
                                                visible=bool(gpus))
            with reg.accordion("train-group-passthrough", open=False):
                c["extra_args"] = reg.comp(gr.Code, F.EXTRA_ARGS_ID, language="yaml", value="", lines=4)
        with gr.Column(scale=4, min_width=420):
            # The top bar's adapter is trained further by Start: said here, with a way out (picked to chat
            # with it, it would otherwise ride silently into the next run).
            with gr.Row(equal_height=True, elem_id="train-adapter_row"):
                c["adapter_note"] = gr.HTML("", elem_id="train-adapter_note", visible=False)
                c["adapter_clear"] = reg.button("train-adapter_clear", size="sm", visible=False, scale=0,
                                                min_width=150)
            with gr.Row():
                c["start"] = reg.button("train-start", variant="primary")
                c["abort"] = reg.button("train-abort", variant="stop")
                c["preview"] = reg.button("train-preview", variant="secondary")
            c["errors"] = gr.Markdown("", elem_id="train-errors", elem_classes=["tb-errors"], visible=False)
            c["message"] = gr.Markdown("", elem_id="train-message")
            # right under the buttons: Preview opens where it was clicked
            with reg.accordion("train-group-preview", open=False) as acc:
                c["preview_acc"] = acc
                c["preview_cmd"] = reg.comp(gr.Textbox, "train-preview_cmd", lines=2, interactive=False)
                c["preview_yaml"] = reg.comp(gr.Code, "train-preview_yaml", language="yaml", interactive=False)
            with gr.Row(equal_height=False):  # the formula's estimate, and a real measurement on demand
                c["preflight"] = gr.HTML(preflight.summary_md(preset_flat()), elem_id="train-preflight")
                with gr.Column(scale=0, min_width=170):
                    c["measure"] = reg.button("train-measure", size="sm")
                    c["measure_abort"] = reg.button("train-measure_abort", size="sm", variant="stop")
            c["probe"] = gr.HTML("", elem_id="train-probe")
            c["probe_state"] = gr.State({})
            c["probe_timer"] = gr.Timer(2.0, active=False)
            c["progress"] = gr.HTML(live.progress_html(live.progress([], {}), "idle"), elem_id="train-progress")
            c["loss_plot"] = reg.comp(gr.LinePlot, "train-loss_plot", value=empty_loss(), x="step", y="value",
                                      color="series", height=340, **plot_axes("loss_plot"))
            with gr.Row():
                c["log_scale"] = reg.comp(gr.Checkbox, "train-log_scale", value=False, scale=1)
            # The stage's own curves (rewards, accuracy, kl, ...) as backend/stages declares them: one
            # plot per declared name, shown while the attached run's stage has it (none for pt; sft's task metric
            # once the run has logged it).
            c["stage_plots"] = {
                name: reg.comp(gr.LinePlot, live.plot_elem_id(name), value=empty_loss(), x="step", y="value",
                               color="series", height=300, **plot_axes(name), visible=False,
                               elem_classes=["tb-plot"])
                for name in live.plot_names()}
            # GRPO: what the model writes, with its rewards (the newest completions of the attached run)
            c["completions"] = reg.comp(gr.Dataframe, "train-completions", value=live.completions_frame("/nonexistent"),
                                        interactive=False, wrap=True, visible=False, max_height=360,
                                        column_widths=["8%", "10%", "22%", "60%"])
            c["lr_plot"] = reg.comp(gr.LinePlot, "train-lr_plot", value=empty_lr(), x="step", y="lr",
                                    height=200, **plot_axes("lr_plot"))
            c["log"] = reg.comp(gr.Textbox, "train-log", lines=12, max_lines=12, autoscroll=True,
                                interactive=False, elem_classes=["tb-log"])
            c["final"] = gr.Markdown("", elem_id="train-final")
            # no label badge: it sat over the figure's own title (the picture names itself)
            c["loss_image"] = reg.comp(gr.Image, "train-loss_image", visible=False, interactive=False,
                                       type="filepath", height=320, show_label=False)
            with reg.accordion("train-group-files", open=False):
                c["spec_path"] = reg.comp(gr.Textbox, "train-spec_path",
                                          value=str(paths.saves_dir() / "specs" / "my_run.yaml"))
                with gr.Row():
                    c["save"] = reg.button("train-save", size="sm")
                    c["load"] = reg.button("train-load", size="sm")
                    c["spec_overwrite"] = reg.comp(gr.Checkbox, "train-spec_overwrite", value=False)
    c["timer"] = gr.Timer(TICK_S, active=False)
    c["names"] = names
    return c


N_PLOTS = len(live.plot_names())
# live view outputs between the state and the timer: progress, loss, lr, stage plots, completions table, log,
# final, image, adapter picker, message
N_VIEW = 9 + N_PLOTS


def adapter_banner(adapter: str | None, lang: str = "en") -> tuple:
    """The Train tab's "continue training from adapter X" line and its clear button (hidden without an
    adapter). Returns (note update, button update)."""
    adapter = (adapter or "").strip()
    if not adapter:
        return gr.update(value="", visible=False), gr.update(visible=False)

    label = dict((v, k) for k, v in choices.adapter_pairs()).get(adapter) or Path(adapter).name
    note = (f'<div class="tb-adapter-note" title="{html.escape(adapter)}">↪ <b>{html.escape(tr(lang, "msg.continue_adapter"))}</b> '
            f'{html.escape(label)}<div class="tb-adapter-path">{html.escape(adapter)}</div></div>')
    return gr.update(value=note, visible=True), gr.update(visible=True)


def spec_total(spec: dict) -> int | None:
    """The step count a spec fixes in advance (max_steps), None when the epochs decide it."""
    value = spec.get("max_steps")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def ended_message(run_dir: str, state: str, status: dict, lang: str = "en") -> str:
    """What the message line says once a run has ended (replacing "Started ..." / "Stopping ...")."""
    name = _run_name(run_dir)
    step, total = status.get("step") or 0, status.get("total_steps")
    at = tr(lang, "msg.at_step", step=step, total=total) if total else f"{tr(lang, 'card.step')} {step}"
    if state == "completed":
        held = status.get("final_metrics") or {}
        loss, smoothed, low = (held.get(k) for k in ("final_loss", "smoothed_loss", "min_loss"))
        tail = tr(lang, "msg.final_loss", loss=f"{loss:.4g}") if isinstance(loss, (int, float)) else ""
        if tail and isinstance(smoothed, (int, float)) and isinstance(low, (int, float)):  # one batch is noise
            tail += tr(lang, "msg.loss_summary", smoothed=f"{smoothed:.4g}", low=f"{low:.4g}")
        return tr(lang, "msg.completed", name=name, at=at, loss=tail)
    if state == "aborted":
        saved = checkpoints(Path(run_dir))
        kept = tr(lang, "msg.ckpt_saved", ckpt=saved[-1].name) if saved else tr(lang, "msg.no_ckpt")
        return tr(lang, "msg.aborted", name=name, at=at, kept=kept)
    if state.startswith("failed"):
        return tr(lang, "msg.failed", name=name, state=live.state_word(state, lang),
                  error=status.get("error") or tr(lang, "msg.see_log"))
    return ""


def run_stage(run_dir: str) -> str | None:
    """The stage of a run: from its run_spec.yaml, or from its queue entry while it waits there."""
    stage = jobs.read_spec_dict(Path(run_dir)).get("stage")
    if stage is None and (Path(run_dir) / jobs.SPEC_FILE).exists():
        return "sft"  # the spec's default
    if stage is None:
        stage = next((e.spec.get("stage", "sft") for e in jobs.JobQueue().entries() if e.run_dir == run_dir), None)
    return stage


def stage_plot_updates(st: dict, records: list[dict]) -> list:
    """One update per stage plot (live.plot_names() order): the attached run's stage's plots with their
    series, the others hidden. Records each shown plot's series in st["series"] (for the legend)."""
    plots = live.stage_plots(st.get("stage"))
    when_logged = live.plots_when_logged(st.get("stage"))
    out = []
    for name in live.plot_names():
        frame = live.metric_frame(records, plots[name]) if name in plots else None
        if frame is not None and (len(frame) or name not in when_logged):
            st.setdefault("series", {})[name] = series_of(frame)
            out.append(gr.update(value=frame, visible=True))
        else:
            out.append(gr.update(visible=False))
    return out


def view_updates(st: dict, log_scale: bool, force_plot: bool = False, lang: str = "en") -> tuple:
    """Poll the attached run; returns (state, progress html, loss df|skip, lr df|skip, one update per stage
    plot, log, final md, image update, adapter picker update, timer update). When the run has just ended,
    the top bar's adapter picker is re-listed so its new adapter and checkpoints can be picked at once."""
    run_dir = st.get("run_dir")
    if run_dir and gone(run_dir):  # a queued run taken off the queue (here or in another tab): show what runs
        reattach_active(st)
        run_dir = st.get("run_dir")
    if not run_dir:  # the idle card, in the page's language
        idle = live.progress_html(live.progress([], {}), "idle", lang=lang)
        return (st, idle, *([gr.skip()] * (N_VIEW - 1)), gr.Timer(active=False))
    tail: RunTail = st.get("tail") or RunTail(run_dir)
    st["tail"] = tail
    if st.get("stage") is None:
        st["stage"] = run_stage(run_dir)
    if not st.get("spec"):
        st["spec"] = jobs.read_spec_dict(Path(run_dir)) or next(
            (e.spec for e in jobs.JobQueue().entries() if e.run_dir == run_dir), {})
    before = len(tail.records)
    status = tail.poll()
    rs = jobs.run_state(run_dir)
    queued = any(e.run_dir == run_dir for e in jobs.JobQueue().entries())
    state = "queued" if queued and not rs.alive else rs.state
    if state == "unknown" and not Path(run_dir).exists():
        state = "queued" if queued else "unknown"
    p = live.progress(tail.records, status)
    if not p["total"] and state not in ("completed",):
        p["total"] = spec_total(st["spec"])  # known before the trainer says it (max_steps)
    name = _run_name(run_dir)
    doing = ""
    if state == "queued":
        doing = tr(lang, "phase.queued")
    elif rs.active and (not tail.records or (status or {}).get("phase") == PHASE_SAVING):
        # what the process is in: from the phase it writes to status.json, the log lines before that
        doing = live.phase(list(tail.log_tail), p["total"], st["spec"].get("model_name_or_path", ""), lang,
                           status=status or rs.status)
    prog = live.progress_html(p, state, name, doing, lang, phase_share=live.tokenizing_share(status or rs.status))
    # a run attached a moment ago is drawn once even with no record yet (the plots still hold the last run's)
    changed = force_plot or len(tail.records) != before or st.get("plotted") != run_dir
    st["plotted"] = run_dir
    loss = live.loss_frame(tail.records, log_scale, lang=lang) if changed else gr.skip()
    if changed:
        st.setdefault("series", {})["loss"] = series_of(loss)
    lr = live.lr_frame(tail.records) if changed else gr.skip()
    plots = stage_plot_updates(st, tail.records) if changed else [gr.skip()] * N_PLOTS
    completions = completions_update(st, run_dir) if changed else gr.skip()
    done = not rs.active and state != "queued"
    final = live.final_metrics_md(status) if done else ""
    if tail.malformed:
        final += f"\n\n_{tail.malformed} malformed log line(s) skipped_"
    png = Path(run_dir) / PLOT_FILE
    image = gr.update(value=str(png), visible=True) if done and png.exists() else gr.update(visible=False)
    adapters = adapter_picker_update(lang) if done else gr.skip()
    message = gr.skip()
    if done and st.get("announced") != state:  # once per end: the message says how the run ended
        st["announced"] = state
        # a run without an end to tell (a queued run Abort took off the queue) keeps the message it has
        message = ended_message(run_dir, state, rs.status or status, lang) or gr.skip()
    return (st, prog, loss, lr, *plots, completions, tail.log_text(), final, image, adapters, message,
            gr.Timer(active=not done))


def completions_update(st: dict, run_dir: str):
    """The completions table: shown for a run of a stage that generates while it trains (grpo, rloo: its newest
    completions and rewards), hidden otherwise."""
    stage = STAGES.get(st.get("stage") or "")
    if stage is None or not stage.generates:
        return gr.update(visible=False)
    return gr.update(value=live.completions_frame(run_dir), visible=True)


def legend_updates(st: dict, plot_keys: list[str]) -> list:
    """One update per plot key ("loss", then the stage plots): legend_update where the plot's series
    changed since its colours were last set, else a skip. Updates st["legend"] in place."""
    series, legend = st.get("series") or {}, st.setdefault("legend", {})
    out = []
    for key in plot_keys:
        if key not in series or series[key] == legend.get(key):
            out.append(gr.skip())
        else:
            legend[key] = series[key]  # in place, like the ticks
            out.append(legend_update(series[key]))
    return out


def adapter_picker_update(lang: str = "en"):
    """Fresh choices for the top bar's adapter / checkpoint picker (the value is kept), its "none" choice in
    `lang`."""

    return gr.update(choices=choices.adapter_pairs(lang=lang))


def device_choices() -> list[tuple[str, str]]:
    """The device picker's choices: (label, index) for each GPU `nvidia-smi -L` lists (no torch in the UI);
    [] where there is none, and the picker stays hidden."""

    return [(line.split(" (UUID")[0], line.split(":", 1)[0].removeprefix("GPU ").strip())
            for line in launch.list_gpus()]


def devices_env(devices) -> dict | None:
    """The launched run's environment for the picked GPU indices; None (inherit) when none is picked."""
    picked = [str(d) for d in devices or []]
    return {"CUDA_VISIBLE_DEVICES": ",".join(picked)} if picked else None


def _run_name(run_dir: str) -> str:
    try:
        return str(Path(run_dir).relative_to(paths.saves_dir()))
    except ValueError:
        return run_dir


def unique_run_dir(base: Path) -> Path:
    """`base`, or base-2, base-3, ... when a run (or a queued one) already has it."""
    return unique_dir(base, taken={e.run_dir for e in jobs.JobQueue().entries()})


def attach(run_dir: str | None) -> dict:
    return run_state(run_dir)


def gone(run_dir: str) -> bool:
    """A run that neither waits in the queue nor has a folder: a queued run that was removed before it started.
    (The queue is asked first: a launch claims the entry, then makes the folder.)"""
    return not jobs.JobQueue().holds(run_dir) and not Path(run_dir).exists()


def reattach_active(st: dict) -> dict:
    """`st` (changed in place: a timer tick never writes the state back) attached to the newest run still
    training, or to none (the idle card); what the page remembered of the previous run is dropped, the
    start-anyway confirmation is kept."""
    kept = {k: st[k] for k in ("pf_warned", "lint_shown") if k in st}
    st.clear()
    st.update(attach(jobs.find_active_run()), **kept)
    return st


def attached_form(run_dir: str, lang: str = "en") -> tuple[str, list | None]:
    """After a reload: the attached run's spec for the form (so the form shows what runs, not the
    defaults), with a fresh output_dir, and the message that says so. (message, input values | None)."""
    try:
        spec = load_spec(Path(run_dir) / jobs.SPEC_FILE, check_files=False)
    except (SpecError, OSError):
        return f"Attached to the running `{_run_name(run_dir)}`.", None
    spec = spec.model_copy(update={"output_dir": None, "resume_from_checkpoint": None})
    top_names = list(F.TOPBAR_FIELDS)
    names = [r.name for r in F.form_rows()]
    return tr(lang, "msg.attached", name=_run_name(run_dir)), spec_to_inputs(spec, top_names, names)


def start_run(names: list[str], top_names: list[str], st, log_scale, lang, devices, values: list) -> tuple:
    """The Start button. `names`, `top_names`: the form's and the top bar's field names (collect's order);
    then the inputs: state, log-scale, language, picked GPUs (the run's CUDA_VISIBLE_DEVICES), the form values.
    Validates first; refuses what the data check found the run would fail on at once (as a validation error);
    says once what the pre-flight found (memory too close to call, the data check's findings:
    webui/data_check.py), then launches (or queues) `tuneboard train` with run_spec.yaml written into the new run
    dir. Outputs: errors, per-field errors, message, live view."""
    all_names = top_names + names
    flat, pre = collect(names, top_names, list(values))
    spec, errors = check(flat, pre, lang)

    def refused(errors: list) -> tuple:  # the errors above the form and beside their fields; nothing launched
        return (gr.update(value=errors_md(errors, lang), visible=True), *error_updates(errors, all_names, lang),
                st, *([gr.skip()] * (N_VIEW - 1)), "", gr.Timer(active=False))

    if errors:
        return refused(errors)
    doubt = preflight.unsure(flat)  # the estimate is close to the free memory: say so once, offer the probe
    key = hashlib.sha1(spec.to_yaml().encode()).hexdigest()
    if doubt and (st or {}).get("pf_warned") != key:
        return (gr.update(value="", visible=False), *error_updates([], all_names, lang), dict(st or {}, pf_warned=key),
                *([gr.skip()] * (N_VIEW - 1)), preflight.unsure_md(doubt, lang), gr.skip())
    data_key, linted = data_check.before_start(spec)  # the lint's summary of this data: shown once, if it finds any
    stops = data_check.refusal(linted, lang)  # the run would fail at once on this data: never launched
    if stops:
        return refused([stops])
    note = data_check.summary_md(linted, lang)
    if note and (st or {}).get("lint_shown") != key + data_key:
        return (gr.update(value="", visible=False), *error_updates([], all_names, lang),
                dict(st or {}, lint_shown=key + data_key), *([gr.skip()] * (N_VIEW - 1)), note, gr.skip())
    if not spec.output_dir:  # the default folder is named by the second: two Starts in one get -2, -3
        spec = spec.model_copy(update={"output_dir": str(unique_run_dir(Path(spec.with_output_dir().output_dir)))})
    run_dir = Path(spec.output_dir)
    if (run_dir / jobs.SPEC_FILE).exists() and not (spec.resume_from_checkpoint or spec.overwrite_output_dir):
        return refused([("output_dir", f"{run_dir} already holds a run: pick another output_dir (or leave it "
                                       "empty for a new one)")])
    how, run_dir = jobs.start_or_queue(spec.to_yaml(), run_dir, env=devices_env(devices))
    msg = tr(lang, "msg.started" if how == "started" else "msg.queued", name=_run_name(run_dir))
    if spec.adapter_name_or_path:
        msg += tr(lang, "msg.continues", adapter=spec.adapter_name_or_path)
    msg += data_check.pending_md(linted, lang)
    st = attach(run_dir)
    view = view_updates(st, log_scale, force_plot=True, lang=lang)
    return (gr.update(value="", visible=False), *error_updates([], all_names, lang), *view[:-2], msg,
            gr.Timer(active=True))


# ------------------------------------------------------------------ wiring

def wire(ctx, c: dict) -> None:
    top, state = c["top"], ctx.state
    top_names = [n for n in F.TOPBAR_FIELDS]
    names = c["names"]
    all_names = top_names + names
    inputs = [top[n] for n in top_names] + [top["booster"], c["extra_args"]] + [c["fields"][n] for n in names]
    field_comps = [top[n] for n in top_names] + [c["fields"][n] for n in names]
    plot_comps = [c["stage_plots"][name] for name in live.plot_names()]
    live_outputs = [state, c["progress"], c["loss_plot"], c["lr_plot"], *plot_comps, c["completions"], c["log"],
                    c["final"],
                    c["loss_image"], top["adapter_name_or_path"], c["message"], c["timer"]]
    top["adapter_name_or_path"].change(adapter_banner, [top["adapter_name_or_path"], top["lang"]],
                                       [c["adapter_note"], c["adapter_clear"]], show_progress="hidden")
    c["adapter_clear"].click(lambda: "", None, [top["adapter_name_or_path"]])

    def do_preview(lang, *values):
        """Inputs: language, top bar, booster, extra args, form fields. Outputs: errors box, per-field errors,
        command, YAML, preview accordion, pre-flight."""
        flat, pre = collect(names, top_names, list(values))
        spec, errors = check(flat, pre, lang)
        pf = preflight.summary_md(flat, lang)
        if errors:
            return (gr.update(value=errors_md(errors, lang), visible=True), *error_updates(errors, all_names, lang),
                    gr.skip(), gr.skip(), gr.skip(), pf)
        cmd, text = preview_of(spec)
        return (gr.update(value="", visible=False), *error_updates([], all_names, lang), cmd, text,
                gr.update(open=True), pf)

    c["preview"].click(do_preview, [top["lang"], *inputs], [c["errors"], *field_comps, c["preview_cmd"], c["preview_yaml"],
                                            c["preview_acc"], c["preflight"]])

    def refresh_preflight(lang, *values):
        """Inputs: language, top bar, booster, extra args, form. Outputs: the pre-flight memory estimate."""
        flat, _ = collect(names, top_names, list(values))
        return preflight.summary_md(flat, lang)

    for name in preflight.FIELDS:
        comp = top.get(name) if name in top_names else c["fields"].get(name)
        if comp is not None:
            comp.change(refresh_preflight, [top["lang"], *inputs], [c["preflight"]], show_progress="hidden")
    top["lang"].change(refresh_preflight, [top["lang"], *inputs], [c["preflight"]], show_progress="hidden")

    def do_start(st, log_scale, lang, devices, *values):
        """Inputs: state, log-scale, language, picked GPUs, form. Outputs: errors, per-field errors, message, live
        view (start_run)."""
        return start_run(names, top_names, st, log_scale, lang, devices, list(values))

    def do_abort(st, log_scale, lang):
        """Inputs: state, log-scale, language. Asks the attached run to stop (STOP file, then SIGTERM/SIGKILL of
        its group); removes it from the queue if it has not started, and then shows the run that is still
        training (else the idle card) instead of the removed one. Outputs: the live view (message included)."""
        only_message = lambda text: (*([gr.skip()] * (len(live_outputs) - 2)), text, gr.skip())  # noqa: E731
        run_dir = (st or {}).get("run_dir")
        if not run_dir:
            return only_message(tr(lang, "msg.no_run"))
        q = jobs.JobQueue()
        for e in q.entries():
            if e.run_dir == run_dir:
                q.remove(e.id)
                msg = tr(lang, "msg.removed", name=_run_name(run_dir))
                st = reattach_active(dict(st))
                if st.get("run_dir"):
                    msg += " " + tr(lang, "msg.back_to", name=_run_name(st["run_dir"]))
                view = view_updates(st, log_scale, force_plot=True, lang=lang)
                return (*view[:-2], msg, view[-1])
        if jobs.abort(run_dir):
            return only_message(tr(lang, "msg.stopping", name=_run_name(run_dir)))
        return only_message(tr(lang, "msg.not_running", name=_run_name(run_dir)))

    abort_event = c["abort"].click(do_abort, [state, c["log_scale"], top["lang"]], live_outputs)

    def do_measure(pst, lang, *values):
        """Inputs: probe state, language, top bar, booster, extra args, form. Launches `tuneboard probe` on the
        form's spec as a background job (webui/preflight.py). While a training run is active the measurement
        would compete with it for the cores (both slow down many times over): it waits for that run to end
        instead, saying so; pressed again while it waits, it starts at once. Outputs: probe state, probe view,
        probe timer."""
        flat, pre = collect(names, top_names, list(values))
        spec, errors = check(flat, pre, lang)
        if errors:
            why = "; ".join(f"{f}: {m}" for f, m in errors)
            return pst, tr(lang, "pf.probe_failed", error=html.escape(why)), gr.Timer(active=False)
        pst = pst or {}
        spec_yaml = spec.to_yaml()
        busy = jobs.find_active_run()
        if busy and pst.get("waiting") != spec_yaml:  # first press beside a training run: wait for it, say why
            preflight.stop_probe(pst.get("job"))
            wait = {"waiting": spec_yaml, "since": time.time()}
            return wait, preflight.waiting_md(busy, wait["since"], lang), gr.Timer(active=True)
        preflight.stop_probe(pst.get("job"))  # one measurement per page at a time
        job = preflight.start_probe(spec_yaml)
        return {"job": job}, preflight.probe_md(job, lang)[0], gr.Timer(active=True)

    def probe_tick(pst, lang):
        """Inputs: probe state, language. Starts a waiting measurement once no training run is active (the state
        is changed in place: a tick never writes it back over a newer press). Outputs: probe view, probe timer
        (off once the probe has ended)."""
        pst = pst if pst is not None else {}
        if pst.get("waiting"):
            busy = jobs.find_active_run()
            if busy:
                return preflight.waiting_md(busy, pst.get("since") or time.time(), lang), gr.Timer(active=True)
            pst["job"] = preflight.start_probe(pst.pop("waiting"))
            pst.pop("since", None)
        view, running = preflight.probe_md(pst.get("job"), lang)
        return view, gr.Timer(active=running)

    def do_measure_abort(pst, lang):
        """Inputs: probe state, language. Stops the probe's process group, or cancels a measurement waiting for a
        training run to end. Outputs: probe state, probe view, probe timer."""
        pst = pst or {}
        if pst.get("waiting"):
            return {}, tr(lang, "pf.probe_aborted"), gr.Timer(active=False)
        if preflight.stop_probe(pst.get("job")):
            return pst, tr(lang, "pf.probe_aborted"), gr.skip()
        return pst, gr.skip(), gr.skip()

    c["measure"].click(do_measure, [c["probe_state"], top["lang"], *inputs],
                       [c["probe_state"], c["probe"], c["probe_timer"]])
    c["probe_timer"].tick(probe_tick, [c["probe_state"], top["lang"]], [c["probe"], c["probe_timer"]],
                          show_progress="hidden")
    c["measure_abort"].click(do_measure_abort, [c["probe_state"], top["lang"]],
                             [c["probe_state"], c["probe"], c["probe_timer"]])

    def refresh_legend(st):
        """After a live update: rebuild a plot's colours when its set of series changed (see
        legend_update). Inputs: state. Outputs: state, loss plot, stage plots."""
        return (gr.skip(), *legend_updates(st or {}, ["loss", *live.plot_names()]))

    def then_legend(event):
        event.then(refresh_legend, [state], [state, c["loss_plot"], *plot_comps], show_progress="hidden")

    then_legend(abort_event)

    then_legend(c["start"].click(do_start, [state, c["log_scale"], top["lang"], c["devices"], *inputs],
                                 [c["errors"], *field_comps, *live_outputs]))
    # Ticks update the state dict in place (Gradio hands handlers the stored object) and never write the
    # state back: a tick that read the state just before Start would otherwise put the old run back over
    # the one Start attached (seen as Abort stopping the running run instead of unqueuing the new one).
    then_legend(c["timer"].tick(lambda st, ls, lang: (gr.skip(), *view_updates(st, ls, lang=lang)[1:]),
                                [state, c["log_scale"], top["lang"]],
                                live_outputs, show_progress="hidden"))
    redraw = (lambda st, ls, lang: (gr.skip(), *view_updates(st, ls, force_plot=True, lang=lang)[1:]))
    then_legend(c["log_scale"].change(redraw, [state, c["log_scale"], top["lang"]], live_outputs,
                                      show_progress="hidden"))
    # a language switch redraws the card (and the message of an ended run) in that language
    top["lang"].change(lambda st, ls, lang: (gr.skip(), *view_updates(dict(st or {}, announced=None), ls,
                                                                      force_plot=True, lang=lang)[1:-1], gr.skip()),
                       [state, c["log_scale"], top["lang"]], live_outputs, show_progress="hidden")

    # the plots' axis titles follow the language (the relabel changes only their labels)
    top["lang"].change(plot_axes_updates, [top["lang"]], [c["loss_plot"], c["lr_plot"], *plot_comps],
                       show_progress="hidden")

    # visible-when: stage / finetuning type
    cond = [n for n in names if F.rows_by_name()[n].stages or F.rows_by_name()[n].methods]
    table = F.rows_by_name()

    def visibility(stage, method):
        """Inputs: stage, finetuning type. Outputs: visibility of every conditional field."""
        return [gr.update(visible=table[n].visible_for(stage, method)) for n in cond]

    for trigger in (c["fields"]["stage"], top["finetuning_type"]):
        trigger.change(visibility, [c["fields"]["stage"], top["finetuning_type"]],
                       [c["fields"][n] for n in cond], show_progress="hidden")
    # the dataset picker follows the stage: the sets of its data kind, and a switch when the current one does not fit
    c["fields"]["stage"].change(dataset_for_stage, [c["fields"]["stage"], c["fields"]["dataset"],
                                                    c["fields"]["dataset_dir"], top["lang"]],
                                [c["fields"]["dataset"], c["message"]], show_progress="hidden")

    def do_save(path, overwrite, lang, *values):
        """Writes the validated spec as YAML to `path`: only under the allowed folders (backend.core.allowed), only
        a .yaml/.yml name, an existing file only with "overwrite" ticked (unticked again after each save).
        Inputs: path, overwrite, language, form. Outputs: message, overwrite box."""
        target, text = save_target_check(path, overwrite, lang)
        if text:
            return text, gr.skip()
        flat, pre = collect(names, top_names, list(values))
        checked, errors = check(flat, pre, lang)
        if errors:
            return tr(lang, "msg.spec_not_saved", errors="; ".join(f"{f}: {m}" for f, m in errors)), gr.skip()
        target.parent.mkdir(parents=True, exist_ok=True)  # under an allowed root: checked above
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(checked.to_yaml(include_defaults=False), encoding="utf-8")
        tmp.replace(target)
        return tr(lang, "msg.spec_saved", path=target), False

    c["save"].click(do_save, [c["spec_path"], c["spec_overwrite"], top["lang"], *inputs],
                    [c["message"], c["spec_overwrite"]])

    def do_load(path, lang):
        """Reads a spec YAML (under the allowed folders) into the form; a file that is not a spec is refused
        without showing what it holds. Outputs: message, then every input (top bar, booster, extra args,
        form)."""
        skip = [gr.skip()] * len(inputs)
        try:
            target = allowed.check_read(path or "", "spec file")
        except allowed.PathRefused as exc:
            return (refusal(lang, exc), *skip)
        if target.suffix.lower() not in SPEC_SUFFIXES or not target.is_file():
            return (tr(lang, "msg.spec_not_found", path=target), *skip)
        try:
            data = read_spec_file(target)
        except SpecError:  # a syntax error: the line numbers of a file that may not be a spec at all
            return (tr(lang, "msg.spec_not_spec", path=target), *skip)
        if not looks_like_spec(data):
            return (tr(lang, "msg.spec_not_spec", path=target), *skip)
        try:
            spec = load_spec(target, check_files=False)
        except SpecError as exc:
            return (tr(lang, "msg.spec_not_loaded", error=str(exc)), *skip)
        return (tr(lang, "msg.spec_loaded", path=target), *spec_to_inputs(spec, top_names, names))

    c["load"].click(do_load, [c["spec_path"], top["lang"]], [c["message"], *inputs])
