"""The Data tab's Check button: `tuneboard lint --json` in a subprocess, its findings shown with their rows."""
from __future__ import annotations

import json

from webui.tabs import data as data_tab


def test_check_lists_the_findings_with_their_rows(root, tiny_llama):
    """The Check's row numbers are the file's rows, the numbers the Row field takes: a row the loader skips before a
    finding's row shifted the preview by one (row 5 was out of range). The skipped row opens as the reason training
    skips it, and loads into the row editor to be mended."""
    from html import escape

    from webui import row_editor

    folder = root / "mydata"
    folder.mkdir()
    rows = [{"instruction": f"Name a colour, number {k}, that people often see in the sky at {k} o'clock.",
             "output": f"Blue, at {k} o'clock."} for k in range(4)]
    rows.insert(1, {"instruction": "Name a colour that people rarely see in the sky at all.", "output": ""})
    rows.append(dict(rows[3]))  # row 5 repeats row 3
    (folder / "mine.json").write_text(json.dumps(rows), encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}}), encoding="utf-8")
    top = (str(tiny_llama), "default", 256)
    md, picker = data_tab.check(str(folder), "mine", *top, "de")
    assert picker["choices"] == [("leere Antwort · mine · 1", "1"), ("Duplikate · mine · 5", "5")] \
        and picker["visible"], picker  # picking one shows that row
    assert md.startswith("**Prüfen**: 2 Befunde (1 Fehler, 1 Warnungen, 0 Hinweise)"), md
    assert "**Duplikate** (mine)" in md and "Zeilen 5" in md and "`--fix drop_duplicates`" in md, md
    assert data_tab.check(str(folder), "", *top)[0] == "Pick a dataset."

    summary, shown = data_tab.show_row(str(folder), "mine", 5, *top)
    assert "**mine row 5**" in summary and escape(rows[5]["output"]) in shown, summary
    summary, shown = data_tab.show_row(str(folder), "mine", 1, *top)
    assert summary == "✖ dataset 'mine': training skips row 1 of mine.json: empty response (column 'output')" \
        and shown == "", summary
    st, text, message = row_editor.load_row({}, str(folder), "mine", 1, *top, "en")
    assert json.loads(text) == rows[1] and st["row"] == 1 and message.startswith("✓ row 1 of mine.json is in the "
                                                                                 "editor; training skips it"), message


def test_fix_writes_a_new_registered_version_and_picks_it(root, tiny_llama):
    folder = root / "mydata"
    folder.mkdir()
    rows = [{"instruction": f"Name a colour, number {k}, that people often see in the sky at {k} o'clock.",
             "output": f"Blue, at {k} o'clock."} for k in range(4)]
    original = json.dumps(rows + [dict(rows[1])])  # row 4 repeats row 1
    (folder / "mine.json").write_text(original, encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}}), encoding="utf-8")
    md, picker = data_tab.fix(str(folder), "mine", str(tiny_llama), "default", 256)
    assert md.startswith("✓ safe fixes applied") and "mine_v2" in md and picker["value"] == "mine_v2", md
    assert "mine_v2" in picker["choices"] or ("mine_v2", "mine_v2") in picker["choices"], picker
    assert json.loads((folder / "mine_v2.json").read_text()) == rows and (folder / "mine.json").read_text() == original
    assert json.loads((folder / "dataset_info.json").read_text())["mine_v2"]["file_name"] == "mine_v2.json"
    md, picker = data_tab.fix(str(folder), "mine_v2", str(tiny_llama), "default", 256)  # nothing left to fix
    assert md == "**Fix**: nothing to fix (no finding has a safe fix)" and picker == __import__("gradio").skip()


def test_the_register_form_reads_a_byte_order_mark_as_no_part_of_a_column(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte order mark: the register form's column check named the first column
    '\\ufeffq' and found no 'q'; a JSON or JSONL file with one was 'not valid JSON'."""
    from webui import datasets as D

    rows = [{"q": "Say hi", "a": "hi"}, {"q": "Say bye", "a": "bye"}]
    files = {"t.csv": "q,a\nSay hi,hi\nSay bye,bye\n", "t.json": json.dumps(rows),
             "t.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}
    for name, text in files.items():
        (tmp_path / name).write_text("\ufeff" + text, encoding="utf-8")
        got = D.check_entry("mine", tmp_path / name, "alpaca", {"prompt": "q", "response": "a"}, {})
        assert got == rows, (name, got)
