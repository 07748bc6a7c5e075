"""The rules of the tokenized-cache keys (`tokenized_path`, `overwrite_cache`; the cache itself is
backend/dataprep/token_cache.py), beside the spec as eval_rules are: light (paths only), so validate and the
web UI check them without the data stack. Each rule returns (field, message, the fields involved). Also what a
key reads of a dataset's files (`data_files`, `file_state`): the tokenized cache's key and the Train tab's pre-flight
data check (webui/data_check.py) use the same."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from backend.core.hub_data import hub_key, local_repo
from backend.core.refusals import REFUSED

CACHED_STAGES = ("sft", "pt")  # the stages whose tokenized rows are cached (the others tokenize every run)
META = "meta.json"  # written last into a cache folder: a folder without it holds no complete cache
HASH_LIMIT = 64 * 1024 * 1024  # files up to this size are hashed; larger ones by size + modification time


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why `tokenized_path` cannot hold a cache (None when it can): it is a file, or a folder of other files."""
    p = Path(path).expanduser()
    if p.is_file():
        return f"{p} is a file: tokenized_path names a folder (the tokenized dataset is saved there in Arrow files)"
    if p.is_dir() and any(p.iterdir()) and not (p / META).is_file():
        return (f"{p} is a folder with other files and no {META}: it is not a tokenized cache; name a new or empty "
                "folder (TuneBoard replaces the folder's content when the data or settings change)")
    return None


def cache_errors(spec, check_files: bool = True) -> list[tuple[str, str, frozenset]]:
    errors: list[tuple[str, str, frozenset]] = []
    for key in ("tokenized_path", "overwrite_cache"):
        if getattr(spec, key) and spec.stage not in CACHED_STAGES:
            errors.append((key, f"{REFUSED}: the tokenized cache holds the rows of stages {', '.join(CACHED_STAGES)}; "
                                f"stage {spec.stage} tokenizes its data in every run", frozenset((key, "stage"))))
    if spec.tokenized_path and getattr(spec, "streaming", False):
        errors.append(("tokenized_path", f"{REFUSED}: a stream is tokenized as it is read, never saved whole: drop "
                                         "tokenized_path or streaming", frozenset(("tokenized_path", "streaming"))))
    if spec.tokenized_path and check_files:
        problem = folder_problem(spec.tokenized_path)
        if problem:
            errors.append(("tokenized_path", problem, frozenset(("tokenized_path",))))
    return errors


def file_state(path: Path) -> list:
    """A data file's state in a cache key: [size, content hash] (by size + modification time above HASH_LIMIT)."""
    st = path.stat()
    if st.st_size > HASH_LIMIT:
        return [st.st_size, st.st_mtime_ns]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return [st.st_size, h.hexdigest()[:16]]


def data_files(entry: dict, dataset_dir: Path) -> list[Path] | None:
    """The entry's local data files (a folder: every file in it; an hf_hub_url that is a hub-style local folder too);
    None for an entry without a local file (a hub id: its data can change unseen)."""
    name = entry.get("file_name")
    if not isinstance(name, str) or not name.strip():
        folder = local_repo(str(entry["hf_hub_url"]), dataset_dir) if hub_key(entry) == "hf_hub_url" else None
        if folder is None:
            return None
        name = str(folder)
    path = Path(name).expanduser()
    path = path if path.is_absolute() else dataset_dir / path
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [path] if path.is_file() else []
