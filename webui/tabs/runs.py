"""Runs tab: every run directory (and queued spec) as a table; overlay loss curves; config diff; actions
(open live view, resume, continue N more steps, clone into the form, delete with confirmation)."""
from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

import gradio as gr
import pandas as pd

from backend import paths
from backend.spec import SpecError, load_spec
from webui import fields as F
from webui import jobs, live
from webui.tabs import train as train_tab
from webui.tailer import JsonlTail

COLUMNS = ["name", "stage", "model", "dataset", "method", "status", "steps", "final loss", "duration", "started"]
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
                     "status": "queued", "steps": "", "final loss": "", "duration": "", "started": "",
                     "run_dir": e.run_dir})
    for r in jobs.list_runs(root):
        st = r.state.status
        metrics = st.get("final_metrics") or {}
        loss = metrics.get("train_loss")
        start, end = _time(st.get("started_at")), _time(st.get("finished_at") or st.get("updated_at"))
        total = st.get("total_steps")
        rows.append({
            "name": r.name, "stage": r.spec.get("stage", "sft"),
            "model": str(r.spec.get("model_name_or_path", "")).split("/")[-1],
            "dataset": r.spec.get("dataset", ""), "method": r.spec.get("finetuning_type", "lora"),
            "status": r.state.state, "steps": f"{st.get('step', 0) or 0}/{total}" if total else str(st.get("step", "")),
            "final loss": f"{loss:.4f}" if isinstance(loss, (int, float)) else "",
            "duration": live.fmt_duration(end - start) if start and end else "",
            "started": datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M") if start else "",
            "run_dir": r.run_dir})
    return rows


def _rel(run_dir: str, root: Path) -> str:
    try:
        return str(Path(run_dir).relative_to(root))
    except ValueError:
        return str(run_dir)


def table(rows: list[dict], status: str, model: str) -> pd.DataFrame:
    keep = [r for r in rows
            if (status in (None, "", "all") or r["status"].startswith(status))
            and (not model or model.lower() in r["model"].lower())]
    return pd.DataFrame([[r[c] for c in COLUMNS] for r in keep], columns=COLUMNS)


def overlay_frame(run_dirs: list[str], root: Path | None = None) -> pd.DataFrame:
    """Loss (and eval loss) of several runs on one plot, one series per run."""
    root = Path(root or paths.saves_dir())
    frames = []
    for d in run_dirs:
        recs, _ = JsonlTail(str(Path(d) / "trainer_log.jsonl")).read()
        frames.append(live.loss_frame(recs, run_label=_rel(d, root)))
    if not frames:
        return train_tab.empty_loss()
    return pd.concat(frames, ignore_index=True)


def diff_md(a: str | None, b: str | None) -> str:
    """Keys whose values differ between two runs' run_spec.yaml (everything else is equal)."""
    if not a or not b:
        return "Pick two runs to compare."
    sa, sb = jobs.read_spec_dict(Path(a)), jobs.read_spec_dict(Path(b))
    keys = [k for k in dict.fromkeys(list(sa) + list(sb)) if sa.get(k) != sb.get(k)]
    if not keys:
        return "The two specs are identical."
    lines = ["| key | A | B |", "|---|---|---|"]
    lines += [f"| `{k}` | {sa.get(k, '–')} | {sb.get(k, '–')} |" for k in keys]
    return "\n".join(lines)


def build(reg) -> dict:
    c: dict = {}
    with gr.Row():
        c["status"] = reg.dropdown("runs-status", STATUS_FILTERS, value="all", scale=1)
        c["model"] = reg.comp(gr.Textbox, "runs-model", value="", scale=2)
        c["max_concurrent"] = reg.comp(gr.Number, "runs-max_concurrent", value=jobs.JobQueue().max_concurrent(),
                                       precision=0, minimum=1, scale=1)
        c["refresh"] = reg.button("runs-refresh", scale=1)
    rows = run_rows()
    c["table"] = reg.comp(gr.Dataframe, "runs-table", value=table(rows, "all", ""), interactive=False,
                          wrap=True, max_height=360)
    names = [(r["name"], r["run_dir"]) for r in rows]
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            c["select"] = gr.Dropdown(choices=names, value=[], multiselect=True, label="Overlay runs",
                                      elem_id="runs-select")
            reg._add(c["select"], "label")
            c["overlay"] = reg.comp(gr.LinePlot, "runs-overlay", value=train_tab.empty_loss(), x="step",
                                    y="value", color="series", height=320, x_title="step", y_title="loss")
        with gr.Column(scale=2):
            c["target"] = gr.Dropdown(choices=names, value=None, label="Run", elem_id="runs-target")
            reg._add(c["target"], "label")
            with gr.Row():
                c["open"] = reg.button("runs-open", size="sm", variant="primary")
                c["resume"] = reg.button("runs-resume", size="sm")
                c["clone"] = reg.button("runs-clone", size="sm")
            with gr.Row():
                c["continue_n"] = reg.comp(gr.Number, "runs-continue_n", value=20, precision=0, minimum=1)
                c["continue"] = reg.button("runs-continue", size="sm")
            with gr.Row():
                c["delete_confirm"] = reg.comp(gr.Checkbox, "runs-delete_confirm", value=False)
                c["delete"] = reg.button("runs-delete", size="sm", variant="stop")
            c["message"] = gr.Markdown("", elem_id="runs-message")
    with gr.Row():
        c["diff_a"] = gr.Dropdown(choices=names, value=None, label="Compare A", elem_id="runs-diff_a")
        c["diff_b"] = gr.Dropdown(choices=names, value=None, label="Compare B", elem_id="runs-diff_b")
        reg._add(c["diff_a"], "label")
        reg._add(c["diff_b"], "label")
    c["diff"] = gr.Markdown("", elem_id="runs-diff", elem_classes=["tb-diff"])
    return c


