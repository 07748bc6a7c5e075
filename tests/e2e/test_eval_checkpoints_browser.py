"""The Evaluate tab's Checkpoints part in headless Chromium (issue 20 item 6): pick a finished run and two of its
checkpoints, Start runs them (and nothing else) on the same rows as the tab's job; the table marks the best of each
metric, the plot is drawn, and Promote makes the picked checkpoint the run's adapter."""
import json
import shutil

from playwright.sync_api import expect

from ui_actions import open_tab, pick_option, set_number

from backend.core.rundir import PROMOTION_FILE


def test_checkpoints_part_evaluates_picked_checkpoints_and_promotes(app_page, saves_root, finished_runs, shot):
    page = app_page
    run = saves_root / "tiny_llama" / "lora" / "run-ckpt-eval"  # a copy: promote changes it
    shutil.copytree(finished_runs[1], run)
    try:
        open_tab(page, "Evaluate")
        set_number(page, "eval-max_samples", 2)
        set_number(page, "eval-max_new_tokens", 4)
        page.locator("#eval-group-checkpoints").get_by_text("Checkpoints of a run").click()
        page.locator("#eval-ckpt_mode input").check()
        pick_option(page, "eval-ckpt_run", "tiny_llama/lora/run-ckpt-eval")
        pick_option(page, "eval-ckpt_names", "checkpoint-1")
        pick_option(page, "eval-ckpt_names", "checkpoint-3")
        page.locator("#eval-start").click()
        expect(page.locator("#eval-message")).to_contain_text("Evaluating", timeout=30_000)
        expect(page.locator("#eval-message")).to_contain_text("Eval done", timeout=240_000)
        table = page.locator("#eval-ckpt_table")
        expect(table).to_contain_text("checkpoint-3", timeout=20_000)
        expect(table).to_contain_text("★")
        expect(table).not_to_contain_text("checkpoint-2")  # not picked
        expect(page.locator("#eval-ckpt_summary")).to_contain_text("Best eval_loss")
        expect(page.locator("#eval-ckpt_plot canvas, #eval-ckpt_plot svg").first).to_be_visible()
        shot("eval-checkpoints")

        pick_option(page, "eval-ckpt_promote_pick", "checkpoint-1")
        page.locator("#eval-ckpt_promote").click()
        expect(page.locator("#eval-ckpt_message")).to_contain_text("checkpoint-1 is now the adapter of "
                                                                    "tiny_llama/lora/run-ckpt-eval")
        assert json.loads((run / PROMOTION_FILE).read_text())["checkpoint"] == "checkpoint-1"
    finally:
        shutil.rmtree(run, ignore_errors=True)
