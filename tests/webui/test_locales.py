"""Every locale has exactly the English key set, and English covers every component id of the page."""
import pytest
import yaml

from backend.core.paths import LOCALES_DIR
from backend.core import allowed
from webui.i18n import LANGS, tr


def _load(lang):
    return yaml.safe_load((LOCALES_DIR / f"{lang}.yaml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("lang", LANGS)
def test_same_keys_as_english(lang):
    en, other = _load("en"), _load(lang)
    assert set(other) == set(en), (f"{lang}: missing {sorted(set(en) - set(other))[:10]}, "
                                  f"extra {sorted(set(other) - set(en))[:10]}")
    assert all(isinstance(v, str) and v.strip() for v in other.values())


def test_english_labels_every_registered_component():
    from webui.app import create_app

    keys = set(create_app().tb_registry.items)
    en = set(_load("en"))
    assert keys - en == set(), f"components without an English label: {sorted(keys - en)}"
    stale = {k for k in en - keys if "." not in k}
    assert stale == set(), f"locale keys for components that no longer exist: {sorted(stale)}"


def test_translations_are_not_just_english():
    en = _load("en")
    for lang in LANGS[1:]:
        assert _load(lang)["tab-train"] != en["tab-train"]


# ------------------------------------------------------------------ field help (locales/fields/<lang>.yaml)

def _fields(lang):
    from webui.i18n import FIELDS_DIR

    return yaml.safe_load((FIELDS_DIR / f"{lang}.yaml").read_text(encoding="utf-8"))


def _help_keys() -> dict[str, str]:
    """Every help text the page shows -> its English: the Train form's fields and other tabs' helps."""
    from webui import fields as F
    from webui.app import create_app

    keys = {r.name: r.description for r in F.form_rows() if r.description}
    keys.update({key: en for key, en in create_app().tb_registry.helps.values()})
    return keys


@pytest.fixture(scope="module")
def help_keys():
    return _help_keys()


def test_field_help_files_share_one_key_set(help_keys):
    """Each translated language has a help file with the same keys, none stale, each a real translation
    that keeps the English text's identifiers (val_size, lr_B, embed_tokens, {{name}}, ...)."""
    import re

    from webui.i18n import FIELDS_DIR

    langs = LANGS[1:]
    assert sorted(p.stem for p in FIELDS_DIR.glob("*.yaml")) == sorted(langs)  # English is the spec itself
    reference = set(_fields("zh"))
    assert len(reference) >= 100
    for lang in langs:
        table = _fields(lang)
        assert set(table) == reference, (f"{lang}: missing {sorted(reference - set(table))}, "
                                         f"extra {sorted(set(table) - reference)}")
        stale = set(table) - set(help_keys)
        assert not stale, f"{lang}: help for fields the page no longer shows: {sorted(stale)}"
        for key, text in table.items():
            english = help_keys[key]
            assert isinstance(text, str) and text.strip() and text != english, (lang, key)
            for ident in re.findall(r"[\w./<>:{}-]*_[\w./<>:{}-]*", english):
                assert ident.strip(".,") in text, f"{lang} {key}: {ident.strip('.,')!r} lost in {text!r}"


@pytest.mark.parametrize("lang", LANGS[1:])
def test_every_shown_field_has_help_or_falls_back(lang, help_keys, capsys):
    """A field with a translation shows it; one without (a field added after the translations) shows its
    English description, never an empty box. Lists the fields that fall back."""
    from webui.i18n import field_help

    table = _fields(lang)
    fallback = []
    for key, english in help_keys.items():
        shown = field_help(lang, key, english)
        expected = table.get(key) or english
        if key in allowed.CODE_KEYS and not allowed.code_allowed():  # SECURITY.md: the form says why
            expected += " " + tr(lang, "msg.code_off_note")
        assert shown == expected
        if key not in table:
            fallback.append(key)
    with capsys.disabled():
        if fallback:
            print(f"\n{lang}: {len(fallback)} field help text(s) in English (no translation yet): {fallback}")
    assert field_help(lang, "no_such_field_xyz", "English text") == "English text"
    assert field_help(lang, "learning_rate", "") == ""


def test_language_switch_translates_help_texts():
    """The page is built in English; the language picker's updates carry each field's help in the new
    language (the Train form's and the Evaluate tab's), and back to English."""
    from webui.app import create_app
    from webui.i18n import field_help

    reg = create_app().tb_registry
    ids = list(reg.items)
    zh = dict(zip(ids, reg.relabel("zh")))
    assert zh["train-learning_rate"]["info"] == _fields("zh")["learning_rate"] == "峰值学习率。"
    assert zh["train-lora_target"]["info"] == _fields("zh")["lora_target"]
    assert zh["eval-val_size"]["info"] == _fields("zh")["eval-val_size"]
    assert zh["train-stage"]["choices"] and "info" in zh["train-stage"]
    assert "info" not in zh["train-start"]  # a button has no help
    en = dict(zip(ids, reg.relabel("en")))
    assert en["train-learning_rate"]["info"] == field_help("en", "learning_rate", "Peak learning rate.")
    assert en["train-learning_rate"]["info"] == "Peak learning rate."


def test_field_errors_keep_the_help_language():
    """After Preview/Start, a field without an error gets its help back in the page's language."""
    from webui.tabs.train import error_updates

    out = dict(zip(["learning_rate", "cutoff_len"],
                   error_updates([("cutoff_len", "must be > 0")], ["learning_rate", "cutoff_len"], "ja")))
    assert out["learning_rate"]["info"] == _fields("ja")["learning_rate"]
    # the message itself, marked by the red class (whose icon is CSS): no emoji the browser's fonts may lack
    assert out["cutoff_len"]["info"] == "must be > 0"
    assert out["cutoff_len"]["elem_classes"] == ["tb-field-error"] and out["learning_rate"]["elem_classes"] == []


# ------------------------------------------------------------------ handler messages (webui.i18n.tr)

@pytest.mark.parametrize("lang", LANGS[1:])
def test_messages_keep_their_fields(lang):
    """Each translated message keeps exactly the {fields} of its English text (tr() would fall back to
    English if one were lost, and a field a translation adds would never be filled)."""
    import re

    en, other = _load("en"), _load(lang)
    for key, text in en.items():
        fields = set(re.findall(r"(?<!{){(\w*)}(?!})", text))
        if fields or "." in key:
            assert set(re.findall(r"(?<!{){(\w*)}(?!})", other[key])) == fields, (lang, key, other[key])


def test_tab_messages_follow_the_language(tmp_path):
    """The status lines of the Export, Evaluate, Chat, Data and Runs tabs are in the page's language (one
    handler of each, called as its event calls it), and English stays the English text."""
    from webui.tabs import chat, data, evaluate, export, runs

    zh = _load("zh")
    assert export.abort({"job": None}, "zh")[1] == zh["msg.export_none"] == "没有正在运行的导出。"
    assert export.abort({"job": None})[1] == "No export is running."
    assert export.ended_message({"export_dir": "/x"}, "de") == "Export nach `/x` beendet: Ergebnis und Prüfungen stehen unten."
    assert evaluate.abort({}, "ja")[1] == _load("ja")["eval.none"]
    held = {"dataset": "identity", "val_size": 0.1, "max_samples": 20}
    assert evaluate.rows_scored(held, "zh").startswith("`identity` 中留出的 10%")
    assert "从其" not in evaluate.rows_scored(held, "zh") and "取自其前 20 行" in evaluate.rows_scored(held, "zh")
    assert evaluate.rows_scored(held) == ("the held-out 10% of `identity` (the split a training run with this "
                                          "val_size and seed never sees, from its first 20 rows)")
    # plan()'s refusals are translated through their English text: each must still be one plan() returns
    flat = {"model_name_or_path": "m", "eval_dataset": "", "dataset": ""}
    assert evaluate.plan(flat, False)[1] in evaluate.PLAN_REFUSALS
    flat.update(eval_dataset="identity", adapter_name_or_path=None)
    assert evaluate.plan(flat, True)[1] in evaluate.PLAN_REFUSALS
    st, message, started = evaluate.start_eval({}, dict(flat, eval_dataset=""), False, "ko")
    assert not started and message == _load("ko")["eval.no_dataset"]
    a, b = chat.pane_labels("/m/tiny", "/saves/run-b", True, None, "zh")
    assert (a, b) == ("微调后：tiny + run-b", "基座：tiny（无适配器）")
    st = {"hist_a": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
          "hist_b": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}], "b": "base"}
    assert chat.waiting(st["hist_b"], "fr")[-1]["content"] == _load("fr")["chat.waiting"]
    assert chat.stopped(st, "zh")[2] == "■ 已停止 (微调模型：未回答, 基座模型：未回答)"
    assert chat.unload(chat.empty_state(), "ru")[1] == "выгружено"
    assert data.show_row(str(tmp_path), None, 0, "m", "auto", 128, "es")[0] == "Elija un conjunto de datos."
    assert runs.delete_run(str(tmp_path / "r"), confirmed=False, root=tmp_path, lang="zh") == \
        (False, "请勾选“我确定”后再删除。")
    assert runs.diff_md(None, None, "de") == "Wählen Sie zwei Läufe zum Vergleichen."
    assert runs.clone_spec(None, "ja")[1] == "実行を選んでください。"


