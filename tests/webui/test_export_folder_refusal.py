"""Export tab: a second export to the folder of a finished one, without the Overwrite box, is refused before
anything is launched (naming the box as the tab labels it), and a new export, refused or started, never shows the
earlier export's verification rows. The jobs are real subprocesses of the tab's own start function running the
stand-in `tuneboard export` of test_tool_reattach (no model is loaded)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from test_tool_reattach import saves, state_of, tiny  # noqa: F401  (saves: a fixture)
from waiting import wait_for
from webui import jobs, tools
from webui.app import create_app
from webui.tabs import export


def flat_to(saves: Path, folder: Path, overwrite: bool = False) -> dict:
    return export.export_flat(tiny(saves), None, "full", "default", str(folder), "safetensors", "f16", 1, "cpu",
                              overwrite)


def finished_export(saves: Path, folder: Path) -> dict:
    st, message, started = export.start_export(export.new_state(), flat_to(saves, folder))
    assert started, message
    wait_for(lambda: not tools.alive(st["job"]), what="export process end")
    assert export.poll(st)[3].values.tolist()[0][:2] == ["logits", "✓ ok"]
    return st


def test_a_second_export_to_a_filled_folder_is_refused_without_the_earlier_rows(saves, tmp_path):
    out = tmp_path / "out"
    st = finished_export(saves, out)
    on_start = next(f.fn for f in create_app().fns.values() if f.api_name == "export_start")
    jobs_before = sorted(tools.job_dirs("export"))

    # the tab's Start: state, language, top bar (model, adapter, method, template), dir, format, gguf type, size,
    # device, overwrite, imatrix
    message, st2, bar, result, checks, log, timer = on_start(
        None, st, "en", tiny(saves), None, "full", "default", str(out), "safetensors", "f16", 1, "cpu", False, False)
    assert f"`{out}` is not empty" in message and "**Overwrite a non-empty folder**" in message, message
    assert sorted(tools.job_dirs("export")) == jobs_before  # nothing launched
    assert state_of(bar) == "idle" and result == "" and checks.empty and not st2["job"]
    assert "Nicht leeren Ordner überschreiben" in export.start_export(export.new_state(), flat_to(saves, out), "de")[1]
    # ticked: it starts
    st3, _, started = export.start_export(st2, flat_to(saves, out, overwrite=True))
    assert started
    wait_for(lambda: not tools.alive(st3["job"]), what="second export end")


def test_an_export_that_fails_before_its_report_does_not_show_the_earlier_one(saves, tmp_path):
    out = tmp_path / "out"
    finished_export(saves, out)
    assert json.loads((out / tools.EXPORT_REPORT).read_text())["ok"]
    earlier = time.time() - 30  # that export ended a while before the next Start (a person presses it)
    os.utime(out / tools.EXPORT_REPORT, (earlier, earlier))
    # a job on the same folder that ends without writing a report (as `tuneboard export` failing at step 1)
    job = tools.new_job_dir("export")
    jobs.launch(job, [sys.executable, "-c", "print('[export 1/6] checking the request'); "
                                       "print('error: export_dir: something the UI could not foresee')"])
    st = {"job": str(job), "export_dir": str(out), "log": None, "lines": []}
    wait_for(lambda: not tools.alive(job), what="failing export end")
    _, bar, result, checks, _, _ = export.poll(st)
    assert state_of(bar) == "failed" and checks.empty, checks
