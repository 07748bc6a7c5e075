"""Rows of a dataset that lives on a hub (backend/core/hub_data.py says whether it can be loaded here), read with
datasets' own loaders: hf_hub_url -> datasets.load_dataset(repo or local folder, name=subset, split=split,
data_dir=folder); cloud_file_name -> the file's builder (json, csv, parquet, ...) over fsspec's s3:// / gs://."""
from __future__ import annotations

from pathlib import Path

import datasets

from backend.core import paths
from backend.core.dataset_info import DatasetError
from backend.core.hub_data import hub_key, hub_problem, local_repo

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow",
                 ".txt": "text"}


def hub_source(entry: dict, dataset_dir: Path) -> str:
    """What an entry loads from, as shown in the run log: the local folder or the hub id / URL."""
    key = hub_key(entry)
    value = str(entry[key]).strip()
    folder = local_repo(value, dataset_dir) if key == "hf_hub_url" else None
    return str(folder) if folder is not None else value


def read_hub_rows(name: str, entry: dict, dataset_dir: Path) -> list[dict]:
    """Every row of the entry's split; DatasetError (one line naming the dataset) when it cannot be loaded."""
    problem = hub_problem(name, entry, dataset_dir)
    if problem:
        raise DatasetError(problem)
    key, source = hub_key(entry), hub_source(entry, dataset_dir)
    split = entry.get("split", "train")
    cache = str(paths.cache_dir() / "datasets")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if key == "cloud_file_name":
            builder = FILE_BUILDERS.get(Path(source).suffix.lower(), "json")
            ds = datasets.load_dataset(builder, data_files=[source], split=split, cache_dir=cache)
        else:
            ds = datasets.load_dataset(source, name=entry.get("subset"), split=split, data_dir=entry.get("folder"),
                                       cache_dir=cache)
    except Exception as exc:  # datasets raises many types (not found, unknown config or split, parse errors)
        detail = " ".join(str(exc).split())[:400] or type(exc).__name__
        raise DatasetError(f"dataset '{name}': could not load {key} {source}"
                           + "".join(f" {k} {entry[k]!r}" for k in ("subset", "split", "folder") if entry.get(k))
                           + f": {detail}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    return ds.to_list()
