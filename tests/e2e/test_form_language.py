"""The Train form as a new user meets it (issue 24): the dataset picker follows the stage, every input has an
accessible name, the top bar's model box shows its whole value, and a German page says everything in German
while a run trains (plot axes, Abort message), with no progress overlay over the card at the timer's ticks."""
import re

from playwright.sync_api import expect

from ui_actions import click_start, pick_option

# the inputs of the top bar and the Train tab, each with whether it has an accessible name (what a screen reader, and
# Playwright's get_by_label, find it by): a <label>, aria-label, aria-labelledby or title with some text
INPUT_NAMES_JS = """() => [...document.querySelectorAll(
    '#tb-topbar input, #tb-topbar select, #tb-topbar textarea,'
    + ' [id^="train-"] input, [id^="train-"] select, [id^="train-"] textarea')]
  .filter(e => e.type !== 'hidden' && e.offsetParent !== null)
  .map(e => {
    const byLabel = e.labels && [...e.labels].some(l => l.textContent.trim());
    const byAria = (e.getAttribute('aria-label') || '').trim();
    const byRef = (e.getAttribute('aria-labelledby') || '').split(' ').filter(Boolean)
      .some(id => (document.getElementById(id)?.textContent || '').trim());
    const where = (e.closest('[id]')?.id || '?') + ':' + e.tagName.toLowerCase() + '[' + (e.type || '') + ']';
    return [where, Boolean(byLabel || byAria || byRef || (e.title || '').trim())];
  })"""


def test_picking_dpo_switches_the_dataset_to_a_ranking_set_and_preview_works(app_page, shot):
    page = app_page
    dataset = page.locator("#train-dataset input")
    expect(dataset).to_have_value("identity")
    pick_option(page, "train-stage", "DPO")
    expect(dataset).to_have_value("dpo_en_demo")
    message = page.locator("#train-message")
    expect(message).to_contain_text("identity")
    expect(message).to_contain_text("dpo_en_demo")
    # the picker offers the sets that fit DPO (ranking pairs), not the conversations
    dataset.click()
    options = page.locator(f"#{dataset.get_attribute('aria-controls')}")
    expect(options.get_by_role("option", name="dpo_en_demo", exact=True)).to_be_visible()
    expect(options.get_by_role("option", name="identity", exact=True)).to_have_count(0)
    dataset.press("Escape")
    page.locator("#tb-header").click()
    page.locator("#train-preview").click()
    expect(page.locator("#train-preview_yaml")).to_contain_text("stage: dpo")
    expect(page.locator("#train-errors")).to_be_hidden()
    # the whole YAML (the editor draws only the lines in view): the file its Download link offers
    href = page.locator("#train-preview_yaml a[href^='blob:']").first.get_attribute("href")
    yaml_text = page.evaluate("async url => await (await fetch(url)).text()", href)
    assert "\ndataset: dpo_en_demo\n" in yaml_text, yaml_text[:2000]
    shot("train-dpo-dataset-switched")


def test_every_train_input_has_an_accessible_name_and_the_model_box_shows_its_value(app_page, shot):
    page = app_page
    # open every accordion (their inputs too): each closed one that shows, until none is left and the LoRA group's
    # inputs are drawn. One pass over the groups once missed one still being shown after the earlier test's stage
    # switch (a full two-worker run), and a click on an open group would close it.
    for _ in range(40):
        closed = [group for group in page.locator('[id^="train-group-"]').all()
                  if group.is_visible() and group.locator(".label-wrap.open").count() == 0]
        for group in closed:
            group.locator(".label-wrap").first.click()
        if not closed and page.evaluate("() => document.querySelectorAll('#train-lora_rank input').length > 0"):
            break
        page.wait_for_timeout(500)
    page.wait_for_function("() => document.querySelectorAll('#train-lora_rank input').length > 0")
    inputs = page.evaluate(INPUT_NAMES_JS)
    assert len(inputs) > 30, inputs  # the check saw the form's inputs (the open accordions' too)
    unnamed = [where for where, named in inputs if not named]
    assert unnamed == [], f"inputs without an accessible name: {unnamed}"
    expect(page.get_by_label("Dataset", exact=True)).to_have_count(1)
    # the model box shows its whole value, the bundled model's label included
    model = page.locator("#top-model_name_or_path input")
    expect(model).to_have_value(re.compile(r"HuggingFaceTB/SmolLM2.* · bundled Q4_1 GGUF"))
    fits = model.evaluate("e => e.scrollWidth <= e.clientWidth + 1")
    assert fits, model.evaluate("e => [e.scrollWidth, e.clientWidth, e.value]")
    shot("train-topbar")


