"""Issue 24, item 1, in the browser: a run trains, a second Start queues behind it, Abort takes the queued one
off the queue, and the live view goes back to the run that trains (its name, its state, its loss plot) instead
of showing "unknown" and an empty plot while the real run trains unseen."""
from playwright.sync_api import expect

from webui import jobs


def test_abort_of_a_queued_run_returns_the_view_to_the_running_one(app_page, saves_root, tiny_llama, shot):
    page = app_page
    model = page.locator("#top-model_name_or_path input")
    model.fill(str(tiny_llama))
    model.press("Enter")
    steps = page.locator("#train-max_steps input")
    steps.fill("5000")  # still training while the test queues and aborts (it is stopped at the end)
    steps.press("Tab")
    card = page.locator("#train-progress .tb-progress")
    name = page.locator("#train-progress .tb-run-name")
    first_dir = None
    try:
        page.locator("#train-start").click()
        expect(page.locator("#train-message")).to_contain_text("Started", timeout=30_000)
        expect(name).not_to_be_empty()
        first = name.inner_text()
        first_dir = str(saves_root / first)
        page.locator("#train-start").click()  # the same form again: a new run folder, queued behind the first
        expect(page.locator("#train-message")).to_contain_text("Queued")
        expect(card).to_have_attribute("data-state", "queued")
        queued = name.inner_text()
        assert queued != first
        page.locator("#train-abort").click()
        message = page.locator("#train-message")  # markdown: the run names are code, without their backticks
        expect(message).to_contain_text(f"Removed {queued} from the queue. Showing {first}, which is still training")
        expect(name).to_have_text(first)
        expect(card).not_to_have_attribute("data-state", "unknown")
        expect(card).to_have_attribute("data-state", "running", timeout=240_000)  # a bound on a loaded box
        # its loss curve is drawn again (the timer follows the running run)
        page.wait_for_function("() => document.querySelectorAll('#train-loss_plot [aria-roledescription=\"point\"]')"
                               ".length > 0", timeout=240_000)
        shot("train-queue-abort")
        assert [e for e in jobs.JobQueue(saves_root).entries() if e.run_dir.endswith(queued)] == []
        page.locator("#train-abort").click()  # now Abort stops the run it shows
        expect(message).to_contain_text(f"Stopping {first}")
        expect(card).to_have_attribute("data-state", "aborted", timeout=180_000)
    finally:
        if first_dir:
            jobs.abort(first_dir, term_after_s=5, kill_after_s=5, wait=True)
