"""The Distill tab's handlers (plain functions, no browser): the form -> a distill spec, refusals naming the
key or the path, and a real `tuneboard distill` job against the local fake teacher, polled as the timer does:
progress, counts, latest pairs, the registered dataset, "Fine-tune on it" (the Train form's spec) and the
scorecard."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fake_teacher import KEY, SCHEMA, FakeTeacher, make_docs, no_key_under
from waiting import wait_for

from backend.core import teacher_access
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


@pytest.fixture(autouse=True)
def _no_teacher_policy(monkeypatch):
    """No offered key, no allowed teacher URL: `tuneboard webui` without --teacher-key-env / --allow-teacher-url."""
    for name in (teacher_access.POLICY_ENV, teacher_access.KEYS_ENV, teacher_access.URLS_ENV):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores it, whatever a test writes
        monkeypatch.delenv(name)


def test_the_page_names_no_server_variable_and_no_internal_address(tmp_path, root, monkeypatch):
    """Issue #25 part 2, from the page: the server's HOME as the key's variable and a listener of ours (on
    loopback) as the teacher: refused before launch, one line per field, in the page's language; nothing
    reaches the listener. The operator's --teacher-key-env / --allow-teacher-url open exactly that door."""
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tmp_path))
    listener = FakeTeacher("valid").start()
    try:
        flat = form(make_docs(tmp_path / "docs"), "m", listener.url, tmp_path / "data", key_env="HOME")
        st, message, started = tab.start_generate(tab.new_state(), flat)
        assert not started and st == tab.new_state()
        assert "✖ `teacher`: `127.0.0.1` is `127.0.0.1`, an internal address" in message
        assert "✖ `teacher_api_key_env`: `$HOME` is not a key this server offers to the page (offered: none)" in message
        de = tab.start_generate(tab.new_state(), flat, lang="de")[1]
        assert "eine interne Adresse" in de and "`$HOME` ist kein Schlüssel" in de
        teacher_access.configure([f"UI_TEACHER_KEY={listener.url}"], [])
        message = tab.start_generate(tab.new_state(), flat)[1]
        assert "`teacher`" not in message and f"offered: UI_TEACHER_KEY ({listener.url})" in message
        from backend.distill.spec import validate_distill  # the checks on a validated spec, without a job

        assert tab.check_teacher(validate_distill({**flat, "teacher_api_key_env": "UI_TEACHER_KEY"})) == []
        assert tab.check_teacher(validate_distill({**flat, "teacher_api_key_env": ""})) == []
        local = form(tmp_path / "docs", "m", "", tmp_path / "data", teacher="local")
        assert tab.check_teacher(validate_distill(local)) == []  # the run's own `tuneboard api` on loopback
        assert listener.requests == []
    finally:
        listener.stop()


def test_the_flags_reach_the_ui_s_subprocesses(monkeypatch):
    """`tuneboard webui --teacher-key-env NAME=URL --allow-teacher-url URL`: parsed, written to the env vars
    the UI's subprocesses inherit; a bad one stops the start with exit code 2."""
    from webui import app

    opts = app.parse_args(["--teacher-key-env", "TEAM_KEY=https://api.example.com/v1",
                           "--teacher-key-env", "OTHER=http://10.0.0.5:8000/v1", "--allow-teacher-url", "http://gpu:9/v1"])
    assert opts.teacher_key_env == ["TEAM_KEY=https://api.example.com/v1", "OTHER=http://10.0.0.5:8000/v1"]
    assert opts.allow_teacher_url == ["http://gpu:9/v1"]
    teacher_access.configure(opts.teacher_key_env, opts.allow_teacher_url)
    assert os.environ[teacher_access.KEYS_ENV] == "TEAM_KEY=https://api.example.com/v1 OTHER=http://10.0.0.5:8000/v1"
    assert os.environ[teacher_access.URLS_ENV] == "http://gpu:9/v1"
    assert os.environ[teacher_access.POLICY_ENV] == "webui"
    assert app.main(["--teacher-key-env", "NO_URL"]) == 2


