"""Runs tab: every run directory (and queued spec) as a table; overlay any logged metric of several runs;
config diff; actions (open live view, resume, continue N more steps, clone into the form, continue an SFT
run with DPO, delete with confirmation); the picked run's checkpoints (loss, task metric, which one is the
adapter) with Promote / Undo promote (backend/core/promote.py); the commands that open what its trackers
(report_to: TensorBoard, MLflow, W&B, SwanLab) wrote into its folder."""
from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

import gradio as gr
import pandas as pd

from backend.core import paths
from backend.core.curves import loss_summary
from backend.core.methods import method
from backend.core.rundir import ACTIVE_STATES, LOG_FILE, run_seconds
from backend.core.spec import SpecError, load_spec, validate_spec
from backend.stages import get_stage, stages_with_data
from backend.core.trackers import local_logs
from webui import fields as F
from webui import form, jobs, live
from webui.i18n import headers, tr
from webui.plots import empty_loss, legend_update, plot_axes, series_of
from webui.promotion import checkpoint_frame, checkpoint_names, promote_checkpoint
from webui.tailer import JsonlTail, run_state

COLUMNS = ["name", "stage", "model", "dataset", "method", "status", "steps", "final loss", "smoothed loss",
           "lowest loss", "duration", "started"]
LOSS_COLUMNS = {"final loss": "final_loss", "smoothed loss": "smoothed_loss", "lowest loss": "min_loss"}
# name and dataset wrap; the short columns keep their header and value on one line (see style.css)
COLUMN_WIDTHS = ["18%", "5%", "9%", "9%", "6%", "8%", "6%", "7%", "7%", "7%", "7%", "11%"]
STATUS_FILTERS = ["all", "running", "queued", "completed", "failed", "aborted"]


def _time(value) -> float | None:
    return live._parse_time(value)


def run_rows(root: Path | None = None) -> list[dict]:
    """One dict per run dir and per queued entry (queued first, in order)."""
    root = Path(root or paths.saves_dir())
    rows = []
    for e in jobs.JobQueue(root).entries():
        s = e.spec
        rows.append({"name": _rel(e.run_dir, root), "stage": s.get("stage", "sft"),
                     "model": str(s.get("model_name_or_path", "")).split("/")[-1],
                     "dataset": s.get("dataset", ""), "method": s.get("finetuning_type", "lora"),
                     "status": "queued (resume)" if e.is_resume else "queued", "steps": "", **dict.fromkeys(LOSS_COLUMNS, ""), "duration": "", "started": "",
                     "run_dir": e.run_dir})
    for r in jobs.list_runs(root):
        st = r.state.status
        losses = loss_numbers(r.run_dir, st)
        start = _time(st.get("run_started_at") or st.get("started_at"))  # a resumed run: its first start
        took = run_seconds(st)  # a resumed run: its earlier processes too
        total = st.get("total_steps")
        rows.append({
            "name": r.name, "stage": r.spec.get("stage", "sft"),
            "model": str(r.spec.get("model_name_or_path", "")).split("/")[-1],
            "dataset": r.spec.get("dataset", ""), "method": r.spec.get("finetuning_type", "lora"),
            "status": r.state.state, "steps": f"{st.get('step', 0) or 0}/{total}" if total else str(st.get("step", "")),
            **{col: f"{losses[key]:.4f}" if key in losses else "" for col, key in LOSS_COLUMNS.items()},
            "duration": live.fmt_duration(took) if took is not None else "",
            "started": datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M") if start else "",
            "run_dir": r.run_dir})
    return rows


def loss_numbers(run_dir: str, status: dict | None = None) -> dict[str, float]:
    """{final_loss, smoothed_loss, min_loss}: what an ended run's status holds (backend.core.curves wrote it at the
    end), else computed from its logged training losses (trainer_log.jsonl: a running run, or one from before
    the summary). One noisy last batch alone does not compare runs honestly (issue 24)."""
    held = (status or {}).get("final_metrics") or {}
    ended = (status or {}).get("state") not in ACTIVE_STATES  # a resumed run's earlier summary is stale
    if ended and all(isinstance(held.get(k), (int, float)) for k in LOSS_COLUMNS.values()):
        return {k: float(held[k]) for k in LOSS_COLUMNS.values()}  # no whole-log read per run per refresh
    losses = [v for r in _records(run_dir) if (v := live._num(r.get("loss"))) is not None]
    if losses:
        return loss_summary(losses)
    return {k: float(held[k]) for k in LOSS_COLUMNS.values() if isinstance(held.get(k), (int, float))}