def test_preflight_and_adapter_picker_follow_the_language(tmp_path):
    """The Train tab's memory pre-flight and the adapter picker's 'none' choice are in the page's language."""
    from webui import choices, preflight
    from webui.tabs import train

    base = {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "finetuning_type": "lora",
            "cutoff_len": 128, "per_device_train_batch_size": 1}
    zh = preflight.summary_md(dict(base, nproc_per_node=2, deepspeed="examples/deepspeed/ds_z3_config.json"), "zh")
    assert zh.startswith('<span class="tb-mem-') and "内存估算：<b>" in zh and "ZeRO-3 切分权重" in zh
    assert "Memory" not in zh
    assert preflight.summary_md(dict(base, model_name_or_path="/x/no-size"), "de").startswith("Speicherschätzung")
    assert choices.adapter_pairs(tmp_path, lang="ja")[0] == ("— なし：ベースモデル —", "")
    assert choices.adapter_pairs(tmp_path)[0] == (choices.NO_ADAPTER, "")
    assert train.adapter_picker_update("ko")["choices"][0][0] == "— 없음: 기본 모델 —"
    assert train.errors_md([("cutoff_len", "x")], "fr").startswith("**À corriger avant de démarrer :**")


def test_eval_row_detail_follows_the_language():
    """A clicked Evaluate row in full: its headings in the page's language, the texts themselves as they are."""
    from webui.tabs import evaluate

    prompt = "<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n"
    st = evaluate.new_state()
    st["parts"] = [{"name": "tuned", "dir": "t"}]
    st["rows"] = {"tuned": [{"index": 0, "prompt": prompt, "label": "TuneBoard", "predict": "I am TuneBoard",
                             "rouge-l": 50.0, "exact_match": True, "source": "identity", "row": 3}]}
    zh = evaluate.row_detail(st, 0, "zh")
    for text in ("第 0 行 · identity 第 3 行", "<b>问题</b>", "完整提示词（按模板渲染）", "<b>参考答案</b>", "完全匹配 ✓",
                 "Who are you?", "I am TuneBoard"):
        assert text in zh, text
    assert "Question" not in zh and "exact match ✓" in evaluate.row_detail(st, 0)


