"""Issue 21 items 5-6 in the browser: the Data tab's Check lists a planted problem with its rows and Fix writes a
new registered version; a row edited in the Data tab re-renders its trained tokens as it is typed, and Save makes a
new version that Undo removes; Chat's "Save as a training row" lands in a new dataset that the Data tab previews."""
import json

from playwright.sync_api import expect

from ui_actions import open_chat_settings, open_tab, pick_option, set_dropdown, set_number


def _register(data_dir, name, rows):
    (data_dir / f"{name}.json").write_text(json.dumps(rows, indent=1))
    info_path = data_dir / "dataset_info.json"
    info = json.loads(info_path.read_text())
    info[name] = {"file_name": f"{name}.json"}
    info_path.write_text(json.dumps(info, indent=1))


def _open_data(page, data_dir, dataset):
    open_tab(page, "Data")
    d = page.locator("#data-dir textarea, #data-dir input").first
    d.fill(str(data_dir))
    d.press("Enter")
    pick_option(page, "data-dataset", dataset)


def test_check_fix_and_edit_a_row(app_page, data_dir, tiny_llama, shot):
    page = app_page
    rows = [{"instruction": f"Name a colour, number {k}, that people often see in the sky at {k} o'clock.",
             "output": f"Blue, at {k} o'clock."} for k in range(4)]
    _register(data_dir, "e2e_lint", rows + [dict(rows[1])])  # row 4 repeats row 1
    original = (data_dir / "e2e_lint.json").read_text()
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-template", "default")
    _open_data(page, data_dir, "e2e_lint")
    expect(page.locator("#data-preview")).to_contain_text("Blue, at 0 o'clock.", timeout=120_000)

    page.locator("#data-check").click()
    lint = page.locator("#data-lint_md")
    expect(lint).to_contain_text("1 findings (0 errors, 1 warnings, 0 notes)", timeout=120_000)
    expect(lint).to_contain_text("duplicates")
    expect(lint).to_contain_text("rows 4")
    shot("data-check")
    page.locator("#data-fix").click()
    expect(page.locator("#data-fix_md")).to_contain_text("safe fixes applied", timeout=120_000)
    expect(page.locator("#data-dataset input")).to_have_value("e2e_lint_v2", timeout=120_000)
    assert json.loads((data_dir / "e2e_lint_v2.json").read_text()) == rows
    assert (data_dir / "e2e_lint.json").read_text() == original
    assert json.loads((data_dir / "dataset_info.json").read_text())["e2e_lint_v2"] == {"file_name": "e2e_lint_v2.json"}

    # edit row 2 of the fixed version: the preview follows the typing, Save makes a version of it, Undo removes it
    set_number(page, "data-index", 2)
    page.locator("#data-show").click()
    expect(page.locator("#data-preview")).to_contain_text("Blue, at 2 o'clock.", timeout=120_000)
    page.locator("#data-group-edit").get_by_text("Edit this row").click()
    page.locator("#data-edit_load").click()
    expect(page.locator("#data-edit_message")).to_contain_text("row 2 of e2e_lint_v2.json", timeout=120_000)
    edited = dict(rows[2], output="Purple, edited in the browser.")
    page.locator("#data-edit_row .cm-content").click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(json.dumps(edited, indent=2))
    trained = page.locator("#data-preview .tb-trained")
    expect(trained.filter(has_text="Purple, edited in the browser.")).to_have_count(1, timeout=120_000)
    expect(page.locator("#data-summary")).to_contain_text("not saved", timeout=120_000)
    shot("data-edit-row")
    page.locator("#data-edit_save").click()
    expect(page.locator("#data-edit_message")).to_contain_text("saved e2e_lint_v2_v2", timeout=60_000)
    expect(page.locator("#data-dataset input")).to_have_value("e2e_lint_v2_v2", timeout=120_000)
    assert json.loads((data_dir / "e2e_lint_v2_v2.json").read_text())[2] == edited
    page.locator("#data-edit_undo").click()
    expect(page.locator("#data-edit_message")).to_contain_text("removed e2e_lint_v2_v2", timeout=120_000)
    expect(page.locator("#data-dataset input")).to_have_value("e2e_lint_v2", timeout=120_000)
    assert not (data_dir / "e2e_lint_v2_v2.json").exists()
    assert "e2e_lint_v2_v2" not in json.loads((data_dir / "dataset_info.json").read_text())


