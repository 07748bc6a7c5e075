"""The Distill tab in headless Chromium: documents uploaded, a teacher endpoint (the local fake teacher,
tests/fake_teacher.py) named with its key's environment variable, Generate -> live progress, counts and the
latest pairs -> the dataset registered and shown by the Data tab with its template -> Fine-tune on it fills
the Train form."""
import json
import os

from fake_teacher import KEY, SCHEMA, FakeTeacher, make_docs
from playwright.sync_api import expect
from ui_actions import open_tab, pick_option, set_number


def test_upload_generate_progress_and_dataset_preview(app_page, data_dir, tmp_path, tiny_qwen2, shot):
    page = app_page
    os.environ["E2E_TEACHER_KEY"] = KEY  # the job subprocess reads it; the page never sees it
    teacher = FakeTeacher("slow", key=KEY, delay=0.3).start()
    # as `tuneboard webui --teacher-key-env E2E_TEACHER_KEY=<its URL>` offers the key (and allows the URL)
    os.environ["TUNEBOARD_TEACHER_KEYS"] = f"E2E_TEACHER_KEY={teacher.url}"
    try:
        docs = make_docs(tmp_path / "docs")
        model = page.locator("#top-model_name_or_path input")
        model.fill(str(tiny_qwen2))
        model.press("Enter")
        open_tab(page, "Distill")
        page.locator("#distill-upload input[type=file]").set_input_files([str(p) for p in sorted(docs.iterdir())])
        page.locator("#distill-text_column textarea, #distill-text_column input").first.fill("body")
        page.locator("#distill-task textarea").fill("Extract the first word, the word count and the topic as JSON.")
        page.locator("#distill-schema .cm-content").fill(json.dumps(SCHEMA))
        pick_option(page, "distill-teacher", "OpenAI-compatible endpoint")
        page.locator("#distill-teacher_url textarea, #distill-teacher_url input").first.fill(teacher.url)
        page.locator("#distill-teacher_model textarea, #distill-teacher_model input").first.fill("fake")
        page.locator("#distill-key_env textarea, #distill-key_env input").first.fill("E2E_TEACHER_KEY")
        page.locator("#distill-dataset_name textarea, #distill-dataset_name input").first.fill("e2e_facts")
        page.locator("#distill-dataset_dir textarea, #distill-dataset_dir input").first.fill(str(data_dir))
        page.locator("#distill-group-settings").get_by_text("Settings").click()
        set_number(page, "distill-cutoff_len", 128)
        set_number(page, "distill-answer_tokens", 40)
        set_number(page, "distill-concurrency", 1)
        page.locator("#distill-start").click()
        state = page.locator("#distill-progress .tb-progress")
        expect(state).to_have_attribute("data-state", "running", timeout=60_000)
        expect(page.locator("#distill-counts")).to_contain_text("accepted", timeout=60_000)
        expect(state).to_have_attribute("data-state", "completed", timeout=180_000)
        expect(page.locator("#distill-counts")).to_contain_text("accepted 6")
        expect(page.locator("#distill-counts")).to_contain_text("duplicate 1")
        expect(page.locator("#distill-pairs")).to_contain_text("near-duplicate of a.txt#0")
        expect(page.locator("#distill-message")).to_contain_text("dataset e2e_facts registered")
        shot("distill-generated")
        assert json.loads((data_dir / "dataset_info.json").read_text())["e2e_facts"]["file_name"] == "e2e_facts.json"
        # the Data tab shows the new dataset, rendered with the template
        open_tab(page, "Data")
        expect(page.locator("#data-dataset input")).to_have_value("e2e_facts")
        page.locator("#data-show").click()
        expect(page.locator("#data-preview")).to_contain_text("Extract the first word", timeout=120_000)
        expect(page.locator("#data-preview .tb-trained").first).to_be_visible()
        # Fine-tune on it: the Train form gets the dataset
        open_tab(page, "Distill")
        page.locator("#distill-finetune").click()
        expect(page.locator("#train-dataset textarea, #train-dataset input").first).to_have_value("e2e_facts")
        page_text = page.content()
        assert KEY not in page_text
    finally:
        teacher.stop()
        os.environ.pop("E2E_TEACHER_KEY", None)
        os.environ.pop("TUNEBOARD_TEACHER_KEYS", None)