def test_data_row_preview_follows_the_language():
    """A previewed row's summary, part labels and the colour legend in the page's language."""
    from webui import datasets as D
    from webui.app import create_app

    seg = [{"text": "q", "trained": False}, {"text": "a", "trained": True}]
    row = {"kind": "ranking", "source": "pairs", "row": 3, "num_trained": 9, "truncated": True,
           "prompt": {"segments": seg, "num_tokens": 8}, "chosen": {"segments": seg, "num_tokens": 3},
           "rejected": {"segments": seg, "num_tokens": 6}}
    assert D.row_summary(row, "zh") == ("**pairs 第 3 行** · 提示词 8 + chosen 3 / rejected 6 个 token，其中 9 个"
                                        "参与训练 · ⚠ 被 cutoff_len 截断")
    assert "prompt 8 + chosen 3 / rejected 6 tokens, 9 trained" in D.row_summary(row)
    html = D.render_row(row, "de")
    assert "Prompt (für beide Antworten gleich) · 8 Tokens" in html and "✓ chosen (bevorzugte Antwort)" in html
    reg = create_app().tb_registry
    legend = dict(zip(reg.items, reg.relabel("ja")))["data-legend"]["value"]
    assert '<span class="tb-trained">学習対象（モデルはこのトークンを学習）</span>' in legend
    assert '<span class="tb-masked">マスク（文脈のみ）</span>' in legend


def test_placeholders_and_idle_tables_follow_the_language():
    """A text box with a `<elem_id>.placeholder` locale key shows it in the page's language (its {fields}
    filled), from the first render and on every switch."""
    from webui.app import create_app

    reg = create_app().tb_registry
    built = {k: reg.items[k][0] for k in ("export-dir", "chat-compare_with", "train-resume_from_checkpoint")}
    assert built["chat-compare_with"].placeholder.startswith("empty = the base model")
    assert built["export-dir"].placeholder.endswith("exports/<model>-<time>")
    zh = dict(zip(reg.items, reg.relabel("zh")))
    assert zh["chat-compare_with"]["placeholder"] == "留空 = 基座模型；或另一个适配器 / checkpoint-N 文件夹"
    assert zh["export-dir"]["placeholder"].startswith("留空 = ") and "{path}" not in zh["export-dir"]["placeholder"]
    assert zh["train-resume_from_checkpoint"]["placeholder"] == "true，或检查点文件夹"


