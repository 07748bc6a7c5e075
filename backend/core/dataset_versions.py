"""Rows of a local JSON / JSONL dataset file, and new versions of a registered dataset: the one place that writes
dataset files (Chat's "Save as a training row", the Data tab's row editor). Light (no torch).

A version never edits the original: `<stem>_v<N><suffix>` is written next to the dataset's file and registered in
dataset_info.json as `<name>_v<N>` with the original's entry (format, columns, tags), N the first free number.
`remove_version` is its undo: the version's file and entry go, the original was never touched. Files are written
whole through a temporary file and os.replace (backend.core.atomic): a crash leaves the old file or the new one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from backend.core.atomic import write_text_atomic
from backend.core.dataset_info import DatasetError, read_dataset_info, remove_entry, resolve_dataset_dir, write_entry

SUFFIXES = (".json", ".jsonl")
VERSION_RE = re.compile(r"^(?P<base>.+)_v(?P<n>\d+)$")


@dataclass
class Version:
    name: str  # the registered name: <name>_v<N>
    path: Path  # its file
    rows: int


def read_rows(path: Path, name: str) -> list:
    """The rows of a .json (a list) or .jsonl file; a missing file has none. A byte order mark (Excel, Notepad) is
    read as none, as the loader reads it (a saved version is written without one)."""
    text = path.read_text(encoding="utf-8-sig") if path.exists() else ""
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        rows = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as exc:
        raise DatasetError(f"dataset '{name}': {path} is not valid JSON (line {exc.lineno}): nothing was saved") \
            from None
    if not isinstance(rows, list):
        raise DatasetError(f"dataset '{name}': {path} is not a JSON list of rows: nothing was saved")
    return rows


def write_rows(path: Path, rows: list) -> None:
    if path.suffix == ".jsonl":
        write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    else:
        write_text_atomic(path, json.dumps(rows, indent=2, ensure_ascii=False) + "\n")


def local_file(dataset_dir, name: str) -> tuple[dict, Path]:
    """(entry, its one .json / .jsonl file) of a registered dataset, or a DatasetError saying why rows cannot be
    written to it (not registered, a hub dataset, a folder, another file type)."""
    info = read_dataset_info(dataset_dir)
    if name in info.problems:
        raise DatasetError(f"dataset '{name}': " + "; ".join(info.problems[name]))
    entry = info.entries.get(name)
    if entry is None:
        raise DatasetError(f"dataset '{name}' is not registered in {info.path}")
    if not entry.get("file_name"):
        raise DatasetError(f"dataset '{name}' is not a local file (a hub dataset): its rows cannot be written here")
    path = resolve_dataset_dir(dataset_dir) / entry["file_name"]
    if path.suffix not in SUFFIXES or path.is_dir():
        raise DatasetError(f"dataset '{name}': rows can be written to a .json or .jsonl file, not {path.name}")
    return entry, path


def new_version(dataset_dir, name: str, rows: list) -> Version:
    """Write `rows` as a new version of dataset `name` and register it (the original file and entry unchanged)."""
    entry, path = local_file(dataset_dir, name)
    info = read_dataset_info(dataset_dir)
    n = 2
    while path.with_name(f"{path.stem}_v{n}{path.suffix}").exists() or f"{name}_v{n}" in info.raw:
        n += 1
    new_path = path.with_name(f"{path.stem}_v{n}{path.suffix}")
    version = f"{name}_v{n}"
    write_rows(new_path, rows)
    try:
        write_entry(dataset_dir, version, dict(entry, file_name=str(Path(entry["file_name"]).with_name(new_path.name))))
    except DatasetError:
        new_path.unlink(missing_ok=True)  # not registered: no stray file
        raise
    return Version(version, new_path, len(rows))


def replace_row(dataset_dir, name: str, index: int, row: dict) -> Version:
    """A new version of `name` with its file row `index` (0-based) replaced by `row`."""
    _, path = local_file(dataset_dir, name)
    rows = read_rows(path, name)
    if not 0 <= index < len(rows):
        raise DatasetError(f"dataset '{name}': row {index} is not in {path.name} ({len(rows)} rows)")
    if not isinstance(row, dict):
        raise DatasetError(f"dataset '{name}': a row is a JSON object, got {type(row).__name__}")
    rows[index] = row
    return new_version(dataset_dir, name, rows)


def remove_version(dataset_dir, version: str) -> None:
    """Undo new_version: the version's file and its dataset_info.json entry go. Only a `<name>_v<N>` entry whose
    file is `<stem>_v<N>` of its base's file can be removed this way."""
    match = VERSION_RE.match(version or "")
    if not match:
        raise DatasetError(f"dataset '{version}' is not a saved version (<name>_v<N>): nothing removed")
    entry, path = local_file(dataset_dir, version)
    if not path.stem.endswith(f"_v{match['n']}"):
        raise DatasetError(f"dataset '{version}': its file {path.name} is not a saved version's: nothing removed")
    remove_entry(dataset_dir, version)
    path.unlink(missing_ok=True)
