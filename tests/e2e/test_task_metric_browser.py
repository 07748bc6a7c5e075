"""eval_metric in headless Chromium (issue 20 item 1): an SFT run started from the form with a task metric
scored at each save shows the 'task metric' plot next to the loss, filled from trainer_log.jsonl as the saves
come, and the run folder's checkpoint_scores.json holds the same saves."""
import json
import re
from pathlib import Path

from playwright.sync_api import expect

from test_preference import point_labels, wait_for_points
from ui_actions import click_start, pick_option, set_dropdown, set_number


def test_train_tab_plots_the_task_metric_of_each_save(app_page, saves_root, tiny_llama, shot):
    from backend.core.rundir import CHECKPOINT_SCORES_FILE

    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-template", "default")  # the tiny Llama has no chat template of its own
    dataset = page.locator("#train-dataset textarea, #train-dataset input").first
    dataset.fill("identity")
    dataset.press("Tab")
    set_number(page, "train-max_steps", 4)
    set_number(page, "train-cutoff_len", 128)
    set_number(page, "train-per_device_train_batch_size", 4)
    page.locator("#train-group-train").click(position={"x": 30, "y": 14})
    set_number(page, "train-save_steps", 2)
    page.locator("#train-group-data").click(position={"x": 30, "y": 14})
    set_number(page, "train-val_size", 8)
    page.locator("#train-group-eval").click(position={"x": 30, "y": 14})
    pick_option(page, "train-eval_metric", "rouge_l")
    set_number(page, "train-eval_samples", 4)
    expect(page.locator("#train-plot_task_metric")).to_be_hidden()  # an sft run shows it once it logs a score
    message = click_start(page, "Started", shot, "train-task-metric-start-failed")
    assert re.search(r"Started (\S+)", message.inner_text())

    plot = "#train-plot_task_metric"
    expect(page.locator(plot)).to_be_visible(timeout=240_000)
    wait_for_points(page, plot, n=2, timeout=240_000)
    assert "eval_rouge_l" in point_labels(page, plot)
    shot("train-task-metric-live")
    expect(page.locator("#train-progress .tb-progress")).to_have_attribute("data-state", "completed",
                                                                           timeout=300_000)
    scores = json.loads(next(Path(saves_root).rglob(CHECKPOINT_SCORES_FILE)).read_text())  # the one run
    assert scores["metric"] == "rouge_l" and [s["step"] for s in scores["scores"]] == [2, 4]