@pytest.mark.slow
def test_generate_poll_finetune_and_score(tmp_path, root, tiny_qwen2, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tmp_path))
    monkeypatch.setenv("UI_TEACHER_KEY", KEY)
    teacher = FakeTeacher("valid", key=KEY).start()
    # as `tuneboard webui --teacher-key-env UI_TEACHER_KEY=<its URL>` offers it (loopback: allowed with it)
    teacher_access.configure([f"UI_TEACHER_KEY={teacher.url}"], [])
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
        # the Data tab switches to it for the page that watched the job, not for a reload after its end
        assert tab.data_tab_target(st) == (str(tmp_path / "data"), "ui_facts")
        reloaded = tab.poll(tab.attach(st["job"]))[0]
        assert reloaded["out"] == st["out"] and tab.data_tab_target(reloaded) is None
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
    st, message, timer = tab.on_load(None, tab.new_state())
    assert st["job"] == str(job) and st["kind"] == "score" and st["out"] == str(root / "distill" / "mine")
    assert "picked up again" in message
    assert tab.on_load(None, st) == (tab.gr.skip(), tab.gr.skip(), tab.gr.skip())


# ------------------------------------------------------------------ the page's language, "Fine-tune on it"

def fake_run(folder: Path, dataset_dir: Path, train_args: dict | None = None) -> dict:
    """A distill run folder as step generate leaves it (distill_spec.yaml + progress.json with the registered
    dataset), without running it: the tab's state for it."""
    import yaml

    folder.mkdir(parents=True)
    spec = {"documents": str(folder), "task": "Extract the facts as JSON.", "dataset_name": "facts",
            "model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "dataset_dir": str(dataset_dir),
            "train_args": train_args or {}}
    (folder / "distill_spec.yaml").write_text(yaml.safe_dump(spec))
    progress = {"state": "completed", "documents": 3, "chunks": 11, "train_chunks": 8, "eval_chunks": 3,
                "accepted": 7, "rejected": {"duplicate": 2, "not JSON": 1}, "requests": 13, "prompt_tokens": 1200,
                "completion_tokens": 345, "elapsed_s": 42.4, "eta_s": 17, "answered": 9, "to_ask": 11,
                "latest": [{"chunk": "a.txt#0", "split": "train", "reason": None, "prompt": "p", "answer": "a"},
                           {"chunk": "b.txt#1", "split": "eval", "reason": "duplicate", "detail": "of a.txt#0",
                            "prompt": "q", "answer": "b"}],
                "dataset": {"name": "facts", "eval_name": "facts_eval", "train_rows": 5, "eval_rows": 2,
                            "dataset_dir": str(dataset_dir), "cutoff_len": 192}}
    (folder / "progress.json").write_text(json.dumps(progress))
    return {**tab.new_state(), "out": str(folder), "kind": "generate"}


