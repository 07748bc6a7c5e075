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