def wire(c: dict, state, train: dict, tabs) -> None:
    def refresh(status, model):
        """Inputs: filters. Outputs: table and the four run pickers (choices refreshed, values kept)."""
        rows = run_rows()
        names = [(r["name"], r["run_dir"]) for r in rows]
        return (table(rows, status, model), *[gr.update(choices=names) for _ in range(4)])

    pickers = [c["select"], c["target"], c["diff_a"], c["diff_b"]]
    for ev in (c["refresh"].click, c["status"].change, c["model"].submit):
        ev(refresh, [c["status"], c["model"]], [c["table"], *pickers])
    # re-scan when the tab is opened (runs started elsewhere appear)
    tabs.select(refresh, [c["status"], c["model"]], [c["table"], *pickers])

    c["select"].change(lambda ds: overlay_frame(ds or []), [c["select"]], [c["overlay"]])
    for dd in (c["diff_a"], c["diff_b"]):
        dd.change(diff_md, [c["diff_a"], c["diff_b"]], [c["diff"]])
    c["max_concurrent"].change(lambda n: jobs.JobQueue().set_max_concurrent(int(n or 1)), [c["max_concurrent"]],
                               None)

    def open_run(run_dir):
        """Attach the Train tab's live view to a run. Outputs: state, timer, tabs, message."""
        if not run_dir:
            return gr.skip(), gr.skip(), gr.skip(), "Pick a run."
        return train_tab.attach(run_dir), gr.Timer(active=True), gr.Tabs(selected="train"), ""

    c["open"].click(open_run, [c["target"]], [state, train["timer"], tabs, c["message"]])

    def relaunch(run_dir, extra_steps=None):
        """Resume (from the newest checkpoint-N), optionally for N more steps. Outputs: state, timer,
        tabs, message."""
        if not run_dir:
            return gr.skip(), gr.skip(), gr.skip(), "Pick a run."
        rs = jobs.run_state(run_dir)
        if rs.active:
            return gr.skip(), gr.skip(), gr.skip(), "That run is still running."
        if not any(Path(run_dir).glob("checkpoint-*")):
            return gr.skip(), gr.skip(), gr.skip(), "No checkpoint-N in that run to resume from."
        overrides = {"resume_from_checkpoint": True}
        if extra_steps:
            done = int(rs.status.get("step") or 0)
            overrides["max_steps"] = done + int(extra_steps)
        jobs.launch(run_dir, jobs.train_argv(Path(run_dir) / jobs.SPEC_FILE, overrides))
        return train_tab.attach(run_dir), gr.Timer(active=True), gr.Tabs(selected="train"), "Resumed."

    c["resume"].click(lambda d: relaunch(d), [c["target"]], [state, train["timer"], tabs, c["message"]])
    c["continue"].click(lambda d, n: relaunch(d, n or 1), [c["target"], c["continue_n"]],
                        [state, train["timer"], tabs, c["message"]])

    top = train["top"]
    top_names = list(F.TOPBAR_FIELDS)
    inputs = [top[n] for n in top_names] + [top["booster"], train["extra_args"]] + \
             [train["fields"][n] for n in train["names"]]

    def clone(run_dir):
        """Load a run's spec into the Train form (with a fresh output_dir). Outputs: message, tabs, inputs."""
        if not run_dir:
            return ("Pick a run.", gr.skip(), *([gr.skip()] * len(inputs)))
        try:
            spec = load_spec(Path(run_dir) / jobs.SPEC_FILE, check_files=False)
        except SpecError as exc:
            return (f"Cannot clone: {exc}", gr.skip(), *([gr.skip()] * len(inputs)))
        spec = spec.model_copy(update={"output_dir": None, "resume_from_checkpoint": None})
        return ("Cloned into the Train form.", gr.Tabs(selected="train"),
                *train_tab.spec_to_inputs(spec, top_names, train["names"]))

    c["clone"].click(clone, [c["target"]], [c["message"], tabs, *inputs])

    def delete(run_dir, confirmed, status, model):
        """Delete a run dir (only with the confirmation box ticked, never a live run). Outputs: message,
        confirm box, table, pickers."""
        if not run_dir:
            return ("Pick a run.", gr.skip(), *refresh(status, model))
        if not confirmed:
            return ("Tick “I am sure” to delete.", gr.skip(), *refresh(status, model))
        if jobs.run_state(run_dir).active:
            return ("Abort the run before deleting it.", False, *refresh(status, model))
        root = paths.saves_dir().resolve()
        target = Path(run_dir).resolve()
        if root not in target.parents:
            return ("Only run dirs under the saves folder can be deleted here.", False, *refresh(status, model))
        shutil.rmtree(target)
        return (f"Deleted `{_rel(run_dir, root)}`.", False, *refresh(status, model))

    c["delete"].click(delete, [c["target"], c["delete_confirm"], c["status"], c["model"]],
                      [c["message"], c["delete_confirm"], c["table"], *pickers])
