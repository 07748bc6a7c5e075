"""UI strings: locales/<lang>.yaml, keys = component ids (elem_id), plus `<field-id>.<choice-id>` keys for
the labels of dropdown choices. English is the reference; a test checks every locale has its key set.

Field help (the small print under a form field): locales/fields/<lang>.yaml, key = the spec field name (or
the elem_id of a field outside the Train form), value = the translated help. English is the spec's own
description (backend.core.spec), so there is no English file and a field without a translation shows it."""
from __future__ import annotations

import functools

import yaml

from backend.core import allowed
from backend.core.paths import LOCALES_DIR

LANGS = ("en", "zh", "ja", "ko", "ru", "de", "fr", "es")
LANG_NAMES = {"en": "English", "zh": "简体中文", "ja": "日本語", "ko": "한국어", "ru": "Русский",
              "de": "Deutsch", "fr": "Français", "es": "Español"}


def strings(lang) -> dict[str, str]:
    """The string table of one language; {} for a value that names none of LANGS (the language a browser keeps in
    its localStorage reaches the handlers as the browser has it)."""
    return _strings(lang) if lang in LANGS else {}


@functools.lru_cache(maxsize=None)
def _strings(lang: str) -> dict[str, str]:
    """The string table of one of LANGS (read once per process; the files ship with the code)."""
    path = LOCALES_DIR / f"{lang}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {str(k): str(v) for k, v in data.items()}


FIELDS_DIR = LOCALES_DIR / "fields"


def field_strings(lang) -> dict[str, str]:
    """The field help table of one language ({} for English, a language without a file and a value that names
    none of LANGS)."""
    return _field_strings(lang) if lang in LANGS else {}


@functools.lru_cache(maxsize=None)
def _field_strings(lang: str) -> dict[str, str]:
    path = FIELDS_DIR / f"{lang}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {str(k): str(v) for k, v in data.items()}


def field_help(lang: str | None, key: str, english: str) -> str:
    """The help text of field `key` in `lang`; `english` (the spec's description) when it has none."""
    if not english:
        return ""
    text = field_strings(lang or "en").get(key) or english
    if key in allowed.CODE_KEYS and not allowed.code_allowed():
        text += " " + tr(lang or "en", "msg.code_off_note")  # the form says why only built-ins run
    return text


def humanize(key: str) -> str:
    """Fallback label for a key with no entry: `train-lora_rank` -> `Lora rank`."""
    tail = key.split("-", 1)[-1].split(".")[-1]
    return tail.replace("_", " ").strip().capitalize()


def t(lang: str, key: str) -> str:
    return strings(lang).get(key) or strings("en").get(key) or humanize(key)


def choice_pairs(lang: str, elem_id: str, ids: list[str]) -> list[tuple[str, str]]:
    """(label, id) pairs for a dropdown: a label from the locale if there is one, else the id itself
    (technical ids such as `adamw_torch` or `cosine` read the same in every language)."""
    table, en = strings(lang), strings("en")
    return [(table.get(f"{elem_id}.{i}") or en.get(f"{elem_id}.{i}") or i, i) for i in ids]


def tr(lang: str | None, key: str, **kw) -> str:
    """A handler's text (message, progress card, table header) in `lang`, its {fields} filled in; English
    when the locale has no entry (or a translation lost a field)."""
    en = strings("en").get(key, key)
    text = strings(lang or "en").get(key) or en
    try:
        return text.format(**kw)
    except (KeyError, IndexError, ValueError):
        return en.format(**kw)


def has(key: str) -> bool:
    return key in strings("en")


def headers(lang: str | None, frame):
    """A table's column names in `lang` (keys `col.<english name>`; a column without one keeps its name)."""
    if not lang or lang == "en":
        return frame
    return frame.rename(columns={c: tr(lang, f"col.{c}") for c in frame.columns if has(f"col.{c}")})


def refusal(lang: str | None, exc, with_field: bool = True) -> str:
    """A backend.core.allowed.PathRefused in `lang`: which path, why, and the allowed folders. `with_field`:
    prefixed with ✖ and the field (a message line); without it, the text for a field's own error."""
    text = tr(lang, exc.key(), **exc.kwargs())
    return f"✖ `{exc.field}`: {text}" if with_field else text
