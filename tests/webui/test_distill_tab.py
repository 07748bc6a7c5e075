"""The Distill tab's handlers (plain functions, no browser): the form -> a distill spec, refusals naming the
key or the path, and a real `tuneboard distill` job against the local fake teacher, polled as the timer does:
progress, counts, latest pairs, the registered dataset, "Fine-tune on it" (the Train form's spec) and the
scorecard."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_teacher import KEY, SCHEMA, FakeTeacher, make_docs, no_key_under
from waiting import wait_for

from backend.distill import read_progress
from webui import tools
from webui.tabs import distill as tab

NUMBERS = [128, 40, 8, 0.3, 2, 30, 1, 0, 0.0]  # in tab.NUMBERS order


def form(docs, model, teacher_url, dataset_dir, **over) -> dict:
    values = dict(model=str(model), template="auto", documents=str(docs), text_column="body",
                  task="Extract the facts as JSON.", schema=json.dumps(SCHEMA), answer_format="json", examples="",
                  teacher="endpoint", teacher_local_model="", teacher_local_adapter="", teacher_url=teacher_url,
                  teacher_model="fake",
                  key_env="UI_TEACHER_KEY", key_file="", dataset_name="ui_facts", dataset_dir=str(dataset_dir))
    values.update(over)
    return tab.distill_flat(*values.values(), *NUMBERS)


def test_the_form_becomes_a_spec_and_mistakes_are_named(tmp_path, root, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tmp_path))
    flat = form(tmp_path, "m", "http://127.0.0.1:9/v1", tmp_path / "data")
    assert flat["teacher"] == "http://127.0.0.1:9/v1" and flat["teacher_api_key_env"] == "UI_TEACHER_KEY"
    assert flat["cutoff_len"] == 128 and flat["eval_ratio"] == 0.3 and isinstance(flat["temperature"], float)
    assert "teacher_api_key" not in flat
    local = form(tmp_path, "m", "", tmp_path, teacher="local", teacher_local_model="", teacher_local_adapter="a")
    assert local["teacher"] == "local" and "teacher_model" not in local and local["teacher_local_adapter"] == "a"
    assert "teacher_local_model" not in local  # empty = the student
    st, message, started = tab.start_generate(tab.new_state(), {**flat, "task": ""})
    assert not started and "`task`: must not be empty" in message
    st, message, started = tab.start_generate(tab.new_state(), {**flat, "teacher_model": None})
    assert not started and "`teacher_model`: required when teacher is a URL" in message
    st, message, started = tab.start_generate(tab.new_state(), {**flat, "documents": "/etc"})
    assert not started and "documents" in message and "/etc" in message
    assert tab.finetune_spec(tab.new_state())[0] is None
    assert "Generate a dataset first" in tab.start_score(tab.new_state(), None)[1]


@pytest.mark.slow
def test_generate_poll_finetune_and_score(tmp_path, root, tiny_qwen2, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tmp_path))
    monkeypatch.setenv("UI_TEACHER_KEY", KEY)
    teacher = FakeTeacher("valid", key=KEY).start()
    try:
        docs = make_docs(tmp_path / "docs")
        flat = form(docs, tiny_qwen2, teacher.url, tmp_path / "data")
        st, message, started = tab.start_generate(tab.new_state(), flat)
        assert started, message
        assert Path(st["out"]) == root / "distill" / "ui_facts"
        wait_for(lambda: not tools.alive(st["job"]), timeout=300, what="the distill job")
        st, bar, counts, pairs, card, log, message, timer = tab.poll(st)
        assert "✓ dataset ui_facts registered" in message, log
        assert 'data-state="completed"' in bar and 'data-step="6"' in bar
        assert "accepted **6**" in counts and "duplicate 1" in counts
        assert len(pairs) == 7 and set(pairs["result"]) == {"✓ accepted", "✗ duplicate: near-duplicate of a.txt#0"}
        assert json.loads((tmp_path / "data" / "dataset_info.json").read_text())["ui_facts"]["file_name"] == "ui_facts.json"
        # Fine-tune on it: LoRA SFT of the student on the new dataset
        spec, note = tab.finetune_spec(st)
        assert spec.dataset == "ui_facts" and spec.finetuning_type == "lora" and spec.stage == "sft"
        assert spec.model_name_or_path == str(tiny_qwen2) and spec.cutoff_len <= 128
        assert Path(spec.dataset_dir) == tmp_path / "data" and "press Start" in note
        # the scorecard (no adapter: the base student only)
        st, message, started = tab.start_score(st, None)
        assert started, message
        wait_for(lambda: not tools.alive(st["job"]), timeout=300, what="the score job")
        st, bar, counts, pairs, card, log, message, timer = tab.poll(st)
        held = read_progress(st["out"])["dataset"]["eval_rows"]
        assert held >= 1 and f"Scorecard of {held} held-out pairs" in message, log
        assert list(card.columns) == ["metric", "base", "tuned"]
        assert {"json_valid", "schema_valid", "field_f1", "exact_match", "tokens_per_s"} <= set(card["metric"])
        no_key_under(root, tmp_path / "data")
    finally:
        teacher.stop()


def test_a_reloaded_page_attaches_to_the_newest_distill_job(tmp_path, root):
    job = tools.new_job_dir("distill")
    job.mkdir(parents=True)
    (job / tools.TOOL_SPEC).write_text(f"documents: {tmp_path}\ntask: t\nsteps: score\ndataset_name: mine\n")
    st, message, timer = tab.on_load(tab.new_state())
    assert st["job"] == str(job) and st["kind"] == "score" and st["out"] == str(root / "distill" / "mine")
    assert "picked up again" in message
    assert tab.on_load(st) == (tab.gr.skip(), tab.gr.skip(), tab.gr.skip())
