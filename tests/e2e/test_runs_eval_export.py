"""The Runs overlay, the Evaluate and Export tabs and the job queue in headless Chromium, on runs made by
the real `tuneboard train` (tiny Llama) and real `tuneboard eval` / `tuneboard export` subprocesses."""
import json
import re

from playwright.sync_api import expect

from webui import jobs, tools
from ui_actions import open_tab, set_dropdown, set_number, pick_option
from waiting import wait_for


def adapter_label(path) -> str:
    """The adapter picker's name of a run folder (the folder is the choice's value)."""
    from webui import choices

    return dict((v, k) for k, v in choices.adapter_pairs())[str(path)]


def test_runs_overlay_of_two_runs(app_page, finished_runs, shot):
    page = app_page
    open_tab(page, "Runs")
    table = page.locator("#runs-table")
    for d in finished_runs:
        expect(table).to_contain_text(d.name)
    expect(table).to_contain_text("completed")
    names = [f"tiny_llama/lora/{d.name}" for d in finished_runs]
    for name in names:
        pick_option(page, "runs-select", name)
    points = page.locator('#runs-overlay [aria-roledescription="point"]')
    # 2 + 3 logged losses, one series per run
    page.wait_for_function("() => document.querySelectorAll('#runs-overlay [aria-roledescription=\"point\"]')"
                           ".length >= 5", timeout=30_000)
    assert points.count() >= 5
    # one visible line per run (with a stroke colour: a line without one is invisible)
    page.wait_for_function(
        "() => [...document.querySelectorAll('#runs-overlay .mark-line path')]"
        ".filter(p => p.getAttribute('stroke') && (p.getAttribute('d') || '').includes('L')).length >= 2",
        timeout=30_000)
    shot("runs-overlay")
    labels = " ".join(points.evaluate_all("els => els.map(e => e.getAttribute('aria-label') || '')"))
    for d in finished_runs:  # short, distinct run names in the legend
        assert f"{d.name} loss" in labels and f"lora/{d.name}" not in labels, labels[:500]
    # a click on a table row picks that run for the actions
    page.locator("#runs-table [role=gridcell]", has_text=names[1]).first.click()
    expect(page.locator("#runs-target input")).to_have_value(names[1])
    # the config diff of the two runs names what differs
    pick_option(page, "runs-diff_a", names[0])
    pick_option(page, "runs-diff_b", names[1])
    expect(page.locator("#runs-diff")).to_contain_text("max_steps")
    shot("runs-overlay")

    # in a window 800 px wide the table scrolls sideways instead of cutting every column ("sta", "fina loss"):
    # each header is whole, and the last column scrolls into view
    page.set_viewport_size({"width": 800, "height": 900})
    page.wait_for_function(
        "() => { const heads = [...document.querySelectorAll('#runs-table th .header-content')];"
        " return heads.length >= 12 && heads.every(h => h.scrollWidth <= h.clientWidth + 1); }", timeout=20_000)
    shot("runs-table-800")
    started = table.locator("th", has_text="started")
    started.scroll_into_view_if_needed()
    expect(started).to_be_in_viewport(ratio=1)


def test_evaluate_tab_compares_base_and_tuned(app_page, finished_runs, tiny_llama, shot):
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-adapter_name_or_path", finished_runs[1])
    set_dropdown(page, "top-template", "default")
    open_tab(page, "Evaluate")
    set_number(page, "eval-max_samples", 3)
    set_number(page, "eval-max_new_tokens", 8)
    page.locator("#eval-compare input").check()
    page.locator("#eval-start").click()
    expect(page.locator("#eval-message")).to_contain_text("Evaluating tuned and base")
    expect(page.locator("#eval-progress .tb-progress")).to_have_attribute("data-state", "running", timeout=30_000)
    expect(page.locator("#eval-message")).to_contain_text("Eval done", timeout=240_000)
    metrics = page.locator("#eval-metrics")
    for word in ("rouge-l", "bleu-4", "eval_loss", "tuned", "base"):
        expect(metrics).to_contain_text(word)
    rows = page.locator("#eval-rows")
    expect(rows).to_contain_text("base prediction")
    expect(rows).to_contain_text("TuneBoard Assistant")  # the identity references
    grid = rows.locator("[role=grid]")
    expect(grid).to_have_attribute("aria-rowcount", "4")  # header + 3 rows
    page.locator("#eval-worst_first input").check()
    expect(grid).to_have_attribute("aria-rowcount", "4")
    # a click on a row shows it in full: question, reference, both answers
    page.locator('#eval-rows [data-testid="cell-0-1"]').click()
    for word in ("Question", "Reference", "tuned", "base"):
        expect(page.locator("#eval-detail")).to_contain_text(word)
    expect(page.locator("#eval-progress .tb-progress")).to_have_attribute("data-state", "completed")
    # what the table shows is what the eval processes wrote
    # the newest eval folder is this test's (names are timestamps; glob's order is the file system's)
    results = sorted(jobs.paths.saves_dir().joinpath(".tools").glob("eval-*/tuned/eval_results.json"))
    assert results and json.loads(results[-1].read_text())["rows"] == 3
    page.wait_for_timeout(800)
    shot("eval")


