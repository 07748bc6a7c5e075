"""Export / Evaluate tabs picking their job up again after a page reload: which job tools.find_job takes,
and the state attach() rebuilds from the job folder polling to the right result (report -> checks table,
ABORTED marker -> aborted, an eval compare chain launching `base` after `tuned`).

The jobs are real subprocesses launched by the tabs' own start functions. Only the program they run is a
stand-in: FAKE_CLI below plays `tuneboard export|eval SPEC` (files and output lines in the CLI's format,
in a fraction of a second, or sleeping until it is killed) so no model is loaded."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from waiting import wait_for
from webui import jobs, tools
from webui.tabs import evaluate, export

FAKE_CLI = r'''
import json, os, sys, time
from pathlib import Path
import yaml
command, spec = sys.argv[1], yaml.safe_load(Path(sys.argv[2]).read_text())
hold = float(os.environ.get("FAKE_CLI_HOLD_S", "0"))
if command == "export":
    out = Path(spec["export_dir"])
    print("[export 1/6] checking the request", flush=True)
    print("[export 2/6] loading the model", flush=True)
    time.sleep(hold)
    out.mkdir(parents=True, exist_ok=True)
    checks = [{"name": "logits", "ok": True, "detail": "max diff 3e-07", "figures": {"max_diff": 3e-07}},
              {"name": "eos", "ok": True, "detail": "eos kept"}]
    (out / "export_report.json").write_text(json.dumps({"ok": True, "checks": checks}))
    print("[export 6/6] writing the report", flush=True)
    print(f"export PASSED: {out} (model.safetensors)", flush=True)
else:
    out = Path(spec["output_dir"])
    tuned = bool(spec.get("adapter_name_or_path"))
    def status(state, step):
        (out / "status.json.tmp").write_text(json.dumps({"state": state, "step": step, "total_steps": 2}))
        os.replace(out / "status.json.tmp", out / "status.json")
    status("running", 0)
    time.sleep(hold)
    rows = [{"index": i, "prompt": f"p{i}", "label": f"r{i}", "predict": "tuned" if tuned else "base",
             "rouge-l": 90.0 if tuned else 10.0} for i in range(2)]
    (out / "generated_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "eval_results.json").write_text(json.dumps({"rows": 2, "eval_loss": 1.0 if tuned else 3.0}))
    status("completed", 2)
    print("eval done", flush=True)
'''


@pytest.fixture
def saves(tmp_path, monkeypatch):
    """A saves folder whose `tuneboard` is FAKE_CLI (tools.start launches jobs.tuneboard_argv() + args)."""
    cli = tmp_path / "fake_cli.py"
    cli.write_text(FAKE_CLI)
    monkeypatch.setattr(jobs, "tuneboard_argv", lambda: [sys.executable, str(cli)])
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path / "saves"))
    monkeypatch.setenv("FAKE_CLI_HOLD_S", "0")
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tmp_path))  # exports go to tmp_path/out (--allow-path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)  # validate checks that the model path holds a model
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")
    return tmp_path / "saves"


def tiny(saves: Path) -> str:
    """The model folder the `saves` fixture made."""
    return str(saves.parent / "models" / "tiny")


def make_job(root: Path, name: str) -> Path:
    job = root / tools.TOOLS_DIRNAME / name
    job.mkdir(parents=True)
    (job / jobs.PROCESS_LOG).write_text("done\n")
    return job


def state_of(bar_html: str) -> str:
    return bar_html.split('data-state="', 1)[1].split('"', 1)[0]


def test_find_job_takes_the_newest_only_while_running_or_recent(tmp_path):
    make_job(tmp_path, "export-20250101-100000")
    make_job(tmp_path, "export-20250102-100000-2")
    newest = make_job(tmp_path, "export-20250102-100000-10")  # 10 > 2, not by string order
    make_job(tmp_path, "eval-20300101-000000")  # another kind
    (tmp_path / tools.TOOLS_DIRNAME / "export-notes").mkdir()  # not a job folder
    assert [d.name for d in tools.job_dirs("export", tmp_path)] == [
        "export-20250102-100000-10", "export-20250102-100000-2", "export-20250101-100000"]
    assert tools.find_job("export", tmp_path) == str(newest)  # ended just now
    two_hours_on = time.time() + 2 * 3600
    # ended over an hour ago: not re-attached, and no older job is taken instead
    assert tools.find_job("export", tmp_path, now=two_hours_on) is None
    assert tools.find_job("chat", tmp_path) is None
    # still running: taken however long it has been going
    jobs.launch(newest, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert tools.find_job("export", tmp_path, now=two_hours_on) == str(newest)
    finally:
        tools.stop(newest, grace_s=2, wait=True)
    assert tools.find_job("export", tmp_path, now=two_hours_on) is None
    # an eval whose part (a sub-folder) runs counts as running
    ev = tools.job_dirs("eval", tmp_path)[0]
    jobs.launch(ev / "tuned", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert tools.find_job("eval", tmp_path, now=two_hours_on) == str(ev)
    finally:
        tools.stop(ev / "tuned", grace_s=2, wait=True)


def test_export_reattached_after_the_end_shows_its_report(saves, tmp_path):
    flat = export.export_flat(tiny(saves), None, "full", "default", str(tmp_path / "out"), "safetensors",
                              "f16", 1, "cpu", False)
    st, message, started = export.start_export(export.new_state(), flat)
    assert started, message
    wait_for(lambda: not tools.alive(st["job"]), what="export process end")
    # a reload: the browser's state is gone, the page finds the job on disk
    job = tools.find_job("export")
    assert job == st["job"]
    st2 = export.attach(job)
    assert st2["export_dir"] == str(tmp_path / "out")
    assert "(picked up again" in export.attached_message(st2)
    _, bar, result, checks, log, timer = export.poll(st2)
    assert state_of(bar) == "passed" and "export PASSED" in result
    assert checks.values.tolist() == [["logits", "✓ ok", "max diff 3e-07", "max_diff=3e-07"],
                                      ["eos", "✓ ok", "eos kept", ""]]
    assert "[export 6/6]" in log


def test_export_abort_survives_a_reload(saves, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CLI_HOLD_S", "60")
    flat = export.export_flat(tiny(saves), None, "full", "default", str(tmp_path / "out"), "safetensors",
                              "f16", 1, "cpu", False)
    st, _, started = export.start_export(export.new_state(), flat)
    assert started
    log = Path(st["job"]) / jobs.PROCESS_LOG
    wait_for(lambda: "[export 2/6]" in log.read_text(), what="export step 2")
    running = export.attach(tools.find_job("export"))
    _, bar, result, _, _, _ = export.poll(running)
    assert state_of(bar) == "running" and result == ""
    st, message = export.abort(st)
    assert message == "Stopping the export…" and (Path(st["job"]) / tools.ABORTED_FILE).exists()
    wait_for(lambda: not tools.alive(st["job"]), what="export killed")
    st2 = export.attach(tools.find_job("export"))
    assert "aborted" not in st2  # known from the marker only
    _, bar, result, checks, _, _ = export.poll(st2)
    assert state_of(bar) == "aborted" and "aborted" in result and checks.empty
    assert export.abort(st2)[1] == "No export is running."


def run_a(saves) -> str:
    """An adapter folder to compare (the fake CLI never loads it; validate checks that it is one)."""
    (saves / "run-a").mkdir(parents=True, exist_ok=True)
    (saves / "run-a" / "adapter_config.json").write_text("{}")
    return str(saves / "run-a")


def start_compare(saves):
    flat = evaluate.eval_flat(tiny(saves), run_a(saves), "lora", "none", "default", ["identity"], 2, 8)
    st, message, started = evaluate.start_eval(evaluate.new_state(), flat, True)
    assert started, message
    return st


def test_eval_compare_chain_continues_after_a_reload(saves):
    st = start_compare(saves)
    job = Path(evaluate.job_dir(st))
    plan = json.loads((job / tools.PLAN_FILE).read_text())
    assert [(p["name"], p["launched"]) for p in plan["parts"]] == [("tuned", True), ("base", False)]
    # the page is reloaded while `tuned` runs; it ends before the new page polls
    wait_for(lambda: not tools.alive(job / "tuned"), what="tuned part end")
    assert not (job / "base").exists()
    st2 = evaluate.attach(tools.find_job("eval"))
    assert [(p["name"], p["launched"]) for p in st2["parts"]] == [("tuned", True), ("base", False)]
    assert st2["spec"]["eval_dataset"] == "identity" and not st2["aborted"]
    _, bar, _, _, _, _, _ = evaluate.poll(st2, False)  # launches base
    assert state_of(bar) == "running"
    assert (job / "base" / jobs.LAUNCH_FILE).exists()
    assert "adapter_name_or_path" not in tools.read_tool_spec(job / "base")
    assert tools.read_tool_spec(job / "tuned")["adapter_name_or_path"] == run_a(saves)
    assert json.loads((job / tools.PLAN_FILE).read_text())["parts"][1]["launched"] is True
    # a second page attached to the same job does not launch base again
    st3 = evaluate.attach(str(job))
    assert all(p["launched"] for p in st3["parts"])
    wait_for(lambda: not tools.alive(job / "base"), what="base part end")
    _, bar, message, metrics, rows, _, timer = evaluate.poll(st2, False)
    assert state_of(bar) == "completed" and "Eval done" in message
    assert metrics.values.tolist() == [["eval_loss", "1", "3"]]
    rows = rows["value"]
    assert rows["prediction"].tolist() == ["tuned", "tuned"]
    assert rows["base prediction"].tolist() == ["base", "base"]
    assert (job / "base" / jobs.PROCESS_LOG).read_text().count("eval done") == 1


def test_eval_abort_survives_a_reload_and_stops_the_chain(saves, monkeypatch):
    monkeypatch.setenv("FAKE_CLI_HOLD_S", "60")
    st = start_compare(saves)
    job = Path(evaluate.job_dir(st))
    wait_for(lambda: (job / "tuned" / jobs.STATUS_FILE).exists(), what="tuned running")
    st, message = evaluate.abort(st)
    assert message == "Stopping the eval…" and (job / tools.ABORTED_FILE).exists()
    wait_for(lambda: not tools.alive(job / "tuned"), what="tuned killed")
    st2 = evaluate.attach(tools.find_job("eval"))
    assert st2["aborted"]
    _, bar, message, _, _, _, _ = evaluate.poll(st2, False)
    assert state_of(bar) == "aborted" and "aborted" in message
    assert not (job / "base").exists()  # the chain did not go on


def test_a_finished_eval_is_not_aborted_after_the_fact(saves):
    st = start_compare(saves)
    job = Path(evaluate.job_dir(st))
    wait_for(lambda: not tools.alive(job / "tuned"), what="tuned part end")
    evaluate.poll(st, False)  # launches base
    wait_for(lambda: not tools.alive(job / "base"), what="base part end")
    assert evaluate.abort(st)[1] == "No eval is running."
    assert not (job / tools.ABORTED_FILE).exists()


def test_on_load_leaves_a_busy_or_jobless_tab_alone(saves):
    import gradio as gr

    from webui.app import reattach_tool

    skips = reattach_tool(export, "export", None)  # no job at all
    assert all(isinstance(v, type(gr.skip())) for v in skips) and len(skips) == 3
    job = make_job(saves, "export-20250101-100000")
    (job / tools.TOOL_SPEC).write_text("export_dir: /x/out\n")
    busy = reattach_tool(export, "export", "/another/job")  # a Start got there first
    assert all(isinstance(v, type(gr.skip())) for v in busy)
    st, message, timer = reattach_tool(export, "export", None)
    assert st["job"] == str(job) and st["export_dir"] == "/x/out" and "/x/out" in message
    assert timer.active is True


def test_a_tick_that_fired_before_start_leaves_the_new_export_alone(saves, tmp_path):
    """The Export tab on a reloaded page re-attached to an ended export; its timer's tick, fired with that state
    before Start and answered after it, wrote the old state, "ended" and a stopped timer over the new export's
    (seen in full test runs). The app's own handlers, in that order; another page is not affected."""
    import gradio as gr

    from webui.app import create_app

    flat = export.export_flat(tiny(saves), None, "full", "default", str(tmp_path / "old"), "safetensors",
                              "f16", 1, "cpu", False)
    old, _, started = export.start_export(export.new_state(), flat)
    assert started
    wait_for(lambda: not tools.alive(old["job"]), what="earlier export end")
    demo = create_app()
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    on_load = fns["on_load"]
    start = next(f.fn for f in demo.fns.values() if f.api_name == "export_start")
    tick = next(f.fn for f in demo.fns.values()
                if f.fn.__name__ == "tick" and any(t[1] == "tick" for t in f.targets) and len(f.outputs) == 7)
    page, other = gr.Request(session_hash="page-a"), gr.Request(session_hash="page-b")
    empty = export.new_state()
    loaded = on_load(page, {}, empty, {})
    attached = loaded[-6]  # export state, message, timer, then Evaluate's three
    assert attached["job"] == old["job"]
    assert on_load(other, {}, empty, {})[-6]["job"] == old["job"]
    # Start on page a: a new export, the timer on
    inputs = [tiny(saves), None, "full", "default", str(tmp_path / "new"), "safetensors", "f16", 1, "cpu", False,
              False]
    message, new, *_, timer = start(page, attached, "en", *inputs)
    assert new["job"] != old["job"] and timer.active, message
    # the tick that fired with the attached state, answered now: nothing changes
    late = tick(page, attached, "en")
    assert len(late) == 7 and all(isinstance(v, type(gr.skip())) for v in late)
    # the new export's own ticks run as before, and page b still follows the earlier export
    wait_for(lambda: not tools.alive(new["job"]), what="new export end")
    st, bar, result, *_, timer, ended = tick(page, new, "en")
    assert st["job"] == new["job"] and state_of(bar) == "passed" and "new" in ended and not timer.active
    st, bar, *_ = tick(other, attached, "en")
    assert st["job"] == old["job"] and state_of(bar) == "passed"
    # a re-attach answered after a Start on the same page (a Start clicked before the load's answer) is left out
    third = gr.Request(session_hash="page-c")
    message, newest, *_ = start(third, empty, "en", *inputs[:4], str(tmp_path / "third"), *inputs[5:])
    assert newest.get("job"), message
    assert all(isinstance(v, type(gr.skip())) for v in on_load(third, {}, empty, {})[-6:-3])
    wait_for(lambda: not tools.alive(newest["job"]), what="third export end")