def test_runs_table_states_follow_the_language():
    from webui.tabs import runs

    rows = [{c: "" for c in runs.COLUMNS} | {"name": "a", "model": "m", "status": "completed"},
            {c: "" for c in runs.COLUMNS} | {"name": "b", "model": "m", "status": "queued (resume)"}]
    zh = runs.table(rows, "all", "", "zh")
    assert zh[_load("zh")["col.status"]].tolist() == ["已完成", "排队中 (resume)"]
    assert runs.table(rows, "all", "")["status"].tolist() == ["completed", "queued (resume)"]


# ------------------------------------------------------------------ backends' findings, by id in the page's language

def _ids(pattern: str, *files) -> set[str]:
    """The ids a backend module writes (its source: a check added there without locale keys fails here)."""
    import re

    from backend.core.paths import REPO_ROOT

    return {m for f in files for m in re.findall(pattern, (REPO_ROOT / f).read_text(encoding="utf-8"))}


def test_lint_findings_follow_the_language():
    """The Data tab's Check and the Train tab's pre-flight name each lint finding's check and say what it found in the
    page's language, by the finding's check id and row count (the lint's JSON); English keeps the lint's own words."""
    from webui import data_check
    from webui.tabs import data

    checks = _ids(r'Finding\(\s*"(\w+)"', "backend/dataprep/lint.py")
    assert {"duplicates", "cut_answers", "template", "pt_eos"} <= checks, checks
    en = _load("en")
    assert {c for c in checks if f"lint.{c}" not in en} == set()
    assert {c for c in checks - {"template"} if f"lint.msg.{c}" not in en} == set()  # template: the picker's words
    cut = {"check": "cut_answers", "severity": "warning", "dataset": "mine", "rows": [1, 3], "count": 2, "fix": None,
           "message": "2 of 4 rows (50%) lose trained tokens to cutoff_len=64: 9 of 40 (22.5%); the longest row has 90"}
    dup = {"check": "duplicates", "severity": "warning", "dataset": "mine", "rows": [5], "count": 1,
           "fix": "drop_duplicates", "message": "1 rows repeat an earlier row exactly (each is trained twice as often)"}
    md = data.findings_md([cut, dup], "de")
    assert "**gekürzte Antworten** (mine): 2 Zeilen verlieren trainierte Tokens durch cutoff_len · Zeilen 1, 3" in md
    assert "**Duplikate** (mine): 1 Zeilen wiederholen eine frühere Zeile exakt" in md, md
    assert "`--fix drop_duplicates`" in md
    assert "rows" not in md and "cut_answers" not in md, md
    assert data.finding_rows([cut, dup], "mine", "ja") == [("切り詰められた回答 · mine · 1", "1"),
                                                           ("切り詰められた回答 · mine · 3", "3"), ("重複 · mine · 5", "5")]
    assert f"**cut_answers** (mine): {cut['message']} · rows 1, 3" in data.findings_md([cut, dup])
    assert data.finding_rows([cut], "mine") == [("cut_answers · mine · 1", "1"), ("cut_answers · mine · 3", "3")]
    note = data_check.summary_md({"datasets": {"mine": 4}, "findings": [cut, dup]}, "zh")
    assert "<b>回答被截断</b>: 2 行因 cutoff_len 丢失了参与训练的 token" in note and "cutoff_len=64" not in note, note
    note = data_check.summary_md({"datasets": {"mine": 4}, "findings": [cut]})
    assert f"<b>cut_answers</b>: {cut['message']}" in note, note
    # an error of the pre-training check without rows, and a check the locale does not know, still say something
    eos = {"check": "pt_eos", "severity": "error", "dataset": "docs", "rows": [], "message": "the tokenizer has no EOS"}
    assert data_check.finding_words(eos, "fr") == ("EOS en pré-entraînement", _load("fr")["lint.msg.pt_eos_missing"])
    assert data_check.finding_words(dict(eos, check="new_check"), "fr") == ("new_check", "the tokenizer has no EOS")


