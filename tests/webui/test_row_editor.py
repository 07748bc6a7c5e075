"""The Data tab's row editor (webui/row_editor.py) with the real `tuneboard preview` subprocess: the shown row's raw
JSON loads into the editor, an edit re-renders with the edited answer as the trained span (a row training would skip
says so in one line), Save writes a new registered version with that row replaced (the original untouched), Undo
removes it."""
from __future__ import annotations

import json
import shutil
from html import escape

from backend.core import paths
from backend.core.dataset_info import load_dataset_info
from webui import row_editor

NAME = "alpaca_en_demo"


def test_load_edit_render_save_and_undo_a_row(tmp_path, monkeypatch):
    shutil.copy(paths.DATA_DIR / "dataset_info.json", tmp_path / "dataset_info.json")
    shutil.copy(paths.DATA_DIR / f"{NAME}.json", tmp_path / f"{NAME}.json")
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tmp_path))
    original = (tmp_path / f"{NAME}.json").read_bytes()
    rows = json.loads(original)
    top = ("", "auto", 512, "en")  # model (the default), template, cutoff, language

    st, text, message = row_editor.load_row({}, str(tmp_path), NAME, 1, "", "auto", 512, "en")
    assert json.loads(text) == rows[1] and st["row"] == 1 and message.startswith("✓ row 1 of"), message

    edited = dict(rows[1], output="An edited answer about llamas.")
    summary, shown = row_editor.render_edit(st, json.dumps(edited), *top)
    assert "edited, not saved" in summary and escape("An edited answer about llamas.") in shown
    assert escape(rows[1]["output"]) not in shown
    refused, _ = row_editor.render_edit(st, json.dumps(dict(edited, output="")), *top)
    assert refused.startswith("✖ training would not use this row") and "empty response" in refused

    # a row training would skip is not saved
    st2, message, _ = row_editor.save_version(st, json.dumps(dict(edited, output="")), *top)
    assert message.startswith("✖") and not (tmp_path / f"{NAME}_v2.json").exists()

    st, message, picker = row_editor.save_version(st, json.dumps(edited), *top)
    assert message.startswith(f"✓ saved `{NAME}_v2` ({NAME}_v2.json)"), message
    assert picker["value"] == f"{NAME}_v2" and f"{NAME}_v2" in load_dataset_info(tmp_path)
    saved = json.loads((tmp_path / f"{NAME}_v2.json").read_text())
    assert saved[1] == edited and saved[:1] + saved[2:] == rows[:1] + rows[2:]
    assert (tmp_path / f"{NAME}.json").read_bytes() == original

    st, message, picker = row_editor.undo_version(st, "en")
    assert message.startswith(f"removed `{NAME}_v2`") and picker["value"] == NAME
    assert not (tmp_path / f"{NAME}_v2.json").exists() and f"{NAME}_v2" not in load_dataset_info(tmp_path)
    assert row_editor.undo_version(st, "en")[1] == "nothing to undo"
