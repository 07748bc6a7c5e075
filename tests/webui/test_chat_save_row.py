"""The Chat tab's "Save as a training row": the conversation of pane A with its last answer corrected lands in a new
dataset (created and registered) or an existing one, and the Data tab's preview (the real `tuneboard preview`
subprocess) shows the saved row with the corrected answer as the trained span; a refused save says why in one line."""
from __future__ import annotations

import json
import shutil
from html import escape

from backend.core import paths
from webui.tabs import chat
from webui.tabs import data as data_tab


def _state(*turns):
    st = chat.empty_state()
    st["hist_a"] = [{"role": role, "content": text} for role, text in turns]
    return st


def test_save_a_corrected_answer_into_a_new_dataset_and_preview_it(tmp_path, monkeypatch):
    shutil.copy(paths.DATA_DIR / "dataset_info.json", tmp_path / "dataset_info.json")
    shutil.copy(paths.DATA_DIR / "alpaca_en_demo.json", tmp_path / "alpaca_en_demo.json")
    monkeypatch.setattr(paths, "DATA_DIR", tmp_path)
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tmp_path))
    st = _state(("user", "Who made you?"), ("assistant", "I was made by OpenAI."))
    assert chat.last_answer(st) == "I was made by OpenAI."

    message, picker = chat.save_training_row(st, "chat_fixes", "I was made by the TuneBoard team.",
                                             "You are TuneBoard Assistant.", "", "en")
    assert message.startswith("✓ created `chat_fixes` (chat_fixes.jsonl, registered)"), message
    assert "chat_fixes" in picker["choices"] and picker["value"] == "chat_fixes"
    row = json.loads((tmp_path / "chat_fixes.jsonl").read_text())
    assert row["messages"][-1] == {"role": "assistant", "content": "I was made by the TuneBoard team."}
    assert st["hist_a"][-1]["content"] == "I was made by OpenAI."  # the chat itself is unchanged

    summary, shown = data_tab.show_row(str(tmp_path), "chat_fixes", 0, "", "auto", 256)
    assert "✖" not in summary, summary
    trained = shown.split('class="tb-trained"')
    assert any(escape("I was made by the TuneBoard team.") in part.split("</span>")[0] for part in trained[1:]), shown
    assert escape("You are TuneBoard Assistant.") in shown

    # a second turn without a correction appends row 1 as it was answered
    st["hist_a"] += [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome."}]
    message, _ = chat.save_training_row(st, "chat_fixes", "", "", "", "en")
    assert message.startswith("✓ saved as row 1 of `chat_fixes`"), message

    # an alpaca dataset without a history column cannot take a multi-turn conversation: one line, nothing written
    before = (tmp_path / "alpaca_en_demo.json").read_bytes()
    message, picker = chat.save_training_row(st, "alpaca_en_demo", "", "", "", "en")
    assert message.startswith("✖ `Dataset") and "no history column" in message and "\n" not in message
    assert (tmp_path / "alpaca_en_demo.json").read_bytes() == before
