"""Every locale has exactly the English key set, and English covers every component id of the page."""
import pytest
import yaml

from backend.paths import LOCALES_DIR
from webui.i18n import LANGS


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
        assert shown == (table.get(key) or english)
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
    assert out["cutoff_len"]["info"].startswith("⛔")