def short_names(names: list[str]) -> dict[str, str]:
    """name -> the fewest trailing path parts that tell it apart from the others (the overlay legend reads
    `2026-11-30-15-02-03`, not `SmolLM2-135M-Instruct/lora/...` twice)."""
    parts = {n: n.strip("/").split("/") for n in names}
    out = {}
    for n, p in parts.items():
        for k in range(1, len(p) + 1):
            tail = "/".join(p[-k:])
            if all(o == n or "/".join(q[-k:]) != tail for o, q in parts.items()):
                break
        out[n] = tail
    return out


def _rel(run_dir: str, root: Path) -> str:
    try:
        return str(Path(run_dir).relative_to(root))
    except ValueError:
        return str(run_dir)


def shown_rows(rows: list[dict], status: str, model: str) -> list[dict]:
    """The rows the filters keep, in table order."""
    return [r for r in rows
            if (status in (None, "", "all") or r["status"].startswith(status))
            and (not model or model.lower() in r["model"].lower())]


def table(rows: list[dict], status: str, model: str, lang: str = "en") -> pd.DataFrame:
    """The shown rows, headers and each run's state in `lang`."""
    frame = pd.DataFrame([[live.state_word(r[c], lang) if c == "status" else r[c] for c in COLUMNS]
                          for r in shown_rows(rows, status, model)], columns=COLUMNS)
    return headers(lang, frame)


def run_at(name: str | None, row: int | None, status: str, model: str) -> str | None:
    """The run dir of a clicked table row: by the name in the row (the table may have been re-listed since),
    else by its position under the current filters."""
    shown = shown_rows(run_rows(), status, model)
    for r in shown:
        if name and r["name"] == name:
            return r["run_dir"]
    if row is not None and 0 <= row < len(shown):
        return shown[row]["run_dir"]
    return None


def _records(run_dir: str) -> list[dict]:
    recs, _ = JsonlTail(str(Path(run_dir) / LOG_FILE)).read()
    return recs


def overlay_frame(run_dirs: list[str], root: Path | None = None, metric: str = "loss",
                  lang: str = "en") -> pd.DataFrame:
    """One logged metric (with its eval_ variant) of several runs on one plot, one series per run and
    metric: loss by default (its series named in `lang`), or any key of trainer_log.jsonl
    (rewards/accuracies, kl, grad_norm, ...)."""
    root = Path(root or paths.saves_dir())
    metric = metric or "loss"
    labels = short_names([_rel(d, root) for d in run_dirs])
    frames = []
    for d in run_dirs:
        recs, label = _records(d), labels[_rel(d, root)]
        frames.append(live.loss_frame(recs, run_label=label, lang=lang) if metric == "loss"
                      else live.metric_frame(recs, [metric], run_label=label))
    frames = [f for f in frames if len(f)]
    if not frames:
        return empty_loss()
    return pd.concat(frames, ignore_index=True)


def overlay_metrics(run_dirs: list[str]) -> list[str]:
    """The metrics the overlay can draw for these runs: every plottable key present in their logs, loss
    first (always offered)."""
    keys: dict = {"loss": None}
    for d in run_dirs:
        keys.update(dict.fromkeys(live.metric_keys(_records(d))))
    return list(keys)


def trackers_md(run_dir: str | None, lang: str = "en") -> str:
    """How to open what the run's trackers (report_to) wrote into its folder: one command per tracker."""
    found = local_logs(run_dir) if run_dir else []
    if not found:
        return ""
    return tr(lang, "runs.trackers") + "\n\n" + "\n".join(f"- {name}: `{command}`" for name, command in found)


def diff_md(a: str | None, b: str | None, lang: str = "en") -> str:
    """Keys whose values differ between two runs' run_spec.yaml (everything else is equal)."""
    if not a or not b:
        return tr(lang, "runs.pick_two")
    sa, sb = jobs.read_spec_dict(Path(a)), jobs.read_spec_dict(Path(b))
    keys = [k for k in dict.fromkeys(list(sa) + list(sb)) if sa.get(k) != sb.get(k)]
    if not keys:
        return tr(lang, "runs.identical")
    lines = ["| key | A | B |", "|---|---|---|"]
    lines += [f"| `{k}` | {sa.get(k, '–')} | {sb.get(k, '–')} |" for k in keys]
    return "\n".join(lines)


