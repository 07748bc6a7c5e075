"""The Data tab's Check button: `tuneboard lint --json` in a subprocess, its findings shown with their rows."""
from __future__ import annotations

import json

from webui.tabs import data as data_tab


def test_check_lists_the_findings_with_their_rows(root, tiny_llama):
    folder = root / "mydata"
    folder.mkdir()
    rows = [{"instruction": f"Name a colour, number {k}, that people often see in the sky at {k} o'clock.",
             "output": f"Blue, at {k} o'clock."} for k in range(4)]
    rows.append(dict(rows[1]))  # row 4 repeats row 1
    (folder / "mine.json").write_text(json.dumps(rows), encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}}), encoding="utf-8")
    md, rows = data_tab.check(str(folder), "mine", str(tiny_llama), "default", 256, "de")
    assert rows["choices"] == [("duplicates · mine · 4", "4")] and rows["visible"], rows  # picking it shows row 4
    assert md.startswith("**Prüfen**: 1 Befunde (0 Fehler, 1 Warnungen, 0 Hinweise)"), md
    assert "**duplicates** (mine)" in md and "rows 4" in md and "`--fix drop_duplicates`" in md, md
    assert data_tab.check(str(folder), "", str(tiny_llama), "default", 256)[0] == "Pick a dataset."


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
