"""dataset_info.json (LLaMA-Factory's schema), read entry by entry: light (json only, no `datasets`), so
`validate` and the web UI check entries without the data stack. backend.dataprep.data re-exports everything here.

One bad entry never hides the others: a schema mistake, a name registered twice or a key given twice makes
that entry unusable, with its problems kept for the error that names it when it is used (or listed)."""
from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.core import paths
from backend.core.atomic import write_json_atomic
from backend.core.hub_data import is_hub_id

# The data files the loader reads, by suffix -> the `datasets` builder that reads them (backend.dataprep.data reads
# them; validate, which stays light, refuses any other suffix before launch).
FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow",
              ".txt": "text"}

# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------
FORMATTINGS = ("alpaca", "sharegpt", "openai")
HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
# probe_question (TuneBoard's own; LLaMA-Factory ignores it): a question the data teaches, which the Chat tab
# offers for an adapter trained on it: a string, or {language code: question} for data in several languages
ENTRY_KEYS = ("file_name", "formatting", "ranking", "columns", "tags", "split", "num_samples", "subset",
              "folder", "probe_question", *HUB_KEYS)
COLUMN_KEYS = ("prompt", "query", "response", "history", "messages", "system", "tools", "chosen", "rejected",
               "kto_tag", "text", "images", "videos", "audios")
MEDIA_COLUMNS = ("images", "videos", "audios")
ALPACA_ONLY_COLUMNS = ("query", "response", "history")
CONVERSATION_ONLY_COLUMNS = ("messages",)
TAG_KEYS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag",
            "system_tag")
# a name a new dataset may be registered under (the Data tab's registration, Chat's "Save as a training row")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# LLaMA-Factory's defaults where an entry leaves them out: the tags of each conversation format, the columns of each
DEFAULT_TAGS = {
    "sharegpt": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"},
    "openai": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"},
}


def entry_columns(entry: dict) -> dict:
    """{column key: the file's column} for an entry, its formatting's defaults under what it declares."""
    formatting = entry.get("formatting", "alpaca")
    if formatting == "alpaca":
        columns = {"prompt": "instruction", "query": "input", "response": "output"}
    else:
        columns = {"messages": "conversations" if formatting == "sharegpt" else "messages"}
    if entry.get("ranking"):
        columns.update(chosen="chosen", rejected="rejected")
    columns.update(entry.get("columns", {}))
    return columns


def entry_tags(entry: dict) -> dict:
    """The role / content tags of a conversation entry, its formatting's defaults under what it declares."""
    return dict(DEFAULT_TAGS.get(entry.get("formatting", "alpaca"), {}), **entry.get("tags", {}))

class DatasetError(ValueError):
    """A dataset cannot be used: the message names the dataset, the file and the problem."""



# ---------------------------------------------------------------------------------------------
# dataset_info.json
# ---------------------------------------------------------------------------------------------
def resolve_dataset_dir(dataset_dir: str | os.PathLike | None) -> Path:
    """None -> the repo's data/. A relative path is tried against the current directory first, then
    against the repository, so `dataset_dir: data` works wherever the command is started from (the
    most common first-run failure of the tools we learned from)."""
    if dataset_dir is None or str(dataset_dir).strip() == "":
        return paths.DATA_DIR
    path = Path(dataset_dir).expanduser()
    if path.is_absolute():
        return path
    candidates = [Path.cwd() / path, paths.REPO_ROOT / path]
    for c in candidates:
        if (c / "dataset_info.json").is_file():
            return c.resolve()
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    raise DatasetError(f"dataset_dir '{dataset_dir}' not found: looked in {candidates[0]} and {candidates[1]}")