def test_messages_follow_the_page_language(tmp_path, root):
    """The same handler in two languages: two different texts carrying the same numbers and names."""
    st = fake_run(tmp_path / "run", tmp_path / "data")
    p = read_progress(st["out"])
    en, zh = tab.counts_text(p), tab.counts_text(p, "zh")
    assert en.startswith("**3** documents → **11** chunks (8 train, 3 eval)") and "duplicate 2" in en
    assert "文档" in zh and "documents" not in zh and "重复 2" in zh and "不是 JSON 1" in zh
    for number in ("**3**", "**11**", "**7**", "**3**", "13", "1545", "42 s", "17"):
        assert number in en and number in zh, number
    de = tab.pairs_frame(p, "de")
    assert list(de.columns) == ["Abschnitt", "Aufteilung", "Ergebnis", "Prompt", "Antwort"]
    assert list(de["Ergebnis"]) == ["✓ angenommen", "✗ Duplikat: of a.txt#0"]
    assert list(tab.pairs_frame(p).columns) == tab.PAIR_COLUMNS
    status = {"state": "completed"}
    done_en, done_es = (tab.ended_message(st, status, p, "completed", None, lang) for lang in ("en", "es"))
    assert done_en.startswith("✓ dataset facts registered: 5 train rows, 2 eval rows (facts_eval)")
    assert done_es.startswith("✓ conjunto de datos facts registrado: 5 filas de entrenamiento, 2 filas de evaluación")
    assert f"`{tmp_path / 'data'}`" in done_en and f"`{tmp_path / 'data'}`" in done_es
    stop_en, stop_fr = (tab.ended_message(st, {}, p, "aborted", None, lang) for lang in ("en", "fr"))
    assert "9 of 11 chunks" in stop_en and "9 segments sur 11" in stop_fr
    report = {"rows": 2}
    card_ja = tab.ended_message({**st, "kind": "score"}, status, p, "completed", report, "ja")
    assert card_ja.startswith("2 件のホールドアウトペアのスコアカード") and "distill_report.json" in card_ja
    assert tab.abort(tab.new_state(), "fr")[1] == "Rien n'est en cours."
    assert tab.abort(tab.new_state())[1] == "Nothing is running."
    assert tab.start_generate(tab.new_state(), {"documents": ""}, lang="ko")[1].startswith("✖ `documents`: 폴더를")
    assert tab.start_score(tab.new_state(), None, "ru")[1].startswith("✖ Сначала сгенерируйте")
    job = tools.new_job_dir("distill")
    job.mkdir(parents=True)
    (job / tools.TOOL_SPEC).write_text(f"documents: {tmp_path}\ntask: t\ndataset_name: mine\n")
    loaded = {lang: tab.on_load(None, tab.new_state(), lang)[1] for lang in ("en", "de")}
    assert loaded["en"] != loaded["de"] and all(f"`{job.name}`" in m for m in loaded.values())
    assert "Neuladen" in loaded["de"]


@pytest.fixture(scope="module")
def finetune_handler():
    """The wired "Fine-tune on it" handler of a real page, and the names of its outputs (message, tabs, the
    Train form: top bar fields, booster, extra args, form fields)."""
    from webui.app import create_app

    demo = create_app()
    dep = next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_finetune")
    assert [c.elem_id for c in dep.inputs[1:]] == ["top-finetuning_type", "top-quantization_bit", "top-lang"]
    return dep.fn, [getattr(c, "elem_id", None) for c in dep.outputs]


def test_finetune_on_it_keeps_the_top_bar_method_and_quantization(tmp_path, finetune_handler):
    handler, names = finetune_handler
    st = fake_run(tmp_path / "run", tmp_path / "data")

    def form(method, quant, lang="en"):
        out = handler(st, method, quant, lang)
        return out[0], dict(zip(names[2:], out[2:]))

    message, values = form("lora", "4")
    assert values["top-finetuning_type"] == "lora" and values["top-quantization_bit"] == "4"
    assert values["top-model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the student
    assert values["train-dataset"] in ("facts", ["facts"]) and values["train-cutoff_len"] == 192
    assert "QLoRA (4-bit) SFT of `HuggingFaceTB/SmolLM2-135M-Instruct` on `facts`" in message
    message, values = form("full", "none")
    assert values["top-finetuning_type"] == "full" and values["top-quantization_bit"] == "none"
    assert "full-parameter SFT" in message and "quantization" not in message
    # 4-bit makes no sense with freeze: left out, and the message says why
    message, values = form("freeze", "4")
    assert values["top-finetuning_type"] == "freeze" and values["top-quantization_bit"] == "none"
    assert "freeze (last layers) SFT" in message and "4-bit quantization is left out" in message
    zh_message, _ = form("freeze", "4", "zh")
    assert "冻结" in zh_message and "4 位量化" in zh_message and "`facts`" in zh_message
    # nothing picked: LoRA
    message, values = form(None, None)
    assert values["top-finetuning_type"] == "lora" and values["top-quantization_bit"] == "none"
    assert "LoRA SFT" in message
    # the distill spec's own train_args win over the top bar
    spec, message = tab.finetune_spec(fake_run(tmp_path / "run2", tmp_path / "data", {"finetuning_type": "full"}),
                                      "lora", "8")
    assert spec.finetuning_type == "full" and spec.quantization_bit is None and "8-bit" in message
