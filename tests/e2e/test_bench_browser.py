"""The Evaluate tab's Benchmarks section in headless Chromium (issue 20 item 3): on a run made by the real
`tuneboard train`, Run benchmarks scores the shipped lm-eval task with the base model and the tuned one as the
tab's job, and the table shows both side by side with the delta."""
from playwright.sync_api import expect

from ui_actions import open_tab, set_dropdown


def test_benchmarks_show_base_and_tuned_side_by_side(app_page, finished_runs, tiny_llama, shot):
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-adapter_name_or_path", finished_runs[0])
    set_dropdown(page, "top-template", "default")
    open_tab(page, "Evaluate")
    page.locator("#eval-group-bench").get_by_text("Benchmarks (lm-evaluation-harness)").click()
    expect(page.locator("#eval-bench_tasks")).to_contain_text("tuneboard_mc")  # the shipped task, picked
    page.locator("#eval-bench_limit textarea, #eval-bench_limit input").first.fill("4")
    page.locator("#eval-bench_start").click()
    expect(page.locator("#eval-message")).to_contain_text("Running the benchmarks", timeout=30_000)
    expect(page.locator("#eval-message")).to_contain_text("Benchmarks done", timeout=300_000)
    table = page.locator("#eval-bench_rows")
    for word in ("tuneboard_mc", "acc_norm", "base", "tuned", "delta", "±"):
        expect(table).to_contain_text(word, timeout=20_000)
    expect(page.locator("#eval-bench_summary")).to_contain_text("Benchmarks")
    shot("eval-benchmarks")