def _close(word: str, choices) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def entry_problems(name: str, entry: Any) -> list[str]:
    """Every schema problem of one dataset_info.json entry, each naming the dataset and the key."""
    where = f"dataset '{name}'"
    if not isinstance(entry, dict):
        return [f"{where}: the entry must be a JSON object, got {type(entry).__name__}"]
    problems = []
    for key in entry:
        if key not in ENTRY_KEYS:
            problems.append(f"{where}: unknown key '{key}'{_close(key, ENTRY_KEYS)}; "
                            f"allowed keys: {', '.join(ENTRY_KEYS)}")
    if "file_name" not in entry and not any(k in entry for k in HUB_KEYS):
        problems.append(f"{where}: missing key 'file_name' (the data file or folder, relative to dataset_dir)")
    for key in ("file_name", "split", "subset", "folder", *HUB_KEYS):
        if key in entry and (not isinstance(entry[key], str) or not entry[key].strip()):
            problems.append(f"{where}: '{key}' must be a non-empty string, got {entry[key]!r}")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        problems.append(f"{where}: 'formatting' must be one of {', '.join(FORMATTINGS)}, got {formatting!r}")
    if "probe_question" in entry and not _is_probe_question(entry["probe_question"]):
        problems.append(f"{where}: 'probe_question' must be a non-empty string or an object of language code -> "
                        f"question (e.g. {{\"en\": \"Who are you?\"}}), got {entry['probe_question']!r}")
    if "ranking" in entry and not isinstance(entry["ranking"], bool):
        problems.append(f"{where}: 'ranking' must be true or false, got {entry['ranking']!r}")
    if "num_samples" in entry and (isinstance(entry["num_samples"], bool) or not isinstance(entry["num_samples"], int)
                                   or entry["num_samples"] < 1):
        problems.append(f"{where}: 'num_samples' must be a positive integer, got {entry['num_samples']!r}")
    for key, allowed in (("columns", COLUMN_KEYS), ("tags", TAG_KEYS)):
        if key not in entry:
            continue
        value = entry[key]
        if not isinstance(value, dict):
            problems.append(f"{where}: '{key}' must be a JSON object, got {type(value).__name__}")
            continue
        for sub, v in value.items():
            if sub not in allowed:
                problems.append(f"{where}: unknown key '{key}.{sub}'{_close(sub, allowed)}; allowed: {', '.join(allowed)}")
            elif not isinstance(v, str) or not v:
                problems.append(f"{where}: '{key}.{sub}' must be a non-empty string (a column name), got {v!r}")
    columns = entry.get("columns") if isinstance(entry.get("columns"), dict) else {}
    if formatting == "alpaca":
        for sub in CONVERSATION_ONLY_COLUMNS:
            if sub in columns:
                problems.append(f"{where}: 'columns.{sub}' is for sharegpt/openai formatting; "
                                f"alpaca uses prompt/query/response (set \"formatting\")")
        if "tags" in entry:
            problems.append(f"{where}: 'tags' apply to sharegpt/openai formatting only, this entry is alpaca")
    elif formatting in FORMATTINGS:
        for sub in ALPACA_ONLY_COLUMNS:
            if sub in columns:
                problems.append(f"{where}: 'columns.{sub}' is for alpaca formatting; {formatting} uses 'columns.messages'")
    if entry.get("ranking") is True and "kto_tag" in columns:
        problems.append(f"{where}: a ranking dataset (chosen/rejected) cannot also have 'columns.kto_tag'")
    return problems


def _is_probe_question(value: Any) -> bool:
    def text(v):
        return isinstance(v, str) and bool(v.strip())
    return text(value) or (isinstance(value, dict) and bool(value)
                           and all(text(k) and text(v) for k, v in value.items()))


def probe_question(entry: dict, lang: str = "en") -> str | None:
    """An entry's probe question in `lang`, else in English, else the first one it declares; None without one."""
    value = entry.get("probe_question")
    if not _is_probe_question(value):
        return None
    if isinstance(value, str):
        return value
    return value.get(lang) or value.get("en") or next(iter(value.values()))


class _JSONObject(dict):
    """A JSON object that remembers the keys it was given more than once (json keeps only the last)."""
    duplicates: list


def _object_keeping_duplicates(pairs: list) -> _JSONObject:
    obj = _JSONObject()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj:
            obj.duplicates.append((key, obj[key], value))
        obj[key] = value
    return obj


def _file_name(entry: Any) -> str:
    return repr(entry.get("file_name")) if isinstance(entry, dict) and "file_name" in entry else "no file_name"


@dataclass
class DatasetInfo:
    """<dataset_dir>/dataset_info.json read entry by entry: one bad entry does not hide the others."""
    path: Path
    entries: dict    # name -> entry, the usable ones, in file order
    problems: dict   # name -> [problem, ...] of an entry that cannot be used (reported when it is used)
    raw: dict        # every name as written (the last of a duplicated name)

    def entry(self, name: str) -> dict:
        if name in self.problems:
            raise DatasetError(f"{self.path}: " + "; ".join(self.problems[name]))
        if name not in self.raw and is_hub_id(name):  # `dataset: org/name`: a hub dataset, the default columns
            return {"hf_hub_url": name}
        if name not in self.entries:
            known = list(self.raw)
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise DatasetError(f"unknown dataset '{name}': it is not in {self.path}{hint} "
                               f"(known: {', '.join(sorted(known)) or 'none'})")
        return self.entries[name]


