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


def test_the_tuneboard_command_line_is_spelled_once():
    """`-m backend.cli` appears only in backend/paths.tuneboard_argv; every child process is built by it."""
    found = []
    for path in _sources():
        if path == ROOT / "backend" / "paths.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == "backend.cli":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "use backend.paths.tuneboard_argv: " + ", ".join(found)


def test_tuneboard_argv_is_the_module_command_line():
    import sys

    from backend.paths import tuneboard_argv
    assert tuneboard_argv("train", "a.yaml") == [sys.executable, "-m", "backend.cli", "train", "a.yaml"]
    assert tuneboard_argv("api", unbuffered=True) == [sys.executable, "-u", "-m", "backend.cli", "api"]


def test_run_folders_are_named_in_rundir_only():
    """The time stamp of a run folder is spelled once (rundir.STAMP_FORMAT); the folder loops use unique_dir."""
    found = [f"{p.relative_to(ROOT)}" for p in _sources()
             if p != ROOT / "backend" / "rundir.py" and rundir.STAMP_FORMAT in p.read_text(encoding="utf-8")]
    assert not found, found


def test_unique_dir_skips_existing_and_taken(tmp_path):
    base = tmp_path / "m" / "lora" / "20261130-154020"
    assert rundir.unique_dir(base) == base
    base.mkdir(parents=True)
    assert rundir.unique_dir(base, taken=[base.with_name(base.name + "-2")]) == base.with_name(base.name + "-3")
    assert rundir.default_output_dir("org/Model.Q4_1.GGUF", "lora", root=tmp_path).parent == tmp_path / "Model.Q4_1" / "lora"