# ------------------------------------------------------------------ actions (pure of Gradio, tested directly)

def relaunch_run(run_dir: str | None, extra_steps: int | None = None, root: Path | None = None,
                 command=jobs.train_argv, lang: str = "en") -> tuple[bool, str]:
    """Resume a run from its newest checkpoint-N, optionally for `extra_steps` more steps, through the
    queue (it waits there like any Start while another run holds the slot). Returns (accepted, message)."""
    if not run_dir:
        return False, tr(lang, "runs.pick")
    rs = jobs.run_state(run_dir)
    if rs.active:
        return False, tr(lang, "runs.still_running")
    q = jobs.JobQueue(root, command=command)
    if any(e.run_dir == str(run_dir) for e in q.entries()):
        return False, tr(lang, "runs.already_queued")
    if not any(Path(run_dir).glob("checkpoint-*")):
        return False, tr(lang, "runs.no_checkpoint")
    overrides: dict = {"resume_from_checkpoint": True}
    if extra_steps:
        done = int(rs.status.get("step") or 0)
        overrides["max_steps"] = done + int(extra_steps)
    spec_text = (Path(run_dir) / jobs.SPEC_FILE).read_text(encoding="utf-8")
    how, _ = jobs.start_or_queue(spec_text, run_dir, root=root, command=command, overrides=overrides)
    what = tr(lang, "runs.more_steps", n=int(extra_steps), to=overrides["max_steps"]) if extra_steps else \
        tr(lang, "runs.from_last")
    if how == "started":
        return True, tr(lang, "runs.resumed", name=Path(run_dir).name, what=what)
    return True, tr(lang, "runs.resume_queued", name=Path(run_dir).name, what=what)


def delete_run(run_dir: str | None, confirmed: bool, root: Path | None = None,
               lang: str = "en") -> tuple[bool, str]:
    """Delete a run dir: only with the confirmation ticked, never a live or queued run, never outside
    the saves folder. Returns (deleted, message)."""
    if not run_dir:
        return False, tr(lang, "runs.pick")
    if not confirmed:
        return False, tr(lang, "runs.tick_sure")
    if jobs.run_state(run_dir).active:
        return False, tr(lang, "runs.abort_first")
    root = Path(root or paths.saves_dir()).resolve()
    target = Path(run_dir).resolve()
    if root not in target.parents:
        return False, tr(lang, "runs.only_saves")
    q = jobs.JobQueue(root)
    for e in q.entries():
        if Path(e.run_dir).resolve() == target:
            q.remove(e.id)
    shutil.rmtree(target, ignore_errors=False)
    return True, tr(lang, "runs.deleted", name=_rel(run_dir, root))


def clone_spec(run_dir: str | None, lang: str = "en"):
    """A run's spec for the Train form: same settings, fresh output_dir, no resume. Returns (spec, message);
    spec is None when the run cannot be cloned."""
    if not run_dir:
        return None, tr(lang, "runs.pick")
    try:
        spec = load_spec(Path(run_dir) / jobs.SPEC_FILE, check_files=False)
    except (SpecError, OSError) as exc:
        return None, tr(lang, "runs.cannot_clone", error=exc)
    return (spec.model_copy(update={"output_dir": None, "resume_from_checkpoint": None}),
            tr(lang, "runs.cloned"))


# The SFT -> DPO chain: the bundled ranking dataset a "Continue with DPO" starts from (any other ranking
# dataset can then be picked in the form).
DPO_DATASET = "dpo_en_demo"


