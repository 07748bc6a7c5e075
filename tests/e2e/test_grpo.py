"""GRPO in headless Chromium: picked in the form on the tiny Llama with the json_valid reward, it trains live:
the reward and reward-per-function curves fill from the run's trainer_log.jsonl and the completions table
under the plots shows what the model wrote, with its rewards."""
import re

from playwright.sync_api import expect

from test_preference import point_labels, wait_for_points
from ui_actions import click_start, pick_option, set_dropdown, set_number


def test_grpo_from_the_form_shows_rewards_and_completions_live(app_page, tiny_llama, shot):
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-template", "default")  # the tiny Llama has no chat template of its own
    pick_option(page, "train-stage", "GRPO")
    dataset = page.locator("#train-dataset textarea, #train-dataset input").first
    dataset.fill("identity")
    dataset.press("Tab")
    dataset.press("Escape")  # its option list closed (the screenshots showed it open over the form all run long)
    page.locator("#tb-header").click()
    set_number(page, "train-max_steps", 4)
    set_number(page, "train-cutoff_len", 128)
    set_number(page, "train-per_device_train_batch_size", 4)
    set_number(page, "train-gradient_accumulation_steps", 1)
    page.locator("#train-group-method").get_by_text("Method").first.click()
    expect(page.locator("#train-reward_funcs")).to_be_visible()
    expect(page.locator("#train-temperature")).to_be_visible()  # GRPO samples: its sampling keys are offered
    set_dropdown(page, "train-reward_funcs", "json_valid")
    set_number(page, "train-max_completion_length", 8)
    set_number(page, "train-num_generations", 2)
    message = click_start(page, "Started", shot, "train-grpo-start-failed")
    assert re.search(r"Started (\S+)", message.inner_text())

    reward, per_function = "#train-plot_reward", "#train-plot_rewards_per_function"
    expect(page.locator(reward)).to_be_visible(timeout=30_000)
    expect(page.locator("#train-plot_rewards")).to_be_hidden()  # DPO's, not GRPO's
    wait_for_points(page, reward)
    assert "reward" in point_labels(page, reward)
    wait_for_points(page, per_function)
    assert "rewards/json_valid/mean" in point_labels(page, per_function)
    table = page.locator("#train-completions")
    expect(table).to_be_visible()
    expect(table).to_contain_text("json_valid")
    shot("train-grpo-live")
    expect(page.locator("#train-progress .tb-progress")).to_have_attribute("data-state", "completed",
                                                                           timeout=300_000)
