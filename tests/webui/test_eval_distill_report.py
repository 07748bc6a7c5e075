"""The Evaluate tab shows the distillation scorecards (issue 14, point 7): it lists the distill_report.json files
under the saves folder (backend.core.rundir.DISTILL_REPORT_FILE), newest first, and shows one as who was scored and
the table metric | base | tuned (JSON validity, schema validity, field F1, exact match, tokens/s). The reports
are written here in the format backend.distill.scorecard.score writes (its summarize() for each model)."""
from __future__ import annotations

import json
import os

from backend.distill.scorecard import summarize
from backend.core.rundir import DISTILL_REPORT_FILE
from webui.tabs import evaluate as ev

ROWS = {"base": [{"exact_match": 0.0, "json_valid": 1.0, "field_f1": 0.5, "schema_valid": 0.0},
                 {"exact_match": 0.0, "json_valid": 0.0, "field_f1": 0.0, "schema_valid": 0.0}],
        "tuned": [{"exact_match": 1.0, "json_valid": 1.0, "field_f1": 1.0, "schema_valid": 1.0},
                  {"exact_match": 0.0, "json_valid": 1.0, "field_f1": 0.75, "schema_valid": 1.0}]}


def _write(folder, adapter="/saves/distill/invoices/train", models=("base", "tuned"), mtime=None):
    """distill_report.json as backend.distill.scorecard.score writes it."""
    folder.mkdir(parents=True)
    results = {"base": summarize(ROWS["base"], 4.0, 100), "tuned": summarize(ROWS["tuned"], 5.0, 150)}
    report = {"student": "HuggingFaceTB/SmolLM2-135M-Instruct", "adapter": adapter,
              "teacher": "local HuggingFaceTB/SmolLM2-135M-Instruct", "dataset": folder.name, "rows": 2,
              "answer_format": "json", "schema": True, **{m: results[m] for m in models}}
    path = folder / DISTILL_REPORT_FILE
    path.write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return folder


def test_reports_under_saves_are_listed_newest_first(root):
    assert ev.distill_reports() == []
    picker, summary = ev.list_distill_reports(None, "en")
    assert picker["choices"] == [] and picker["value"] is None
    assert "No distillation scorecard" in summary and str(root) in summary
    old = _write(root / "distill" / "old_set", mtime=1_000_000)
    new = _write(root / "distill" / "invoices", mtime=2_000_000)
    own = _write(root / "my-distill", mtime=1_500_000)  # a distill run with its own output_dir under saves
    (root / "train-run").mkdir()
    (root / "train-run" / "status.json").write_text("{}")
    assert ev.distill_reports() == [("distill/invoices", str(new)), ("my-distill", str(own)),
                                    ("distill/old_set", str(old))]
    picker, _ = ev.list_distill_reports(None, "en")
    assert picker["value"] == str(new)
    picker, _ = ev.list_distill_reports(str(old), "en")  # the one shown stays picked
    assert picker["value"] == str(old)


def test_scorecard_table_base_and_tuned(root):
    folder = _write(root / "distill" / "invoices")
    summary, table = ev.distill_card(str(folder), "en")
    assert "`HuggingFaceTB/SmolLM2-135M-Instruct`" in summary and "`/saves/distill/invoices/train`" in summary
    assert "teacher `local HuggingFaceTB/SmolLM2-135M-Instruct`" in summary and "2 held-out pairs of `invoices`" in summary
    assert list(table.columns) == ["metric", "base", "tuned"]
    rows = {r[0]: (r[1], r[2]) for r in table.values.tolist()}
    assert rows["json_valid"] == (0.5, 1.0)
    assert rows["schema_valid"] == (0.0, 1.0)
    assert rows["field_f1"] == (0.25, 0.875)
    assert rows["exact_match"] == (0.0, 0.5)
    assert rows["tokens_per_s"] == (25.0, 30.0)
    assert list(rows)[:5] == ["json_valid", "schema_valid", "field_f1", "exact_match", "tokens_per_s"]
    summary, table = ev.distill_card(str(folder), "ja")
    assert summary.startswith("生徒モデル") and list(table.columns)[0] == "指標"


def test_base_only_missing_and_refused(root, tmp_path):
    folder = _write(root / "distill" / "base_only", adapter=None, models=("base",))
    summary, table = ev.distill_card(str(folder), "en")
    assert "adapter `—`" in summary
    rows = {r[0]: (r[1], r[2]) for r in table.values.tolist()}
    assert rows["json_valid"] == (0.5, "") and rows["tokens_per_s"] == (25.0, "")
    empty = root / "distill" / "not_scored"
    empty.mkdir()
    summary, table = ev.distill_card(str(empty), "en")
    assert summary.startswith("No scorecard in") and str(empty / DISTILL_REPORT_FILE) in summary and table.empty
    outside = _write(tmp_path / "elsewhere")
    summary, table = ev.distill_card(str(outside), "en")
    assert "not allowed" in summary or "outside the allowed folders" in summary, summary
    assert "invoices" not in summary and table.empty
