"""What a user does on the page, shared by the browser tests (tests/e2e is on sys.path)."""
from playwright.sync_api import expect


def open_tab(page, name):
    page.get_by_role("tab", name=name).click()


def set_dropdown(page, elem_id, value):
    box = page.locator(f"#{elem_id} input")
    box.fill(str(value))
    box.press("Enter")
    page.locator("#tb-header").click()  # blur: the list closes


def open_chat_settings(page):
    """Open the Chat tab's "System prompt, tools and sampling" section. Tests open it BEFORE Load: Gradio mounts a
    closed accordion's fields only when it opens, and under a loaded machine its late prop updates once wrote the
    sliders' defaults over numbers typed right after the click (Max new tokens back to 512, CI 2026-12-07); Load's
    seconds leave the mount done before anything is typed."""
    page.locator("#chat-settings").get_by_text("System prompt, tools and sampling").click()
    expect(page.locator("#chat-seed textarea, #chat-seed input").first).to_be_visible()


def set_number(page, elem_id, value):
    box = page.locator(f"#{elem_id} input[type=number]").first
    box.fill(str(value))
    box.press("Tab")


def pick_option(page, elem_id, name):
    """Type to filter the dropdown down to `name`, check that it is offered, take it with Enter (a click
    on the option can miss while a plot above re-renders and moves the list)."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(name)
    # this dropdown's own list: another one still closing can offer the same name (strict-mode clash)
    options = page.locator(f"#{box.get_attribute('aria-controls')}")
    expect(options.get_by_role("option", name=name, exact=True)).to_be_visible()
    box.press("Enter")
    box.press("Escape")
    page.locator("#tb-header").click()  # blur: the list closes


def click_start(page, started_text, shot, shot_name):
    """Press Start and wait for the message that the run started (`started_text`, in the page's language); when the
    pre-flight's data check shows its findings first (once: webui/data_check.py), press Start again, as a user
    would. If the start does not come, save a screenshot as `shot_name` and fail with what the errors box says.
    Returns the message."""
    page.locator("#train-start").click()
    message = page.locator("#train-message")
    try:
        # the data check may take up to its wait (15 s) before either message comes
        expect(message.filter(has_text=started_text).or_(page.locator("#train-data-check"))).to_be_visible(
            timeout=45_000)
        if page.locator("#train-data-check").is_visible():
            page.locator("#train-start").click()
        expect(message).to_contain_text(started_text, timeout=30_000)
    except AssertionError:
        shot(shot_name)
        raise AssertionError("not started; errors box: " + page.locator("#train-errors").inner_text()) from None
    return message
