"""The Data tab warns about dataset_info.json entries that cannot be used (issue 9, item 9: a name registered
twice silently took the last entry; one bad entry blocked every other dataset): the bad entries are named with
why, in the page's language, and left out of the dataset lists; the good ones stay listed and previewable."""
from __future__ import annotations

import json

from webui import choices
from webui.tabs import data as data_tab

# a name registered twice and an entry with a schema mistake, between two good entries (written by hand:
# json.dumps cannot write a key twice)
INFO = """{
  "good_a": {"file_name": "a.json"},
  "twice": {"file_name": "a.json"},
  "bad_schema": {"file_name": "a.json", "formating": "sharegpt"},
  "twice": {"file_name": "other.json"},
  "good_b": {"file_name": "a.json", "columns": {"prompt": "instruction", "response": "output"}}
}
"""


def _folder(root, text=INFO):
    folder = root / "mydata"
    folder.mkdir()
    (folder / "dataset_info.json").write_text(text, encoding="utf-8")
    (folder / "a.json").write_text(json.dumps([{"instruction": "hi", "output": "hello"}]), encoding="utf-8")
    return folder


def test_bad_entries_are_named_with_why_and_left_out_of_the_lists(root):
    folder = _folder(root)
    assert choices.dataset_names(folder) == ["good_a", "good_b"]
    text = data_tab.info_warning(str(folder), "en")
    assert text.startswith("⚠ 2 entries of dataset_info.json cannot be used"), text
    assert "- **twice**: dataset 'twice' is registered twice (file_name 'a.json' and 'other.json')" in text, text
    assert "- **bad_schema**: unknown key 'formating' (did you mean 'formatting'?)" in text, text
    assert "good_a" not in text and "good_b" not in text
    german = data_tab.info_warning(str(folder), "de")
    assert german.startswith("⚠ 2 Einträge der dataset_info.json sind nicht verwendbar"), german
    assert "**twice**" in german and "**bad_schema**" in german


def test_good_entries_stay_usable(root):
    folder = _folder(root)
    summary, rendered = data_tab.show_row(str(folder), "good_b", 0, "", "default", 128, "en")
    assert "hello" in rendered, (summary, rendered)
    summary, rendered = data_tab.show_row(str(folder), "twice", 0, "", "default", 128, "en")
    assert "registered twice" in summary and rendered == "", summary


def test_no_warning_for_a_clean_file_and_one_for_a_broken_file(root):
    folder = _folder(root, json.dumps({"good_a": {"file_name": "a.json"}}))
    assert data_tab.info_warning(str(folder), "en") == ""
    (folder / "dataset_info.json").write_text('{"good_a": {"file_name": "a.json"},', encoding="utf-8")
    text = data_tab.info_warning(str(folder), "fr")
    assert text.startswith("⚠ Aucun jeu de données ne peut être listé"), text
    assert "not valid JSON at line 1" in text and choices.dataset_names(folder) == []


def test_a_refused_folder_shows_no_entry(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "dataset_info.json").write_text('{"secret_name": 5}', encoding="utf-8")
    assert data_tab.info_warning(str(outside), "en") == ""
