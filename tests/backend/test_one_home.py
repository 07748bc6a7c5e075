"""Issue 19 step 4, "one home each": a run-file name, the tuneboard command line and the safe JSON read are
each spelled in one module. These scans fail when a copy comes back."""
from __future__ import annotations

import ast
from pathlib import Path

from backend.core import rundir

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
        if path == ROOT / "backend" / "core" / "rundir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r} (use rundir.{names[node.value]})")
    assert not found, "\n".join(found)


def test_the_tuneboard_command_line_is_spelled_once():
    """`-m backend.cli` appears only in backend/paths.tuneboard_argv; every child process is built by it."""
    found = []
    for path in _sources():
        if path == ROOT / "backend" / "core" / "paths.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == "backend.cli":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "use backend.core.paths.tuneboard_argv: " + ", ".join(found)


def test_tuneboard_argv_is_the_module_command_line():
    import sys

    from backend.core.paths import tuneboard_argv
    assert tuneboard_argv("train", "a.yaml") == [sys.executable, "-m", "backend.cli", "train", "a.yaml"]
    assert tuneboard_argv("api", unbuffered=True) == [sys.executable, "-u", "-m", "backend.cli", "api"]


def test_run_folders_are_named_in_rundir_only():
    """The time stamp of a run folder is spelled once (rundir.STAMP_FORMAT); the folder loops use unique_dir."""
    found = [f"{p.relative_to(ROOT)}" for p in _sources()
             if p != ROOT / "backend" / "core" / "rundir.py" and rundir.STAMP_FORMAT in p.read_text(encoding="utf-8")]
    assert not found, found


def test_unique_dir_skips_existing_and_taken(tmp_path):
    base = tmp_path / "m" / "lora" / "20261130-154020"
    assert rundir.unique_dir(base) == base
    base.mkdir(parents=True)
    assert rundir.unique_dir(base, taken=[base.with_name(base.name + "-2")]) == base.with_name(base.name + "-3")
    assert rundir.default_output_dir("org/Model.Q4_1.GGUF", "lora", root=tmp_path).parent == tmp_path / "Model.Q4_1" / "lora"


def test_the_data_tab_registers_through_the_backend_writer(tmp_path):
    """webui.datasets.write_entry is backend.core.dataset_info.write_entry: other entries kept as written, a taken
    name or a malformed file refused with the backend's line, the malformed file never overwritten."""
    import json

    import pytest

    from webui import datasets as D
    (tmp_path / "dataset_info.json").write_text(json.dumps({"old": {"file_name": "old.json", "x_kept": 1}}))
    D.write_entry("new", {"file_name": "new.json"}, tmp_path)
    assert json.loads((tmp_path / "dataset_info.json").read_text()) == {
        "old": {"file_name": "old.json", "x_kept": 1}, "new": {"file_name": "new.json"}}
    with pytest.raises(D.RegisterError, match="dataset 'new' already exists"):
        D.write_entry("new", {"file_name": "other.json"}, tmp_path)
    (tmp_path / "dataset_info.json").write_text("{not json")
    with pytest.raises(D.RegisterError, match="not valid JSON"):
        D.write_entry("more", {"file_name": "more.json"}, tmp_path)
    assert (tmp_path / "dataset_info.json").read_text() == "{not json"
    assert D.FORMATS == __import__("backend.core.dataset_info", fromlist=["x"]).FORMATTINGS


def test_atomic_write_keeps_mode_and_read_json_dict_forgives(tmp_path):
    import os

    from backend.core.atomic import read_json_dict, write_json_atomic
    path = tmp_path / "a" / "s.json"
    write_json_atomic(path, {"k": "ü"})
    assert read_json_dict(path) == {"k": "ü"} and (path.stat().st_mode & 0o777) == 0o644
    os.chmod(path, 0o600)
    write_json_atomic(path, [1])
    assert (path.stat().st_mode & 0o777) == 0o600 and read_json_dict(path) == {}  # a list is not a dict
    path.write_text("{half")
    assert read_json_dict(path) == {} and read_json_dict(tmp_path / "none.json") == {} and read_json_dict(None) == {}
    assert [p.name for p in path.parent.iterdir()] == ["s.json"]  # no temp file left


def test_atomic_writes_go_through_backend_atomic():
    """os.replace only in backend/core/atomic.py (and stages/base.py, which renames a staged checkpoint folder)."""
    allowed = {ROOT / "backend" / "core" / "atomic.py", ROOT / "backend" / "stages" / "base.py"}
    found = [str(p.relative_to(ROOT)) for p in _sources() if p not in allowed and "os.replace(" in p.read_text(encoding="utf-8")]
    assert not found, found
