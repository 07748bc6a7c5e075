"""The preference stages in headless Chromium: DPO picked in the form on the tiny Llama trains live (its
reward-accuracy and reward curves are drawn from the run's trainer_log.jsonl), completes, and the Runs tab
lists it with its stage; the Runs overlay plots any logged metric; "Continue with DPO" fills the form from a
finished SFT LoRA run; the Data tab shows a ranking row as prompt + chosen + rejected."""
import json
import re

from playwright.sync_api import expect

from ui_actions import click_start, open_tab, pick_option, set_dropdown, set_number

POINTS = '[aria-roledescription="point"]'


def point_labels(page, plot):
    return " ".join(page.locator(f"{plot} {POINTS}").evaluate_all(
        "els => els.map(e => e.getAttribute('aria-label') || '')"))


def wait_for_points(page, plot, n=1, timeout=120_000):
    page.wait_for_function(f"() => document.querySelectorAll('{plot} {POINTS}').length >= {n}", timeout=timeout)


def wait_for_lines(page, plot, n):
    """At least n lines drawn with a stroke colour (a line with none is invisible)."""
    page.wait_for_function(
        f"() => [...document.querySelectorAll('{plot} .mark-line path')]"
        f".filter(p => p.getAttribute('stroke') && (p.getAttribute('d') || '').includes('L')).length >= {n}",
        timeout=60_000)


def runs_row(page, name):
    """The cells of the Runs table's row whose name cell is `name`. Gradio 6's table draws its rows as
    `div.virtual-row`; its only body `tr` is a hidden sizing row made of each column's longest value (its
    stage cell read 'grpo' next to the DPO run's name), never a row of the table."""
    row = page.locator("#runs-table .virtual-row", has=page.get_by_text(name, exact=True))
    expect(row).to_have_count(1)
    return [c.strip() for c in row.locator(".body-cell").all_text_contents()]


def test_dpo_from_the_form_plots_rewards_live_and_is_listed_with_its_stage(app_page, tiny_llama, shot):
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-template", "default")  # the tiny Llama has no chat template of its own
    pick_option(page, "train-stage", "DPO")
    dataset = page.locator("#train-dataset textarea, #train-dataset input").first
    # the stage's refill of the dataset choices has come (it switches the SFT set away) before the dataset is typed:
    # choices changing under a filtered list broke Gradio's list (below), once even so under a loaded CI run
    expect(dataset).not_to_have_value("identity", timeout=30_000)
    dataset.fill("dpo_en_demo")
    dataset.press("Tab")
    # its option list closed: open, filtered to the typed name, it broke Gradio's list (reading '0' of an option
    # index past the choices) when the stage's refill changed the dataset choices under it
    dataset.press("Escape")
    page.locator("#tb-header").click()
    set_number(page, "train-max_steps", 12)
    set_number(page, "train-cutoff_len", 128)
    if page.locator("#train-stage input").input_value() != "DPO":  # refilled from the attached run meanwhile
        pick_option(page, "train-stage", "DPO")
    message = click_start(page, "Started", shot, "train-dpo-start-failed")
    name = re.search(r"Started (\S+)", message.inner_text()).group(1).strip("`")

    # the stage's declared plots appear next to the loss plot and fill from the run's log
    accuracy, rewards = "#train-plot_accuracy", "#train-plot_rewards"
    expect(page.locator(accuracy)).to_be_visible(timeout=30_000)
    expect(page.locator(rewards)).to_be_visible()
    expect(page.locator("#train-plot_kl")).to_be_hidden()  # a KTO plot, not DPO's
    wait_for_points(page, accuracy)
    assert "rewards/accuracies" in point_labels(page, accuracy)
    wait_for_lines(page, rewards, 3)  # chosen, rejected, margins: each a visible line
    labels = point_labels(page, rewards)
    for series in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert series in labels, labels[:300]
    shot("train-dpo-live")

    state = page.locator("#train-progress .tb-progress")
    expect(state).to_have_attribute("data-state", "completed", timeout=300_000)
    wait_for_lines(page, accuracy, 1)
    assert page.locator(f"#train-loss_plot {POINTS}").count() > 0  # the loss plot stays as it was
    page.wait_for_timeout(500)
    shot("train-dpo-completed")

    open_tab(page, "Runs")
    cells = runs_row(page, name)
    assert cells[1] == "dpo" and "dpo_en_demo" in cells and "completed" in cells, cells
    shot("runs-dpo")