def read_dataset_info(dataset_dir: str | os.PathLike | None = None) -> DatasetInfo:
    """Read and check `<dataset_dir>/dataset_info.json` entry by entry. A file that is not JSON or not an
    object is an error; a bad entry (schema problem, a name registered twice, a key given twice) is kept
    aside with its problems, so the other datasets stay usable."""
    path = resolve_dataset_dir(dataset_dir) / "dataset_info.json"
    if not path.is_file():
        raise DatasetError(f"{path} not found: dataset_dir must contain a dataset_info.json "
                           f"(LLaMA-Factory's schema: {{\"name\": {{\"file_name\": ...}}}})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        info = json.loads(text, object_pairs_hook=_object_keeping_duplicates)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(info, dict):
        raise DatasetError(f"{path}: the top level must be a JSON object of dataset entries, got {type(info).__name__}")
    problems: dict[str, list[str]] = {}
    for name, first, second in info.duplicates:
        problems.setdefault(name, []).append(
            f"dataset '{name}' is registered twice (file_name {_file_name(first)} and {_file_name(second)}): "
            f"rename or remove one of the two entries")
    for name, entry in info.items():
        found = entry_problems(name, entry)
        for owner in [entry] + ([v for v in entry.values() if isinstance(v, _JSONObject)] if isinstance(entry, dict) else []):
            for key, a, b in getattr(owner, "duplicates", []):
                found.append(f"dataset '{name}': key '{key}' is given twice ({a!r} and {b!r})")
        if found:
            problems.setdefault(name, []).extend(found)
    entries = {name: entry for name, entry in info.items() if name not in problems}
    return DatasetInfo(path, entries, problems, dict(info))


def load_dataset_info(dataset_dir: str | os.PathLike | None = None) -> dict:
    """The usable entries of `<dataset_dir>/dataset_info.json` as {name: entry} in file order (a bad entry
    is left out here; read_dataset_info says why, and using it by name is an error that says so)."""
    return read_dataset_info(dataset_dir).entries


def _entries_before_adding(info_path: Path, name: str, overwrite: bool) -> dict:
    """The file's entries as written, to which `name` may be added: refused (DatasetError) when the file is not
    JSON or not an object (never overwritten), has a name registered twice (rewriting it would silently drop
    one), or already has `name` and overwrite is off."""
    info: dict = {}
    if info_path.exists():
        current = read_dataset_info(info_path.parent)
        twice = [n for n, found in current.problems.items() if any("registered twice" in p for p in found)]
        if twice:
            raise DatasetError(f"{info_path}: " + "; ".join(current.problems[twice[0]]) + "; fix the file first")
        info = current.raw  # bad entries are kept as they are: they are not this registration's business
    if name in info and not overwrite:
        raise DatasetError(f"dataset '{name}' already exists in {info_path}; choose another name or overwrite it")
    return info


def check_new_entry(dataset_dir: str | os.PathLike | None, name: str, overwrite: bool = False) -> None:
    """Would write_entry accept `name`? (Raises its DatasetError; a caller with a slow check runs this first.)"""
    _entries_before_adding(resolve_dataset_dir(dataset_dir) / "dataset_info.json", name, overwrite)


def write_entry(dataset_dir: str | os.PathLike | None, name: str, entry: dict, overwrite: bool = False) -> Path:
    """The one writer of dataset_info.json (backend.dataprep.data.register_dataset after its load check, the Data tab
    after its own): re-read the file, refuse as check_new_entry says, add `entry` as `name`, keep every other
    entry as written, replace the file atomically (backend.core.atomic). Returns the file's path."""
    info_path = resolve_dataset_dir(dataset_dir) / "dataset_info.json"
    info = _entries_before_adding(info_path, name, overwrite)
    info[name] = entry
    write_json_atomic(info_path, info, newline=True)
    return info_path


def remove_entry(dataset_dir: str | os.PathLike | None, name: str) -> Path:
    """Take `name` out of dataset_info.json (the undo of a saved version: backend.core.dataset_versions), every other
    entry kept as written, the file replaced atomically. Returns the file's path."""
    info_path = resolve_dataset_dir(dataset_dir) / "dataset_info.json"
    info = dict(read_dataset_info(info_path.parent).raw)
    if name not in info:
        raise DatasetError(f"dataset '{name}' is not registered in {info_path}: nothing removed")
    del info[name]
    write_json_atomic(info_path, info, newline=True)
    return info_path