def test_export_steps_checks_and_outcome_follow_the_language():
    """The Export tab's progress names each `[export k/6]` step, its checks table each check and its result, in the
    page's language (by step number and check id: the detail stays the export's own text); English keeps the lines."""
    from webui import tools

    names = _ids(r'"name": "(\w+)"', "backend/exporting/export.py", "backend/exporting/llamacpp_check.py")
    assert {"logits", "greedy", "llamacpp_load"} <= names, names
    en = _load("en")
    assert {n for n in names if f"export.check.{n}" not in en} == set()
    assert {k for k in range(1, 7) if f"export.step.{k}" not in en} == set()
    report = {"checks": [{"name": "logits", "ok": True, "detail": "max |export - (base+adapter)| 0",
                          "max_abs_diff": 0.0},
                         {"name": "greedy", "ok": False, "detail": "greedy continuation: 3/36 tokens agree"}]}
    assert tools.checks_rows(report, None, "de") == [
        ["Logits", "✓ ok", "max |export - (base+adapter)| 0", "max_abs_diff=0"],
        ["gierige Fortsetzung", "✗ FEHLER", "greedy continuation: 3/36 tokens agree", ""]]
    assert [r[:2] for r in tools.checks_rows(report)] == [["logits", "✓ ok"], ["greedy", "✗ FAIL"]]
    assert [r[:2] for r in tools.checks_rows({}, ["  FAIL shards: none written"], "ja")] == [["シャードファイル", "✗ 失敗"]]
    step = "loading /m in float32 from /m"
    assert tools.export_step_words(2, step, "de") == "Modell laden" and tools.export_step_words(2, step) == step
    passed = tools.export_outcome_words("passed", "export PASSED: /x (a.gguf)", "es")
    assert passed == "exportación SUPERADA: /x (a.gguf)"
    assert tools.export_outcome_words("failed", "export FAILED: boom") == "export FAILED: boom"


def test_table_headers_and_distill_splits_follow_the_language():
    """Every column the tabs' tables are built with has a header in each language (`col.<name>`; "#" and metric
    names such as rouge-l stay as they are), and a distilled pair's split is a word of the page's language."""
    import pandas as pd

    from webui import judge_view, promotion, tools
    from webui.i18n import has, headers
    from webui.tabs import distill, evaluate, export, runs

    tables = [distill.PAIR_COLUMNS, distill.SCORE_COLUMNS, evaluate.DISTILL_COLUMNS, evaluate.PAIR_COLUMNS,
              export.CHECK_COLUMNS, judge_view.ROW_COLUMNS, promotion.CHECKPOINT_COLUMNS, runs.COLUMNS,
              ["#", "question", "reference", "prediction", tools.ROW_SCORE, "bleu-4", "exact"]]
    kept = {"#", tools.ROW_SCORE, "bleu-4"}
    untranslated = sorted({c for columns in tables for c in columns if c not in kept and not has(f"col.{c}")})
    assert untranslated == [], f"table headers with no translation: {untranslated}"
    shown = headers("de", pd.DataFrame([], columns=distill.SCORE_COLUMNS)).columns.tolist()
    assert shown == ["Metrik", "Basis", "feinabgestimmt"]
    p = {"latest": [{"chunk": "a.txt#0", "split": "eval", "reason": "too long", "detail": "cut at max_tokens 256",
                     "prompt": "q", "answer": "a"}]}
    frame = distill.pairs_frame(p, "de")
    assert frame.iloc[0].tolist()[:3] == ["a.txt#0", "Evaluierung", "✗ zu lang: cut at max_tokens 256"]
    assert distill.pairs_frame(p).iloc[0]["split"] == "eval"


def test_reattach_messages_and_a_stored_language():
    """After a reload the re-attached eval says so in the browser's language; the language a browser kept is put
    back on the page when it names one of LANGS (a first visit keeps English), and a value that names none (the
    browser's storage is the browser's) reads as English, never as an error."""
    import gradio as gr

    from webui.app import restore_lang
    from webui.tabs import evaluate

    st = {"spec": {"eval_dataset": "identity", "max_samples": 5}, "parts": [{"name": "tuned"}, {"name": "base"}]}
    again = evaluate.attached_message(st, "de")
    assert again.startswith("Evaluierung von tuned und base auf die ersten 5 Zeilen von `identity`") \
        and again.endswith("(nach dem Neuladen wieder aufgenommen)."), again
    assert evaluate.attached_message(st).startswith("Eval of tuned and base on the first 5 rows of `identity`")
    assert restore_lang("ja") == "ja"
    for stored in ("en", "", None, "xx", "../en", ["de"], {"lang": "de"}):
        assert restore_lang(stored) == gr.skip(), stored
        assert tr(stored, "eval.none") == "No eval is running."
