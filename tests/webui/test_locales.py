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