def test_chat_saves_a_training_row_that_the_data_tab_previews(app_page, data_dir, tiny_qwen2, monkeypatch, shot):
    from backend.core import paths

    monkeypatch.setattr(paths, "DATA_DIR", data_dir)  # Chat saves into the default folder: the tests' copy
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_qwen2)  # its own ChatML template ("auto")
    set_dropdown(page, "top-template", "auto")
    open_tab(page, "Chat")
    open_chat_settings(page)
    page.locator("#chat-load").click()
    try:
        expect(page.locator("#chat-status")).to_contain_text("loaded", timeout=120_000)
        set_number(page, "chat-max_new_tokens", 8)
        expect(page.locator("#chat-max_new_tokens input[type=number]").first).to_have_value("8")
        page.locator("#chat-message textarea").fill("What colour is the sky at noon?")
        page.locator("#chat-send").click()
        # the question is in the conversation once the answer has begun; the saved row's answer is the one typed
        expect(page.locator("#chat-chatbot [data-testid='bot']").last).not_to_have_text("", timeout=60_000)
        page.locator("#chat-save").get_by_text("Save as a training row").click()
        set_dropdown(page, "chat-save_dataset", "e2e_chat_rows")
        page.locator("#chat-save_answer textarea").fill("Blue, on a clear day.")
        page.locator("#chat-save_row").click()
        expect(page.locator("#chat-save_message")).to_contain_text("created e2e_chat_rows", timeout=30_000)
        shot("chat-save-row")
    finally:
        page.locator("#chat-unload").click()
        expect(page.locator("#chat-status")).to_contain_text("unloaded", timeout=30_000)
    saved = [json.loads(line) for line in (data_dir / "e2e_chat_rows.jsonl").read_text().splitlines()]
    assert [m["content"] for m in saved[0]["messages"]] == ["What colour is the sky at noon?", "Blue, on a clear day."]

    _open_data(page, data_dir, "e2e_chat_rows")
    preview = page.locator("#data-preview")
    expect(preview).to_contain_text("What colour is the sky at noon?", timeout=120_000)
    expect(preview.locator(".tb-trained").filter(has_text="Blue, on a clear day.")).to_have_count(1)
    expect(preview.locator(".tb-masked").filter(has_text="What colour is the sky at noon?")).to_have_count(1)
    shot("chat-row-in-data-tab")


def test_start_shows_the_data_check_once_then_starts(app_page, tiny_llama, monkeypatch, shot):
    """Issue 21 item 5: the Train tab's pre-flight summary of the lint (identity's answers cut by a tiny cutoff_len);
    Start shows it once and starts on the next press (click_start presses again, as a user would)."""
    from ui_actions import click_start
    from ui_handlers import stand_in_launches
    from waiting import wait_for
    from webui import data_check, jobs

    launched = stand_in_launches(monkeypatch)  # a harmless process instead of `tuneboard train`
    monkeypatch.setattr(data_check, "WAIT_S", 300.0)  # the summary is waited for: no race with a loaded machine
    page = app_page

    def fill_form(cutoff):
        set_dropdown(page, "top-model_name_or_path", tiny_llama)
        set_dropdown(page, "top-template", "default")
        dataset = page.locator("#train-dataset textarea, #train-dataset input").first
        dataset.fill("identity")
        dataset.press("Tab")
        set_number(page, "train-cutoff_len", cutoff)

    fill_form(16)
    page.locator("#train-start").click()
    note = page.locator("#train-data-check")
    expect(note).to_contain_text("Data check (tuneboard lint) of identity", timeout=120_000)
    expect(note).to_contain_text("cut_answers")
    expect(note).to_contain_text("Press Start again")
    shot("train-data-check")
    assert launched == []
    page.locator("#train-start").click()
    expect(page.locator("#train-message")).to_contain_text("Started", timeout=60_000)
    assert len(launched) == 1
    wait_for(lambda: not jobs.run_state(launched[0]).active, timeout=60, what="the stand-in run to end")
    # another spec, on a fresh page (click_start reads the first message after its press: none may be on screen):
    # told once again, and click_start presses twice
    page.reload()
    page.locator("#tb-header").wait_for()
    fill_form(17)
    click_start(page, "Started", shot, "train-data-check-start-failed")
    assert len(launched) == 2
    wait_for(lambda: not jobs.run_state(launched[1]).active, timeout=60, what="the stand-in run to end")