def continue_dpo_spec(run_dir: str | None, lang: str = "en"):
    """The Train form's spec for DPO on top of a finished SFT LoRA run: the run's settings, stage dpo, a
    ranking dataset, adapter_name_or_path = the run (its adapter is trained further), a fresh output_dir.
    Returns (spec, message); spec is None when the run cannot be continued this way."""
    if not run_dir:
        return None, tr(lang, "runs.pick")
    try:
        spec = load_spec(Path(run_dir) / jobs.SPEC_FILE, check_files=False)
    except (SpecError, OSError) as exc:
        return None, tr(lang, "runs.cannot_continue", error=exc)
    if spec.stage not in stages_with_data("plain"):  # sft, kd: an adapter trained on conversations
        return None, tr(lang, "runs.dpo_needs_sft", stage=spec.stage)
    if not method(spec.finetuning_type).adapter:
        return None, tr(lang, "runs.dpo_needs_lora", method=spec.finetuning_type)
    state = jobs.run_state(run_dir).state
    if state != "completed":
        return None, tr(lang, "runs.not_completed", state=state)
    if not (Path(run_dir) / "adapter_config.json").exists():
        return None, tr(lang, "runs.no_adapter")
    flat = spec.flat_dict(include_defaults=False)
    for key in get_stage(spec.stage).fields:  # the first stage's own keys (kd's teacher) are not dpo's
        flat.pop(key, None)
    flat.update(stage="dpo", dataset=DPO_DATASET, adapter_name_or_path=str(run_dir))
    # eval_dataset: an SFT evaluation set is no ranking data, DPO cannot score it
    for key in ("output_dir", "resume_from_checkpoint", "overwrite_output_dir", "eval_dataset"):
        flat.pop(key, None)
    try:
        spec = validate_spec(flat, check_files=False)
    except SpecError as exc:
        return None, tr(lang, "runs.cannot_continue", error=exc)
    return spec, tr(lang, "runs.dpo_ready", name=Path(run_dir).name, dataset=DPO_DATASET)


def build(ctx) -> dict:
    reg = ctx.reg
    c: dict = {}
    with gr.Row():
        c["status"] = reg.dropdown("runs-status", STATUS_FILTERS, value="all", scale=1)
        c["model"] = reg.comp(gr.Textbox, "runs-model", value="", scale=2)
        c["max_concurrent"] = reg.comp(gr.Number, "runs-max_concurrent", value=jobs.JobQueue().max_concurrent(),
                                       precision=0, minimum=1, scale=1)
        c["refresh"] = reg.button("runs-refresh", scale=1)
    rows = run_rows()
    c["table"] = reg.comp(gr.Dataframe, "runs-table", value=table(rows, "all", ""), interactive=False,
                          wrap=True, max_height=360, column_widths=COLUMN_WIDTHS)
    names = [(r["name"], r["run_dir"]) for r in rows]
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            c["select"] = gr.Dropdown(choices=names, value=[], multiselect=True, label="Overlay runs",
                                      elem_id="runs-select")
            reg._add(c["select"], "label")
            c["metric"] = gr.Dropdown(choices=["loss"], value="loss", label="Metric", elem_id="runs-metric")
            reg._add(c["metric"], "label")
            c["overlay"] = reg.comp(gr.LinePlot, "runs-overlay", value=empty_loss(), x="step",
                                    y="value", color="series", height=400, **plot_axes("loss_plot"))
        with gr.Column(scale=2):
            c["target"] = gr.Dropdown(choices=names, value=None, label="Run", elem_id="runs-target")
            reg._add(c["target"], "label")
            with gr.Row():
                c["open"] = reg.button("runs-open", size="sm", variant="primary")
                c["resume"] = reg.button("runs-resume", size="sm")
                c["clone"] = reg.button("runs-clone", size="sm")
                c["continue_dpo"] = reg.button("runs-continue_dpo", size="sm")
            with gr.Row():
                c["continue_n"] = reg.comp(gr.Number, "runs-continue_n", value=20, precision=0, minimum=1)
                c["continue"] = reg.button("runs-continue", size="sm")
            with gr.Row():
                c["delete_confirm"] = reg.comp(gr.Checkbox, "runs-delete_confirm", value=False)
                c["delete"] = reg.button("runs-delete", size="sm", variant="stop")
            c["message"] = gr.Markdown("", elem_id="runs-message")
            c["trackers"] = gr.Markdown("", elem_id="runs-trackers")
            c["checkpoints"] = reg.comp(gr.Dataframe, "runs-checkpoints", value=checkpoint_frame(None),
                                        interactive=False, max_height=240)
            with gr.Row(equal_height=False):
                c["checkpoint"] = reg.comp(gr.Dropdown, "runs-checkpoint", choices=[], value=None, scale=2)
                with gr.Column(scale=1, min_width=120):
                    c["promote"] = reg.button("runs-promote", size="sm")
                    c["undo_promote"] = reg.button("runs-undo_promote", size="sm")
    with gr.Row():
        c["diff_a"] = gr.Dropdown(choices=names, value=None, label="Compare A", elem_id="runs-diff_a")
        c["diff_b"] = gr.Dropdown(choices=names, value=None, label="Compare B", elem_id="runs-diff_b")
        reg._add(c["diff_a"], "label")
        reg._add(c["diff_b"], "label")
    c["diff"] = gr.Markdown("", elem_id="runs-diff", elem_classes=["tb-diff"])
    return c


