"""The rules of the tokenized-cache keys (`tokenized_path`, `overwrite_cache`; the cache itself is
backend/dataprep/token_cache.py), beside the spec as eval_rules are: light (paths only), so validate and the
web UI check them without the data stack. Each rule returns (field, message, the fields involved)."""
from __future__ import annotations

import os
from pathlib import Path

from backend.core.refusals import REFUSED

CACHED_STAGES = ("sft", "pt")  # the stages whose tokenized rows are cached (the others tokenize every run)
META = "meta.json"  # written last into a cache folder: a folder without it holds no complete cache


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
