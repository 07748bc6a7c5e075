"""Chat's "Save as a training row": the conversation so far, its last answer corrected by the user, appended as one
row to a registered dataset in that dataset's own columns and tags, or to a new dataset created and registered for
it (an OpenAI-format JSONL file next to dataset_info.json). Light (no torch): the Chat tab calls it in its process.

    save_row(dataset_dir, name, messages, tools="") -> SavedRow(path, index, created)

`messages`: OpenAI messages (system first if any, then user / assistant / tool turns, assistant turns may carry
`tool_calls`), ending with the assistant answer to store. Every refusal is one DatasetError line that names the
dataset (and its file), and nothing is written then. The file is rewritten whole (backend.core.dataset_versions'
write_rows: a temporary file and os.replace), so a crash leaves the old file or the new one, never half a row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backend.core.dataset_info import (NAME_RE, DatasetError, check_new_entry, entry_columns, entry_tags,
                                       read_dataset_info, resolve_dataset_dir, write_entry)
from backend.core.dataset_versions import local_file, read_rows, write_rows

# a new dataset: OpenAI messages (its default tags), the system prompt as the first message, tools as a column
NEW_ENTRY_COLUMNS = {"messages": "messages", "tools": "tools"}


@dataclass
class SavedRow:
    path: Path  # the data file the row went into
    index: int  # its 0-based position in the file: the Data tab's row number
    created: bool  # a new dataset was registered for it


def new_entry(file_name: str) -> dict:
    return {"file_name": file_name, "formatting": "openai", "columns": dict(NEW_ENTRY_COLUMNS)}


def _turns(messages: list[dict]) -> tuple[str, list[dict]]:
    """(system prompt, the other turns); refuses a conversation that does not end with an answer."""
    system = ""
    turns = [dict(m) for m in messages if m.get("role") != "system"]
    if messages and messages[0].get("role") == "system":
        system = str(messages[0].get("content") or "")
    if not turns or turns[-1].get("role") != "assistant" or not str(turns[-1].get("content") or "").strip():
        raise DatasetError("the conversation must end with a non-empty answer to save it as a training row")
    if not any(t.get("role") == "user" for t in turns):
        raise DatasetError("the conversation has no user turn to save")
    return system, turns


def _conversation_row(name: str, entry: dict, system: str, turns: list[dict], tools: str) -> dict:
    columns, tags = entry_columns(entry), entry_tags(entry)
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    tag_of = {"user": tags["user_tag"], "assistant": tags["assistant_tag"], "tool": tags["observation_tag"]}
    items: list[dict] = []
    if system and "system" not in columns:  # then the system prompt is the conversation's first turn
        items.append({role_tag: tags["system_tag"], content_tag: system})
    for turn in turns:
        calls = turn.get("tool_calls")
        if calls and entry.get("formatting") == "openai":
            items.append({role_tag: tag_of["assistant"], content_tag: turn.get("content") or "", "tool_calls": calls})
        elif calls:
            items.append({role_tag: tags["function_tag"], content_tag: json.dumps(
                [c.get("function", c) for c in calls], ensure_ascii=False)})
        else:
            items.append({role_tag: tag_of[turn["role"]], content_tag: str(turn.get("content") or "")})
    row: dict = {columns["messages"]: items}
    if system and "system" in columns:
        row[columns["system"]] = system
    if tools.strip():
        if "tools" not in columns:
            raise DatasetError(f"dataset '{name}' has no tools column: the conversation's tools cannot be saved "
                               "with it; pick a dataset with one or a new dataset")
        row[columns["tools"]] = tools
    elif "tools" in columns:
        row[columns["tools"]] = []  # the column is there in every row (the loader checks the first row's columns)
    if "kto_tag" in columns:
        row[columns["kto_tag"]] = True  # a corrected answer is a desirable one
    return row


def _alpaca_row(name: str, entry: dict, system: str, turns: list[dict], tools: str) -> dict:
    columns = entry_columns(entry)
    if any(t.get("role") == "tool" or t.get("tool_calls") for t in turns) or tools.strip():
        raise DatasetError(f"dataset '{name}' is in alpaca format, which has no tool turns: pick a sharegpt or "
                           "openai dataset, or a new one")
    pairs, question = [], None
    for turn in turns:
        if turn["role"] == "user":
            question = str(turn.get("content") or "")
        elif question is not None:
            pairs.append([question, str(turn.get("content") or "")])
            question = None
    if len(pairs) > 1 and "history" not in columns:
        raise DatasetError(f"dataset '{name}' (alpaca) has no history column: a conversation of {len(pairs)} turns "
                           "cannot be saved in it; pick a sharegpt or openai dataset, or a new one")
    if system and "system" not in columns:
        raise DatasetError(f"dataset '{name}' has no system column: clear the system prompt or pick another dataset")
    row = {columns["prompt"]: pairs[-1][0], columns["query"]: "", columns["response"]: pairs[-1][1]}
    if "history" in columns:
        row[columns["history"]] = pairs[:-1]
    if system:
        row[columns["system"]] = system
    return row


def save_row(dataset_dir, name: str, messages: list[dict], tools: str = "") -> SavedRow:
    """Append the conversation as one training row of dataset `name` (created and registered when new)."""
    name = (name or "").strip()
    if not NAME_RE.match(name):
        raise DatasetError(f"dataset name {name!r}: use letters, digits, '_', '-' or '.', starting with a letter "
                           "or digit")
    folder = resolve_dataset_dir(dataset_dir)
    system, turns = _turns(messages)
    info = read_dataset_info(folder)
    created = name not in info.entries and name not in info.problems
    if created:
        check_new_entry(folder, name)  # before the file is written: dataset_info.json must take the name
        entry = new_entry(f"{name}.jsonl")
        path = folder / entry["file_name"]
        if path.exists():
            raise DatasetError(f"{path} exists but is not registered: register it in the Data tab or pick another name")
    else:  # a registered dataset: one local .json / .jsonl file, or the line that says why not
        entry, path = local_file(folder, name)
    if entry.get("ranking"):
        raise DatasetError(f"dataset '{name}' is a ranking dataset: a chat row has one answer, no rejected one; "
                           "pick another dataset or a new one")
    build = _alpaca_row if entry.get("formatting", "alpaca") == "alpaca" else _conversation_row
    row = build(name, entry, system, turns, tools or "")
    rows = read_rows(path, name)
    rows.append(row)
    write_rows(path, rows)
    if created:
        write_entry(folder, name, entry)
    return SavedRow(path, len(rows) - 1, created)
