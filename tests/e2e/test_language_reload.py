"""The page's language is the browser's (kept in its localStorage): after a reload the page comes back in the language
picked, as a switch by hand leaves it (labels, the dropdowns' choices, the idle cards, the tables' headers); a first
visit, with nothing stored, is in English."""
import yaml
from playwright.sync_api import expect

from backend.core.paths import LOCALES_DIR

DE = yaml.safe_load((LOCALES_DIR / "de.yaml").read_text(encoding="utf-8"))


def test_the_picked_language_stays_over_a_reload(app_page, shot):
    page = app_page
    badge = page.locator("#train-progress .tb-badge")
    expect(badge).to_have_text("idle")  # a first visit: nothing stored, English
    expect(page.locator("#train-start")).to_have_text("▶ Start")
    page.locator("#top-lang input").click()
    page.get_by_role("option", name="Deutsch").click()
    expect(badge).to_have_text(DE["state.idle"])

    page.reload()
    page.locator("#tb-header").wait_for()
    expect(page.locator("#top-lang input")).to_have_value("Deutsch")
    expect(badge).to_have_text(DE["state.idle"])
    expect(page.locator("#train-start")).to_have_text(DE["train-start"])
    expect(page.locator("#train-stage input")).to_have_value(DE["train-stage.sft"])  # a dropdown's choice labels
    page.get_by_role("tab", name=DE["tab-runs"]).click()
    page.get_by_role("tab", name=DE["tab-export"]).click()
    expect(page.locator("#export-progress .tb-badge")).to_have_text(DE["state.idle"])
    expect(page.locator("#export-checks")).to_contain_text(DE["col.result"])
    shot("language-reload-de")