def test_a_field_error_shows_its_message_with_the_error_style_and_no_emoji(app_page):
    page = app_page
    box = page.locator("#train-cutoff_len input")
    box.fill("2")
    box.press("Tab")
    page.locator("#train-preview").click()
    field = page.locator("#train-cutoff_len")
    expect(field).to_have_class(re.compile(r"\btb-field-error\b"))
    info = field.locator(".info-text")
    expect(info).to_contain_text("must be")
    assert "✖" not in field.inner_text()
    # red, after the error icon the stylesheet draws (an SVG, not a font glyph)
    assert info.evaluate("e => getComputedStyle(e).color") == "rgb(220, 38, 38)"
    assert "svg" in info.evaluate("e => getComputedStyle(e, '::before').backgroundImage")


# Records, from the page itself, every progress overlay Gradio shows over the progress card ("processing |
# 3.2/2.3s", "queue: 1/1") and each redraw of the card (a timer tick that changed it: its elapsed time does).
WATCH_PROGRESS_JS = """() => {
  window.tbOverlays = []; window.tbCardDraws = 0;
  const box = document.querySelector('#train-progress');
  new MutationObserver(records => {
    const inCard = n => { const e = n.nodeType === 1 ? n : n.parentElement; return e && e.closest('.tb-progress, .prose'); };
    if (records.some(r => inCard(r.target) || [...r.addedNodes].some(n => n.nodeType === 1 && n.querySelector?.('.tb-progress'))))
      window.tbCardDraws++;  // one redraw of the card (whatever way Gradio patches it in)
    const tracker = box.querySelector('[data-testid="status-tracker"]');
    const text = tracker ? tracker.textContent.trim() : '';
    if (tracker && !tracker.classList.contains('hide') && /processing|queue|\\d+\\.\\d+s/.test(text))
      window.tbOverlays.push(text);
  }).observe(box, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def test_a_german_page_shows_the_run_in_german_without_progress_overlays(app_page, tiny_llama, shot):
    page = app_page
    page.locator("#top-lang input").click()
    page.get_by_role("option", name="Deutsch").click()
    expect(page.locator("#train-progress .tb-badge")).to_have_text("bereit")
    model = page.locator("#top-model_name_or_path input")
    model.fill(str(tiny_llama))
    model.press("Enter")
    page.locator("#tb-header").click()
    template = page.locator("#top-template input")
    template.fill("default")  # the tiny Llama has no chat template of its own
    template.press("Enter")
    page.locator("#tb-header").click()
    steps = page.locator("#train-max_steps input")
    steps.fill("5000")  # far more than the test watches (it aborts)
    steps.press("Tab")
    message = click_start(page, "gestartet", shot, "train-de-start-failed")
    state = page.locator("#train-progress .tb-progress")
    expect(state).to_have_attribute("data-state", "running", timeout=120_000)
    page.wait_for_function("() => document.querySelectorAll('#train-loss_plot [aria-roledescription=\"point\"]')"
                           ".length > 0", timeout=120_000)
    # the timer redraws the card a few times: never under a "processing" / "queue" overlay
    page.evaluate(WATCH_PROGRESS_JS)
    page.wait_for_function("() => window.tbCardDraws >= 4", timeout=60_000)
    assert page.evaluate("() => window.tbOverlays") == []
    # the plots' axis and legend titles and the loss plot's series are German
    for plot, titles in (("#train-loss_plot", ("Schritt", "Verlust", "Reihe")), ("#train-lr_plot", ("Schritt", "Lernrate"))):
        for title in titles:
            page.wait_for_function(f"() => [...document.querySelectorAll('{plot} text')]"
                                   f".some(t => t.textContent === '{title}')", timeout=30_000)
    labels = " ".join(page.locator('#train-loss_plot [aria-roledescription="point"]').evaluate_all(
        "els => els.map(e => e.getAttribute('aria-label') || '')"))
    assert "Verlust" in labels and "geglättet" in labels, labels[:300]
    shot("train-de-live")
    page.locator("#train-abort").click()
    expect(message).to_contain_text(re.compile(r"wird gestoppt|gestoppt"))
    expect(state).to_have_attribute("data-state", "aborted", timeout=90_000)
    expect(message).to_contain_text("gestoppt")
    assert "Stopping" not in message.inner_text() and "stopped" not in message.inner_text()
