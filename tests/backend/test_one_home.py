"""Issue 19 step 4, "one home each": a run-file name, the tuneboard command line and the safe JSON read are
each spelled in one module. These scans fail when a copy comes back."""
from __future__ import annotations

import ast
from pathlib import Path

from backend import rundir

ROOT = Path(__file__).resolve().parents[2]


def _sources():
    for top in ("backend", "webui"):
        yield from sorted((ROOT / top).rglob("*.py"))


def _run_file_names() -> dict[str, str]:
    return {value: name for name, value in vars(rundir).items()
            if name.isupper() and (name.endswith("_FILE") or name.endswith("_LOG")) and isinstance(value, str)}


def test_run_file_literals_live_only_in_rundir():
    names = _run_file_names()
    assert "generated_predictions.jsonl" in names and "training_loss.png" in names  # the scan sees the new ones
    found = []
    for path in _sources():
        if path == ROOT / "backend" / "rundir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r} (use rundir.{names[node.value]})")
    assert not found, "\n".join(found)
