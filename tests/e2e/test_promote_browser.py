"""Promote in the Runs tab (issue 20 item 2), in headless Chromium: pick a run and a checkpoint, Promote ->
the checkpoint table marks it and the top-level adapter is that checkpoint's; the Chat tab loading the run
folder and the Export tab merging it say they load that checkpoint; Undo promote puts the run's own final
adapter back byte for byte."""
import json
import shutil

from playwright.sync_api import expect

from ui_actions import open_tab, pick_option, set_dropdown

from backend.core.rundir import CHECKPOINT_SCORES_FILE

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _bytes(folder):
    return {n: (folder / n).read_bytes() for n in ADAPTER_FILES}


def test_promote_a_checkpoint_then_undo(app_page, saves_root, tiny_llama, finished_runs, tmp_path, shot):
    page = app_page
    run = saves_root / "tiny_llama" / "lora" / "run-promote"  # a copy: the other tests keep run-b as trained
    shutil.copytree(finished_runs[1], run)
    try:
        _promote_then_undo(page, run, tiny_llama, tmp_path / "merged", shot)
    finally:  # the other tests see the runs they made, no more
        shutil.rmtree(run, ignore_errors=True)


def _promote_then_undo(page, run, tiny_llama, out, shot):
    final = _bytes(run)
    assert final != _bytes(run / "checkpoint-1")
    # the task metric of each save, as a run with eval_metric writes it: checkpoint-1 scored best
    (run / CHECKPOINT_SCORES_FILE).write_text(json.dumps({
        "metric": "exact_match", "greater_is_better": True, "samples": 4,
        "scores": [{"step": s, "checkpoint": f"checkpoint-{s}", "value": v, "seconds": 0.1}
                   for s, v in ((1, 0.75), (2, 0.25), (3, 0.5))],
        "best": {"step": 1, "checkpoint": "checkpoint-1", "value": 0.75}}))

    open_tab(page, "Runs")
    page.locator("#runs-refresh").click()
    pick_option(page, "runs-target", "tiny_llama/lora/run-promote")
    table = page.locator("#runs-checkpoints")
    expect(table).to_contain_text("checkpoint-3")
    expect(table).to_contain_text("exact_match")
    expect(table).to_contain_text("0.7500 ★")
    expect(table.locator("[role=gridcell]", has_text="✓")).to_have_count(0)

    pick_option(page, "runs-checkpoint", "checkpoint-1")
    page.locator("#runs-promote").click()
    expect(page.locator("#runs-message")).to_contain_text("checkpoint-1 is now the adapter of tiny_llama/lora/run-promote")
    expect(table.locator("[role=gridcell]", has_text="✓")).to_have_count(1)
    assert _bytes(run) == _bytes(run / "checkpoint-1")
    shot("runs-promote")

    # the Chat tab loads the run folder: it is the promoted checkpoint, and it says so
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-adapter_name_or_path", run)
    set_dropdown(page, "top-template", "default")  # the tiny Llama has no chat template of its own
    open_tab(page, "Chat")
    page.locator("#chat-load").click()
    expect(page.locator("#chat-status")).to_contain_text("weights = checkpoint-1 of the run (promoted)", timeout=120_000)
    page.locator("#chat-unload").click()
    expect(page.locator("#chat-status")).to_contain_text("unloaded", timeout=30_000)

    # the Export tab merges the run folder's adapter: the promoted checkpoint, named in the result and report
    open_tab(page, "Export")
    page.locator("#export-dir textarea, #export-dir input").first.fill(str(out))
    page.locator("#export-start").click()
    expect(page.locator("#export-result")).to_contain_text("export PASSED", timeout=240_000)
    expect(page.locator("#export-result")).to_contain_text("its promoted checkpoint-1 was exported")
    assert json.loads((out / "export_report.json").read_text())["source"]["promoted"] == {str(run): "checkpoint-1"}

    open_tab(page, "Runs")
    page.locator("#runs-undo_promote").click()
    expect(page.locator("#runs-message")).to_contain_text("has its own final adapter again")
    expect(table.locator("[role=gridcell]", has_text="✓")).to_have_count(0)
    assert _bytes(run) == final