def wire(ctx, c: dict) -> None:
    state, train, tabs = ctx.state, ctx.tab("train"), ctx.tabs

    def refresh(status, model, lang="en"):
        """Inputs: filters. Outputs: table and the four run pickers (choices refreshed, values kept)."""
        rows = run_rows()
        names = [(r["name"], r["run_dir"]) for r in rows]
        return (table(rows, status, model, lang), *[gr.update(choices=names) for _ in range(4)])

    pickers = [c["select"], c["target"], c["diff_a"], c["diff_b"]]
    lang = train["top"]["lang"]
    for ev in (c["refresh"].click, c["status"].change, c["model"].submit, lang.change):
        ev(refresh, [c["status"], c["model"], lang], [c["table"], *pickers])
    # re-scan when the tab is opened (runs started elsewhere appear)
    tabs.select(refresh, [c["status"], c["model"], lang], [c["table"], *pickers])

    def pick_runs(run_dirs, metric, lang="en"):
        """Inputs: selected runs, metric, language. Outputs: metric picker (the keys their logs hold; the
        metric is kept when they still have it, else loss), overlay."""
        offered = overlay_metrics(run_dirs or [])
        metric = metric if metric in offered else "loss"
        return gr.update(choices=offered, value=metric), draw_overlay(run_dirs, metric, lang)

    def draw_overlay(run_dirs, metric, lang="en"):
        """Inputs: selected runs, metric, language. Outputs: overlay (axes in the page's language; a metric
        other than loss is titled by its logged key)."""
        metric = metric or "loss"
        axes = plot_axes("loss_plot", lang)
        if metric != "loss":
            axes["y_title"] = metric
        return gr.update(value=overlay_frame(run_dirs or [], metric=metric, lang=lang), **axes)

    def overlay_legend(run_dirs, metric, lang="en"):
        return legend_update(series_of(overlay_frame(run_dirs or [], metric=metric or "loss", lang=lang)))

    overlay_inputs = [c["select"], c["metric"], lang]
    c["select"].change(pick_runs, overlay_inputs, [c["metric"], c["overlay"]]).then(
        overlay_legend, overlay_inputs, [c["overlay"]], show_progress="hidden")
    for ev in (c["metric"].input, lang.change):
        ev(draw_overlay, overlay_inputs, [c["overlay"]], show_progress="hidden").then(
            overlay_legend, overlay_inputs, [c["overlay"]], show_progress="hidden")
    for dd in (c["diff_a"], c["diff_b"]):
        dd.change(diff_md, [c["diff_a"], c["diff_b"], lang], [c["diff"]])
    c["max_concurrent"].change(lambda n: jobs.JobQueue().set_max_concurrent(int(n or 1)), [c["max_concurrent"]],
                               None)

    def open_run(run_dir, lang):
        """Attach the Train tab's live view to a run. Outputs: state, timer, tabs, message."""
        if not run_dir:
            return gr.skip(), gr.skip(), gr.skip(), tr(lang, "runs.pick")
        return run_state(run_dir), gr.Timer(active=True), gr.Tabs(selected="train"), ""

    c["open"].click(open_run, [c["target"], lang], [state, train["timer"], tabs, c["message"]])

    def pick_row(status, model, lang, evt: gr.SelectData):
        """A click on a table row picks that run for the actions. Inputs: filters (+ the click).
        Outputs: run picker, message."""
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else None
        name = evt.row_value[0] if getattr(evt, "row_value", None) else None
        run_dir = run_at(name, row, status, model)
        if run_dir is None:
            return gr.skip(), gr.skip()
        return run_dir, tr(lang, "runs.picked", name=_rel(run_dir, paths.saves_dir()))

    c["table"].select(pick_row, [c["status"], c["model"], lang], [c["target"], c["message"]])

    def relaunch(run_dir, extra_steps=None, lang="en"):
        """Resume (from the newest checkpoint-N), optionally for N more steps, via the queue.
        Outputs: state, timer, tabs, message."""
        ok, message = relaunch_run(run_dir, extra_steps, lang=lang)
        if not ok:
            return gr.skip(), gr.skip(), gr.skip(), message
        return run_state(run_dir), gr.Timer(active=True), gr.Tabs(selected="train"), message

    c["resume"].click(lambda d, lg: relaunch(d, lang=lg), [c["target"], lang],
                      [state, train["timer"], tabs, c["message"]])
    c["continue"].click(lambda d, n, lg: relaunch(d, n or 1, lg), [c["target"], c["continue_n"], lang],
                        [state, train["timer"], tabs, c["message"]])

    top = train["top"]
    top_names = list(F.TOPBAR_FIELDS)
    inputs = form.inputs_of(top, train)

    def clone(run_dir, lang):
        """Load a run's spec into the Train form (with a fresh output_dir). Outputs: message, tabs, inputs."""
        spec, message = clone_spec(run_dir, lang)
        if spec is None:
            return (message, gr.skip(), *([gr.skip()] * len(inputs)))
        return (message, gr.Tabs(selected="train"), *form.spec_to_inputs(spec, top_names, train["names"]))

    c["clone"].click(clone, [c["target"], lang], [c["message"], tabs, *inputs])

    def continue_dpo(run_dir, lang):
        """Put DPO on top of a finished SFT LoRA run into the Train form (stage dpo, a ranking dataset, the
        run as adapter_name_or_path). Outputs: message, tabs, inputs."""
        spec, message = continue_dpo_spec(run_dir, lang)
        if spec is None:
            return (message, gr.skip(), *([gr.skip()] * len(inputs)))
        return (message, gr.Tabs(selected="train"), *form.spec_to_inputs(spec, top_names, train["names"]))

    c["continue_dpo"].click(continue_dpo, [c["target"], lang], [c["message"], tabs, *inputs])

    def delete(run_dir, confirmed, status, model, lang):
        """Delete a run dir (only with the confirmation box ticked, never a live run). Outputs: message,
        confirm box, table, pickers."""
        deleted, message = delete_run(run_dir, confirmed, lang=lang)
        return (message, False if deleted or confirmed else gr.skip(), *refresh(status, model, lang))

    c["delete"].click(delete, [c["target"], c["delete_confirm"], c["status"], c["model"], lang],
                      [c["message"], c["delete_confirm"], c["table"], *pickers])

    def show_checkpoints(run_dir, lang="en"):
        """Inputs: run, language. Outputs: checkpoint table, checkpoint picker (the run's checkpoint-N)."""
        return checkpoint_frame(run_dir, lang), gr.update(choices=checkpoint_names(run_dir), value=None)

    for ev in (c["target"].change, lang.change):
        ev(show_checkpoints, [c["target"], lang], [c["checkpoints"], c["checkpoint"]])
        ev(trackers_md, [c["target"], lang], [c["trackers"]])

    def pick_checkpoint(evt: gr.SelectData):
        """A click on a checkpoint row picks it. Outputs: checkpoint picker."""
        row = getattr(evt, "row_value", None)
        return row[1].split(" ")[0] if row and len(row) > 1 else gr.skip()

    c["checkpoints"].select(pick_checkpoint, None, [c["checkpoint"]])

    def do_promote(run_dir, checkpoint, lang, undo=False):
        """Promote the picked checkpoint (or undo). Outputs: message, checkpoint table."""
        _, message = promote_checkpoint(run_dir, checkpoint, undo=undo, lang=lang)
        return message, checkpoint_frame(run_dir, lang)

    c["promote"].click(do_promote, [c["target"], c["checkpoint"], lang], [c["message"], c["checkpoints"]])
    c["undo_promote"].click(lambda d, lg: do_promote(d, None, lg, undo=True), [c["target"], lang],
                            [c["message"], c["checkpoints"]])