def dpo_log_run(saves_root):
    """A finished DPO run as the backend leaves it (run_spec.yaml, status.json, trainer_log.jsonl with the
    declared metric keys), written by hand: the overlay only reads these files."""
    from webui import jobs

    d = saves_root / "handmade" / "dpo-log"
    jobs.write_spec_yaml(d, f"model_name_or_path: m\nstage: dpo\ndataset: dpo_en_demo\noutput_dir: {d}\n")
    rows = [{"step": s, "loss": 0.69 - 0.05 * s, "rewards/accuracies": min(1.0, 0.2 * s),
             "rewards/margins": 0.03 * s, "rewards/chosen": 0.01 * s, "rewards/rejected": -0.02 * s}
            for s in range(1, 6)]
    (d / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "status.json").write_text(json.dumps({"state": "completed", "step": 5, "total_steps": 5}))
    return d


def test_overlay_plots_any_logged_metric_and_continue_with_dpo(app_page, finished_runs, saves_root, shot):
    page = app_page
    dpo_log_run(saves_root)
    open_tab(page, "Runs")
    page.locator("#runs-refresh").click()
    pick_option(page, "runs-select", "handmade/dpo-log")
    sft = f"tiny_llama/lora/{finished_runs[1].name}"
    pick_option(page, "runs-select", sft)
    wait_for_points(page, "#runs-overlay", 5 + 3, timeout=30_000)  # the loss of both runs
    # the metric picker offers what the selected runs logged; pick the DPO run's reward accuracy
    pick_option(page, "runs-metric", "rewards/accuracies")
    page.wait_for_function(  # the y axis says what is drawn
        "() => [...document.querySelectorAll('#runs-overlay text')].some(t => t.textContent === 'rewards/accuracies')",
        timeout=30_000)
    page.wait_for_function("() => document.querySelectorAll('#runs-overlay [aria-roledescription=\"point\"]')"
                           ".length === 5", timeout=30_000)
    wait_for_lines(page, "#runs-overlay", 1)
    labels = point_labels(page, "#runs-overlay")
    # series are named by the shortest distinct run name; the SFT run logged no accuracy
    assert "dpo-log" in labels and finished_runs[1].name not in labels, labels[:300]
    shot("runs-overlay-metric")

    # SFT -> DPO: the finished SFT LoRA run's adapter, stage dpo and a ranking dataset go into the form
    pick_option(page, "runs-target", sft)
    page.locator("#runs-continue_dpo").click()
    expect(page.locator("#runs-message")).to_contain_text("DPO on top of")
    expect(page.locator("#train-start")).to_be_visible()  # on the Train tab
    expect(page.locator("#train-stage input")).to_have_value("DPO")
    expect(page.locator("#train-dataset textarea, #train-dataset input").first).to_have_value("dpo_en_demo")
    # the Train tab says that Start trains this adapter further (and offers to drop it)
    expect(page.locator("#train-adapter_note")).to_contain_text("Continue training from adapter")
    expect(page.locator("#train-adapter_note")).to_contain_text(str(finished_runs[1]))
    expect(page.locator("#train-adapter_clear")).to_be_visible()
    shot("train-continue-dpo")


def test_data_tab_shows_a_ranking_row_as_prompt_chosen_rejected(app_page, shot):
    from backend.core.paths import DATA_DIR

    raw = json.loads((DATA_DIR / "dpo_en_demo.json").read_text())[0]
    open_tab(app_page, "Data")
    pick_option(app_page, "data-dataset", "dpo_en_demo")
    preview = app_page.locator("#data-preview")
    expect(preview.locator('[data-part="rejected"] .tb-trained').first).to_be_visible(timeout=120_000)
    expect(preview.locator('[data-part="prompt"]')).to_contain_text(raw["instruction"])
    expect(preview.locator('[data-part="prompt"] .tb-trained')).to_have_count(0)
    expect(preview.locator('[data-part="chosen"] .tb-trained').first).to_contain_text(raw["chosen"])
    expect(preview.locator('[data-part="rejected"] .tb-trained').first).to_contain_text(raw["rejected"])
    expect(preview).to_contain_text(raw["instruction"])
    assert preview.inner_text().count(raw["instruction"]) == 1  # the prompt is shown once
    expect(app_page.locator("#data-summary")).to_contain_text("rejected")
    shot("data-ranking-row")