def test_export_tab_merges_and_verifies(app_page, finished_runs, tiny_llama, tmp_path, shot):
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-template", "default")
    open_tab(page, "Export")
    page.locator("#top-adapter_refresh").click()
    adapter = str(finished_runs[0])
    pick_option(page, "top-adapter_name_or_path", adapter_label(adapter))  # listed by the refreshed picker
    out = tmp_path / "merged"
    page.locator("#export-dir textarea, #export-dir input").first.fill(str(out))
    page.locator("#export-start").click()
    expect(page.locator("#export-message")).to_contain_text("Exporting to")
    expect(page.locator("#export-result")).to_contain_text("export PASSED", timeout=240_000)
    expect(page.locator("#export-progress .tb-progress")).to_have_attribute("data-state", "passed")
    expect(page.locator("#export-message")).not_to_contain_text("Exporting to")  # not left on screen
    checks = page.locator("#export-checks")
    for name in ("logits", "adapter_merged", "chat_template", "eos"):
        expect(checks).to_contain_text(name)
    expect(page.locator("#export-log textarea")).to_have_value(
        re.compile(r"\[export 6/6\]"))
    report = json.loads((out / "export_report.json").read_text())
    assert report["ok"] and (out / "model.safetensors").exists()
    page.wait_for_timeout(500)
    shot("export")
    # a second export into the same, now non-empty folder is refused in the tab (nothing launched) unless overwrite
    # is ticked, and the first export's checks are not shown as this one's
    page.locator("#export-start").click()
    expect(page.locator("#export-message")).to_contain_text("is not empty", timeout=60_000)
    expect(page.locator("#export-message")).to_contain_text("Overwrite")
    expect(page.locator("#export-progress .tb-progress")).to_have_attribute("data-state", "idle")
    expect(checks).not_to_contain_text("adapter_merged")


def test_export_tab_reattaches_after_a_reload(app_page, finished_runs, tiny_llama, tmp_path):
    # the earlier test's last export (refused: its folder was not empty) may still be exiting, and while it runs a
    # Start is refused ("An export is already running"), as it should be: it failed so once under a loaded CI run
    wait_for(lambda: not any(tools.alive(j) for j in tools.job_dirs("export")), timeout=60,
             what="the earlier exports to exit")
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-template", "default")
    open_tab(page, "Export")
    page.locator("#top-adapter_refresh").click()
    pick_option(page, "top-adapter_name_or_path", adapter_label(finished_runs[1]))
    out = tmp_path / "merged-then-reloaded"
    page.locator("#export-dir textarea, #export-dir input").first.fill(str(out))
    # the page re-attached to the earlier test's export; Start right away: a tick of that job answered after Start
    # leaves the new export alone (webui.page_jobs; it once put the old job's "ended" over it)
    page.locator("#export-start").click()
    expect(page.locator("#export-message")).to_contain_text("Exporting to")
    started = tools.job_dirs("export")[0]
    # the browser's state is gone with the reload; the page finds the job in saves/.tools again
    page.reload()
    page.locator("#tb-header").wait_for()
    open_tab(page, "Export")
    expect(page.locator("#export-message")).to_contain_text("picked up again")
    expect(page.locator("#export-message")).to_contain_text(str(out))
    expect(page.locator("#export-progress .tb-progress")).to_have_attribute(
        "data-state", re.compile("running|passed"), timeout=30_000)
    expect(page.locator("#export-result")).to_contain_text("export PASSED", timeout=240_000)
    expect(page.locator("#export-progress .tb-progress")).to_have_attribute("data-state", "passed")
    expect(page.locator("#export-checks")).to_contain_text("adapter_merged")
    # the log of that same job, from its first line
    expect(page.locator("#export-log textarea")).to_have_value(re.compile(r"\[export 1/6\][\s\S]*\[export 6/6\]"))
    assert (started / "launch.json").exists() and json.loads((out / "export_report.json").read_text())["ok"]
    assert tools.job_dirs("export")[0] == started  # no new job


def test_start_while_training_queues_and_runs_shows_it(app_page, tiny_llama, shot):
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_number(page, "train-max_steps", 5000)  # outlasts the checks: a tiny model can run ~100 steps/s
    page.locator("#train-start").click()
    expect(page.locator("#train-message")).to_contain_text("Started", timeout=30_000)
    first = page.locator("#train-progress .tb-run-name").inner_text()
    page.locator("#train-start").click()
    expect(page.locator("#train-message")).to_contain_text("Queued", timeout=30_000)
    expect(page.locator("#train-progress .tb-progress")).to_have_attribute("data-state", "queued")
    second = page.locator("#train-progress .tb-run-name").inner_text()
    assert second != first
    open_tab(page, "Runs")
    table = page.locator("#runs-table")
    expect(table).to_contain_text(second)
    page.wait_for_timeout(500)
    shot("runs-queue")
    expect(table).to_contain_text("queued")
    pick_option(page, "runs-status", "queued")
    expect(table).to_contain_text(second)
    # (two Starts in one second name the second run <first>-2: match the first's name as a whole word)
    expect(table).not_to_contain_text(re.compile(re.escape(first) + r"(?![-\w])"))
    # Abort on the queued run takes it off the queue; the running one is stopped too
    open_tab(page, "Train")
    page.locator("#train-abort").click()
    # (the next tick must not blank it: the removed run has no end to announce)
    expect(page.locator("#train-message")).to_contain_text("Removed")
    assert jobs.JobQueue().entries() == []
    running = jobs.find_active_run()
    assert running and running.endswith(first)
    jobs.abort(running, term_after_s=60, kill_after_s=10, wait=True)
    assert not jobs.run_state(running).alive
