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
