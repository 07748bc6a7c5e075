"""Datasets: `dataset_info.json` (LLaMA-Factory's schema) + files -> normalized examples.

A normalized example is the one format the templates understand (the templates' input; ARCHITECTURE.md lists the contracts):
    {"messages": [{"role", "content", "tool_calls"?}, ...], "tools", "chosen", "rejected", "kto_tag",
     "_row", "_source"}
and, for pre-training (stage pt), {"text", "_row", "_source"}.

Why this module is strict about some things and lenient about others:
- Schema mistakes in dataset_info.json (an unknown key, a wrong formatting value, a missing file_name, a
  name registered twice) are errors naming the dataset and the key when that dataset is used: a typo there
  would otherwise silently fall back to a default column and train on the wrong thing. The other entries
  of the file stay usable.
- A number where text is expected refuses the row (named in the report), never a silent str(): JSON
  numbers do not survive as written (42 next to 1e23 is read back as 42.0).
- A bad *row* (missing column, empty response, a conversation that does not alternate) is skipped and
  counted in a DataReport, with the first few row numbers and reasons, so one broken row in ten
  thousand does not stop a run. A dataset where every row is bad is an error: never a silent empty
  dataset.
- Row numbers are 0-based, like `_row`: the index in a JSON list, the non-blank line of a JSONL file, the data
  row of a CSV file, counted on across a folder's files in order (as a streamed dataset counts them). The lint's
  findings, the data report, the preview (`tuneboard preview --index`, the Data tab's Row field) and the row
  editor all use this one numbering, so a row named anywhere can be opened by its number (dataset_row).
- Text files may start with a UTF-8 byte order mark (Excel writes one): it is not part of the first column's name.

Files are read with the `datasets` library (json, jsonl, csv, parquet, arrow, txt); its cache goes to
backend.core.paths.cache_dir()/"datasets", never next to the data.
"""
from __future__ import annotations

import codecs
import csv
import json
import logging
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import datasets

from backend.core import paths
from backend.core.dataset_info import (ALPACA_ONLY_COLUMNS, COLUMN_KEYS, CONVERSATION_ONLY_COLUMNS,  # noqa: F401
                                  ENTRY_KEYS, FILE_TYPES, FORMATTINGS, HUB_KEYS, MEDIA_COLUMNS, TAG_KEYS, DatasetError,
                                  DEFAULT_TAGS, DatasetInfo, check_new_entry, entry_columns, entry_problems,
                                  entry_tags, load_dataset_info,
                                  read_dataset_info, resolve_dataset_dir, write_entry)
from backend.core.hub_data import hub_key
from backend.dataprep.hub import hub_source, read_hub_rows
from backend.stages import STAGE_IDS, get_stage, stages_with_data
from backend.dataprep.templates import tool_arguments

# datasets' file builders log "Failed to load JSON from file ..." before raising; read_rows says it in its own
# DatasetError (naming the file and the row), so the log line was a second, rawer copy in every command's output
logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)


# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------
MAX_REASONS = 5  # skipped rows kept (per dataset) for the report


class RowError(ValueError):
    """One row is unusable; it is skipped and counted (the message is the reason shown)."""


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
class SkippedRow(NamedTuple):
    dataset: str
    row: int
    reason: str


@dataclass
class DatasetCounts:
    """What happened to one dataset: rows in its files, rows used, kept and skipped."""
    name: str
    files: list[str]
    formatting: str
    total: int = 0          # rows in the file(s)
    used: int = 0           # after num_samples / max_samples
    kept: int = 0
    skipped: int = 0
    first_skipped: list[SkippedRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. "first 10 used (max_samples)"


@dataclass
class DataReport:
    datasets: list[DatasetCounts] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. how several datasets were mixed

    @property
    def kept(self) -> int:
        return sum(d.kept for d in self.datasets)

    @property
    def skipped(self) -> int:
        return sum(d.skipped for d in self.datasets)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.datasets)

    @property
    def skipped_rows(self) -> list[SkippedRow]:
        """The first few skipped rows of every dataset, as (dataset, row, reason)."""
        return [s for d in self.datasets for s in d.first_skipped]

    def counts(self, name: str) -> DatasetCounts:
        for d in self.datasets:
            if d.name == name:
                return d
        raise KeyError(name)

    def summary_lines(self) -> list[str]:
        lines = []
        for d in self.datasets:
            files = ", ".join(d.files)
            head = f"dataset {d.name} ({d.formatting}, {files}): {d.total} rows"
            if d.notes:
                head += ", " + ", ".join(d.notes)
            head += f", {d.kept} kept"
            if d.skipped:
                head += f", {d.skipped} skipped (row numbers from 0)"
            lines.append(head)
            for s in d.first_skipped:
                lines.append(f"  skipped row {s.row}: {s.reason}")
            if d.skipped > len(d.first_skipped):
                lines.append(f"  ... and {d.skipped - len(d.first_skipped)} more skipped rows")
        if len(self.datasets) > 1:
            lines.append(f"datasets total: {self.kept} examples kept, {self.skipped} rows skipped")
        return lines + self.notes


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------
def _data_files(name: str, entry: dict, dataset_dir: Path, info_path: Path) -> list[Path]:
    hub = [k for k in HUB_KEYS if k in entry]
    if "file_name" not in entry:
        raise DatasetError(f"dataset '{name}' in {info_path} has no local file ({hub[0]}: {entry[hub[0]]}); "
                           f"streaming and tuneboard lint read local files only: download the data and register it with "
                           f"'file_name'")
    path = Path(entry["file_name"]).expanduser()
    if not path.is_absolute():
        path = dataset_dir / path
    if not path.exists():
        raise DatasetError(f"dataset '{name}': file not found: {path} (file_name in {info_path})")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        usable = [p for p in files if p.suffix.lower() in FILE_TYPES]
        if not usable:
            raise DatasetError(f"dataset '{name}': folder {path} has no data files "
                               f"({', '.join(FILE_TYPES)})")
        return usable
    if path.suffix.lower() not in FILE_TYPES:
        raise DatasetError(f"dataset '{name}': {path}: unsupported file type '{path.suffix}' "
                           f"(supported: {', '.join(FILE_TYPES)})")
    return [path]


def _json_location(path: Path) -> str | None:
    """Where a JSON/JSONL file is malformed, for an error message that names the line, or its first row that is
    not an object (valid JSON that pyarrow cannot make rows of: its own message names row 0 of a column)."""
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    rows: list = []
    if path.suffix.lower() == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"line {lineno}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    return f"not valid JSON at line {lineno} column {exc.colno}: {exc.msg}"
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        rows = [(f"row {i}", row) for i, row in enumerate(data)] if isinstance(data, list) else []
    for where, row in rows:
        if not isinstance(row, dict):
            kind = {"str": "a string", "list": "a list", "NoneType": "null", "bool": "true or false"}.get(type(row).__name__, "a number")
            return f"{where} is {kind}, not an object (each row of a data file is a JSON object)"
    return None


def _is_blank(path: Path) -> bool:
    """A text data file with nothing in it (empty, blank lines, or an empty JSON list): no rows."""
    if path.stat().st_size > 65536:
        return False
    text = path.read_bytes().removeprefix(codecs.BOM_UTF8).strip()
    return not text or (path.suffix.lower() == ".json" and text.replace(b" ", b"").replace(b"\n", b"") == b"[]")


def read_rows(path: Path, split: str = "train") -> list[dict]:
    """All rows of one data file, through `datasets` (its cache under cache_dir()/datasets)."""
    builder = FILE_TYPES[path.suffix.lower()]
    if builder in ("json", "csv", "text") and _is_blank(path):
        return []  # `datasets` fails on these with StopIteration or "corresponds to no data"
    kwargs: dict[str, Any] = {}
    if builder == "csv":
        # Read every CSV cell as text: otherwise a column of numbers becomes int64 ("007" -> 7). utf-8-sig: a byte
        # order mark (Excel's "CSV UTF-8") is not part of the first column's name, here nor in pandas' reading.
        kwargs["encoding"] = "utf-8-sig"
        with path.open(encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f), [])
        if header:
            kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in header})
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=[str(path)], split=split,
                                   cache_dir=str(paths.cache_dir() / "datasets"), **kwargs)
    except Exception as exc:  # datasets wraps parser errors in several exception types
        if builder in ("json", "csv", "text"):
            try:
                path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as bad:
                raise DatasetError(f"{path}: not UTF-8 text (byte {bad.start}: {bad.reason}); save it as UTF-8") from None
        where = _json_location(path) if builder == "json" else None
        if where:
            raise DatasetError(f"{path}: {where}") from None
        cause = exc.__cause__ or exc
        raise DatasetError(f"could not read {path}: {type(cause).__name__}: {cause}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    try:
        return ds.to_list()
    except Exception as exc:  # pyarrow cannot return some nested objects as rows ("duplicate field names": '', '\x00')
        raise DatasetError(f"could not read {path}: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Row conversion
# ---------------------------------------------------------------------------------------------
def _not_text(where: str, value: Any) -> RowError:
    """A number (or other non-text) where text is expected: the row is refused, not stringified. A JSON
    number does not survive as written (a column with 42 and 1e23 is read as floats: 42 would train as
    '42.0'), and LLaMA-Factory fails on such rows too. CSV cells are always read as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return RowError(f"{where} must be text, got the number {value!r} (write it as a JSON string, in quotes)")
    return RowError(f"{where} must be text, got {type(value).__name__}")


def _text(row: dict, column: str, what: str = "", *, required: bool = True) -> str:
    """A text cell; None is 'missing'; a number or anything else that is not text refuses the row."""
    value = row.get(column)
    if value is None:
        if required:
            raise RowError(f"column '{column}' missing")
        return ""
    if not isinstance(value, str):
        raise _not_text(f"column '{column}'", value)
    return value


def _maybe_json(value: Any, column: str) -> Any:
    """Some columns hold structures either directly or as a JSON string (CSV, glaive-style tools)."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"column '{column}' is not valid JSON ({exc.msg} at column {exc.colno})") from None
    return value


def _parse_tools(value: Any, column: str) -> list[dict] | None:
    tools = _maybe_json(value, column)
    if tools is None or tools == []:
        return None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise RowError(f"column '{column}' must be a list of function schemas, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
            tool = tool["function"]  # OpenAI's {"type": "function", "function": {...}} wrapper
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RowError(f"column '{column}': tool {i} needs a 'name'")
        out.append(tool)
    return out


def _parse_arguments(args: Any, where: str) -> dict:
    try:
        return tool_arguments(args, where)
    except ValueError as exc:
        raise RowError(str(exc)) from None


def _parse_calls(value: Any, where: str) -> list[dict]:
    """Function calls from a ShareGPT function_call value or an OpenAI tool_calls list ->
    [{"name", "arguments": dict}]."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"{where}: function call is not valid JSON ({exc.msg} at column {exc.colno})") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise RowError(f"{where}: empty function call")
    out = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = call["function"]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise RowError(f"{where}: a function call needs a 'name'")
        out.append({"name": call["name"], "arguments": _parse_arguments(call.get("arguments"), where)})
    return out


@dataclass
class _Spec:
    """One entry with its defaults applied."""
    name: str
    formatting: str
    ranking: bool
    columns: dict
    tags: dict
    declared: set  # columns the entry names explicitly (those must exist in the file)


def _entry_spec(name: str, entry: dict) -> _Spec:
    formatting = entry.get("formatting", "alpaca")
    return _Spec(name, formatting, bool(entry.get("ranking")), entry_columns(entry), entry_tags(entry),
                 set(entry.get("columns", {})))


def _conversation(items: Any, spec: _Spec, stage: str) -> tuple[list[dict], str | None]:
    """ShareGPT / OpenAI message list -> (normalized messages without system, system prompt).

    Turns must alternate user and assistant; a function call (ShareGPT function_call, OpenAI
    tool_calls) is answered by observation/tool turns and then the assistant again. Turn numbers in
    the reasons are 0-based positions in the row's list."""
    col = spec.columns["messages"]
    items = _maybe_json(items, col)
    if items is None:
        raise RowError(f"column '{col}' missing")
    if not isinstance(items, list):
        raise RowError(f"column '{col}' must be a list of messages, got {type(items).__name__}")
    t = spec.tags
    role_key, content_key = t["role_tag"], t["content_tag"]
    kinds = {t["user_tag"]: "user", t["assistant_tag"]: "assistant", t["observation_tag"]: "tool",
             t["function_tag"]: "call", t["system_tag"]: "system"}
    system = None
    messages: list[dict] = []
    prev_kind, prev_role = "start", None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RowError(f"turn {i} is not an object with '{role_key}' and '{content_key}'")
        role = item.get(role_key)
        if not isinstance(role, str) or role not in kinds:
            raise RowError(f"turn {i}: unknown role {role!r} in '{role_key}' (expected one of {', '.join(map(repr, kinds))})")
        kind = kinds[role]
        content = item.get(content_key)
        calls = None
        if kind == "assistant" and spec.formatting == "openai" and item.get("tool_calls"):
            calls = _parse_calls(item["tool_calls"], f"turn {i}")
            kind = "call"
        elif kind == "call":
            calls = _parse_calls(content, f"turn {i}")
            content = ""
        if content is None and kind == "call":
            content = ""
        if not isinstance(content, str):
            raise _not_text(f"turn {i}: '{content_key}'", content)
        if kind == "system":
            if i != 0:
                raise RowError(f"turn {i}: a '{role}' turn is only allowed first")
            system = content
            continue
        _check_order(prev_kind, prev_role, kind, role, i, spec)
        if kind != "call" and not content.strip():
            raise RowError(f"empty {'response' if kind == 'assistant' else repr(role) + ' turn'} at turn {i}")
        if kind == "call":
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        else:
            messages.append({"role": kind, "content": content})
        prev_kind, prev_role = kind, role
    if not messages:
        raise RowError("conversation is empty")
    last = len(items) - 1
    if _kind(stage) == "ranking":
        if prev_kind not in ("user", "tool"):
            raise RowError(f"a ranking row's conversation must end with a '{t['user_tag']}' turn "
                           f"(the answers are in chosen/rejected), it ends with {prev_role!r} at turn {last}")
    elif prev_kind not in ("assistant", "call") and not (_kind(stage) == "prompts" and prev_kind in ("user", "tool")):
        raise RowError(f"conversation must end with a '{t['assistant_tag']}' turn, "
                       f"it ends with {prev_role!r} at turn {last}")
    return messages, system


def _check_order(prev: str, prev_role: str | None, kind: str, role: str, i: int, spec: _Spec) -> None:
    allowed = {
        "start": ("user",),
        "user": ("assistant", "call"),
        "assistant": ("user",),
        "call": ("tool",),
        "tool": ("assistant", "call", "tool") if spec.formatting == "openai" else ("assistant", "call"),
    }[prev]
    if kind in allowed:
        return
    if prev == "start":
        raise RowError(f"conversation must start with a '{spec.tags['user_tag']}' turn, got {role!r} at turn {i}")
    if prev == "call":
        raise RowError(f"a function call must be followed by its result ('{spec.tags['observation_tag']}'), "
                       f"got {role!r} at turn {i}")
    if kind == "tool":
        raise RowError(f"an {role!r} turn must follow a function call, got it after {prev_role!r} at turn {i}")
    if role == prev_role:
        raise RowError(f"conversation must alternate user/assistant, got two {role!r} turns at turn {i}")
    raise RowError(f"conversation must alternate user/assistant, got {role!r} after {prev_role!r} at turn {i}")


def _answer(value: Any, column: str, spec: _Spec) -> dict:
    """A chosen/rejected answer: plain text (alpaca) or one message object (sharegpt/openai)."""
    if isinstance(value, str) and spec.formatting != "alpaca" and value.lstrip().startswith("{"):
        try:  # a message object stored as a JSON string (CSV/parquet); plain text stays text
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and spec.tags["content_tag"] in parsed:
            value = parsed
    if value is None:
        raise RowError(f"column '{column}' missing")
    if isinstance(value, dict) and spec.formatting != "alpaca":
        role, content = value.get(spec.tags["role_tag"]), value.get(spec.tags["content_tag"])
        if role == spec.tags["function_tag"]:
            return {"role": "assistant", "content": "", "tool_calls": _parse_calls(content, f"column '{column}'")}
        if role not in (spec.tags["assistant_tag"], None):
            raise RowError(f"column '{column}': the answer's role must be '{spec.tags['assistant_tag']}', got {role!r}")
        value = content
    if not isinstance(value, str):
        raise _not_text(f"column '{column}'", value)
    if not value.strip():
        raise RowError(f"empty answer in column '{column}'")
    return {"role": "assistant", "content": value}


def _kto_tag(value: Any, column: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if value is None:
        raise RowError(f"column '{column}' missing")
    raise RowError(f"column '{column}' (kto_tag) must be true or false, got {value!r}")


def _alpaca_messages(row: dict, spec: _Spec) -> list[dict]:
    c = spec.columns
    prompt = _text(row, c["prompt"])
    query = _text(row, c["query"], required=False) if c.get("query") else ""
    user = "\n".join(p for p in (prompt, query) if p)
    if not user.strip():
        raise RowError(f"empty prompt (columns '{c['prompt']}' and '{c.get('query')}')")
    messages = []
    if c.get("history"):
        history = _maybe_json(row.get(c["history"]), c["history"]) or []
        if not isinstance(history, list):
            raise RowError(f"column '{c['history']}' must be a list of [query, response] pairs")
        for i, pair in enumerate(history):
            if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                    or not all(isinstance(x, str) and x.strip() for x in pair)):
                raise RowError(f"column '{c['history']}': item {i} is not a [query, response] pair of non-empty texts")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    messages.append({"role": "user", "content": user})
    return messages


def convert_row(row: dict, spec: _Spec, stage: str) -> dict:
    """One raw row -> a normalized example (without _row/_source). Raises RowError with the reason."""
    c = spec.columns
    if _kind(stage) == "text":
        if spec.formatting == "alpaca":
            if c.get("text"):
                parts = [_text(row, c["text"])]
            else:
                parts = [_text(row, c["prompt"])]
                parts += [_text(row, c[k], required=False) for k in ("query", "response") if c.get(k) in row]
            text = "\n".join(p for p in parts if p)
        else:
            messages, system = _conversation(row.get(c["messages"]), spec, "sft")
            text = "\n".join(m["content"] for m in messages if m["content"])
        if not text.strip():
            raise RowError("empty text")
        return {"text": text}

    if spec.formatting == "alpaca":
        messages = _alpaca_messages(row, spec)
        system = _text(row, c["system"], required=False) if c.get("system") else ""
        if not spec.ranking:
            # a prompts stage (grpo) takes rows without an answer too: the answer is only its reward's reference
            prompts_only = _kind(stage) == "prompts"
            response = _text(row, c["response"], required=not prompts_only)
            if response.strip():
                messages.append({"role": "assistant", "content": response})
            elif not prompts_only:
                raise RowError(f"empty response (column '{c['response']}')")
    else:
        messages, system = _conversation(row.get(c["messages"]), spec, "dpo" if spec.ranking else stage)
        if system is None:
            system = _text(row, c["system"], required=False) if c.get("system") else ""
    if system:
        messages.insert(0, {"role": "system", "content": system})
    example = {"messages": messages,
               "tools": _parse_tools(row.get(c["tools"]), c["tools"]) if c.get("tools") else None,
               "chosen": None, "rejected": None, "kto_tag": None}
    if spec.ranking:
        example["chosen"] = _answer(row.get(c["chosen"]), c["chosen"], spec)
        example["rejected"] = _answer(row.get(c["rejected"]), c["rejected"], spec)
        if example["chosen"] == example["rejected"]:
            raise RowError("chosen and rejected answers are identical")
    if c.get("kto_tag"):
        try:
            example["kto_tag"] = _kto_tag(row.get(c["kto_tag"]), c["kto_tag"])
        except RowError:
            if _kind(stage) == "kto":
                raise
    return example


def _fill_identity(example: dict, name: str, author: str) -> dict:
    """Replace {{name}} / {{author}} in every text of the example (the identity dataset uses them,
    and any user dataset may)."""
    def fill(s: str) -> str:
        return s.replace("{{name}}", name).replace("{{author}}", author) if "{{" in s else s

    if "text" in example:
        example["text"] = fill(example["text"])
        return example
    for m in example["messages"]:
        m["content"] = fill(m["content"])
    for key in ("chosen", "rejected"):
        if example.get(key):
            example[key]["content"] = fill(example[key]["content"])
    return example


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _kind(stage: str) -> str:
    """The dataset kind a stage takes (backend.stages declares it)."""
    return get_stage(stage).data


def _check_stage(name: str, spec: _Spec, stage: str) -> None:
    if _kind(stage) == "ranking" and not spec.ranking:
        raise DatasetError(f"stage '{stage}' needs a ranking dataset (\"ranking\": true with chosen/rejected "
                           f"columns); dataset '{name}' is not one")
    if _kind(stage) != "ranking" and spec.ranking:
        raise DatasetError(f"dataset '{name}' is a ranking dataset (chosen/rejected pairs): use it with stage "
                           f"{'/'.join(stages_with_data('ranking'))}, not '{stage}'")
    if _kind(stage) == "kto" and "kto_tag" not in spec.columns:
        raise DatasetError(f"stage 'kto' needs a dataset with a 'columns.kto_tag' column (true/false per row); "
                           f"dataset '{name}' has none")
    media = [k for k in MEDIA_COLUMNS if k in spec.columns]
    if media:
        raise DatasetError(f"dataset '{name}': multimodal columns ({', '.join(media)}) are not supported yet")


def _required_columns(spec: _Spec, stage: str) -> list[str]:
    """Column keys that must exist in the file: the ones the entry names, plus what the stage needs."""
    if spec.formatting != "alpaca":
        need = {"messages"}
    elif _kind(stage) == "text":
        need = {"text"} if "text" in spec.columns else {"prompt"}
    else:
        need = {"prompt"} | ({"chosen", "rejected"} if spec.ranking else {"response"})
    if spec.ranking:
        need |= {"chosen", "rejected"}
    if _kind(stage) == "kto":
        need.add("kto_tag")
    return sorted(need | (spec.declared - set(MEDIA_COLUMNS)))


def _entry_rows(name: str, entry: dict, dataset_dir: Path, info_path: Path, spec: _Spec,
                stage: str) -> tuple[list[Path], list[tuple[Path, int, dict]]]:
    """(the entry's files, its rows as (file, row number in that file, row)): the dataset's row k is rows[k], its
    files' rows counted on in order. The columns the stage needs are checked on each file's first row; no row at
    all is an error."""
    hub = hub_key(entry) is not None  # hf_hub_url (a hub id or a hub-style folder), cloud_file_name, ...
    files = [Path(hub_source(entry, dataset_dir))] if hub else _data_files(name, entry, dataset_dir, info_path)
    rows: list[tuple[Path, int, dict]] = []
    for path in files:
        try:
            file_rows = read_hub_rows(name, entry, dataset_dir) if hub else read_rows(path, entry.get("split", "train"))
        except DatasetError as exc:
            raise (exc if hub else DatasetError(f"dataset '{name}': {exc}")) from None
        present = set(file_rows[0]) if file_rows else set()
        if file_rows:
            for key in _required_columns(spec, stage):
                col = spec.columns[key]
                if col not in present and not (_kind(stage) == "text" and key in ("response", "query")):
                    raise DatasetError(f"dataset '{name}': {path} has no column '{col}' (columns.{key}); "
                                       f"its columns are: {', '.join(sorted(present))}")
        rows += [(path, i, r) for i, r in enumerate(file_rows)]
    if not rows:
        raise DatasetError(f"dataset '{name}': {', '.join(map(str, files))} has no rows")
    return files, rows


def _load_entry(name: str, entry: dict, dataset_dir: Path, info_path: Path, *, stage: str,
                max_samples: int | None, seed: int, identity: tuple[str, str]) -> tuple[list[dict], DatasetCounts]:
    spec = _entry_spec(name, entry)
    _check_stage(name, spec, stage)
    files, rows = _entry_rows(name, entry, dataset_dir, info_path, spec, stage)
    many = len(files) > 1
    counts = DatasetCounts(name, [_display(p) for p in files], spec.formatting)
    counts.total = len(rows)

    order = list(range(len(rows)))
    if entry.get("num_samples"):
        # LLaMA-Factory's meaning: draw num_samples rows at random (repeating rows if it exceeds the size)
        rng = random.Random(seed)
        target = entry["num_samples"]
        order = rng.sample(order, min(target, len(order)))
        if target > len(rows):
            order += [rng.randrange(len(rows)) for _ in range(target - len(rows))]
        counts.notes.append(f"{len(order)} sampled (num_samples)")
    if max_samples is not None and max_samples < len(order):
        order = order[:max_samples]
        counts.notes.append(f"first {max_samples} used (max_samples)")
    counts.used = len(order)

    examples = []
    for index in order:
        path, rownum, row = rows[index]
        try:
            example = convert_row(row, spec, stage)
        except RowError as exc:
            counts.skipped += 1
            if len(counts.first_skipped) < MAX_REASONS:
                reason = f"{path.name} row {rownum}: {exc}" if many else str(exc)
                counts.first_skipped.append(SkippedRow(name, index, reason))
            continue
        example = _fill_identity(example, *identity)
        example["_row"], example["_source"] = index, name
        examples.append(example)
    counts.kept = len(examples)
    if not examples:
        reasons = "; ".join(f"row {s.row}: {s.reason}" for s in counts.first_skipped)
        raise DatasetError(f"dataset '{name}': every one of the {counts.used} rows of "
                           f"{', '.join(map(str, files))} is unusable (stage {stage}, {spec.formatting}); "
                           f"first reasons: {reasons}")
    return examples, counts


class SkippedRowError(DatasetError):
    """A row asked for by its number (dataset_row) that training skips; the message says why, `row` is its number."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def dataset_row(name: str, row: int, dataset_dir: str | os.PathLike | None = None, *, stage: str = "sft",
                identity_name: str = "TuneBoard Assistant", identity_author: str = "the TuneBoard team") -> dict:
    """Row `row` of dataset `name`, numbered as `_row` (0-based; a folder's files counted on in order: the numbers
    the lint, the data report and the preview name) -> the example training makes of it, with _row and _source:
    `tuneboard preview --index` and so the Data tab's Row field. Any row of the files can be asked for (num_samples
    draws nothing here). A row training skips is a SkippedRowError saying why; a number past the last row a
    DatasetError naming how many rows there are."""
    dataset_dir = resolve_dataset_dir(dataset_dir)
    entry = read_dataset_info(dataset_dir).entry(name)
    spec = _entry_spec(name, entry)
    _check_stage(name, spec, stage)
    files, rows = _entry_rows(name, entry, dataset_dir, dataset_dir / "dataset_info.json", spec, stage)
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(rows):
        raise DatasetError(f"dataset '{name}': row {row} is out of range: it has {len(rows)} rows "
                           f"(0..{len(rows) - 1})")
    path, rownum, raw = rows[row]
    try:
        example = convert_row(raw, spec, stage)
    except RowError as exc:
        where = f" ({path.name} row {rownum})" if len(files) > 1 else f" of {path.name}"
        raise SkippedRowError(f"dataset '{name}': training skips row {row}{where}: {exc}", row) from None
    example = _fill_identity(example, identity_name, identity_author)
    example["_row"], example["_source"] = row, name
    return example


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(paths.REPO_ROOT))
    except ValueError:
        return str(path)


def _names(names: str | list[str]) -> list[str]:
    items = names.split(",") if isinstance(names, str) else [n for part in names for n in str(part).split(",")]
    out = [n.strip() for n in items if n.strip()]
    if not out:
        raise DatasetError("no dataset given: set `dataset` to one or more names from dataset_info.json, comma separated")
    return out


def load_examples(names: str | list[str], dataset_dir: str | os.PathLike | None = None, *, stage: str = "sft",
                  max_samples: int | None = None, identity_name: str = "TuneBoard Assistant",
                  identity_author: str = "the TuneBoard team", seed: int = 42, default_system: str | None = None,
                  mix_strategy: str = "concat", interleave_probs: str | list | None = None,
                  ) -> tuple[list[dict], "DataReport"]:
    """Load one or more datasets (comma separated names) as normalized examples.

    stage picks the shape by the dataset kind it declares (backend.stages): text -> {"text"}; ranking
    stages need ranking datasets (chosen/rejected); kto needs a kto_tag column. max_samples keeps the first N rows of each dataset. Bad rows are
    skipped and counted in the returned DataReport. Several datasets are concatenated in order, or
    interleaved (mix_strategy, interleave_probs: see mix_datasets). default_system becomes the system message
    of every conversation that has none, as chat and the API do when serving (see add_default_system)."""
    if stage not in STAGE_IDS:
        raise DatasetError(f"unknown stage '{stage}' (expected one of {', '.join(STAGE_IDS)})")
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1):
        raise DatasetError(f"max_samples must be a positive integer, got {max_samples!r}")
    dataset_dir = resolve_dataset_dir(dataset_dir)
    info_path = dataset_dir / "dataset_info.json"
    info = read_dataset_info(dataset_dir)
    report = DataReport()
    parts: list[list[dict]] = []
    for name in _names(names):
        got, counts = _load_entry(name, info.entry(name), dataset_dir, info_path, stage=stage, max_samples=max_samples,
                                  seed=seed, identity=(identity_name, identity_author))
        parts.append(got)
        report.datasets.append(counts)
    examples = mix_datasets(parts, mix_strategy, interleave_probs, seed)
    if mix_strategy != "concat" and len(parts) > 1:
        report.notes.append(f"{mix_strategy}: {len(examples)} examples drawn from {len(parts)} datasets")
    return add_default_system(examples, default_system), report


def add_default_system(examples: list[dict], system: str | None) -> list[dict]:
    """Conversations without a system message get `system` as their first message: the prompt the model is
    trained and evaluated with is then the one chat and the API serve (backend.serving.engine puts the same
    default_system before a conversation that has none). Text rows (stage pt) have no messages: unchanged."""
    if not system:
        return examples
    out = []
    for example in examples:
        messages = example.get("messages")
        if messages is not None and not (messages and messages[0].get("role") == "system"):
            example = {**example, "messages": [{"role": "system", "content": system}] + list(messages)}
        out.append(example)
    return out


MIX_STRATEGIES = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted"}


def mix_datasets(parts: list[list[dict]], strategy: str = "concat", probs: str | list | None = None,
                 seed: int = 42) -> list[dict]:
    """Several datasets' examples -> one list. concat: one after the other. interleave_under / interleave_over:
    datasets.interleave_datasets with stopping_strategy first_exhausted / all_exhausted (LLaMA-Factory's
    meaning): round robin, or with `probs` a seeded random draw of the next dataset; under stops when one
    dataset runs out, over repeats rows of the smaller datasets until every row of each was used. The library
    draws the order (over row indices), so the semantics are exactly its own."""
    if strategy == "concat" or len(parts) < 2:
        return [e for part in parts for e in part]
    if strategy not in MIX_STRATEGIES:
        raise DatasetError(f"mix_strategy must be concat, interleave_under or interleave_over (got {strategy!r})")
    if isinstance(probs, str):
        probs = [float(p) for p in probs.split(",") if p.strip()]
    if probs is not None and len(probs) != len(parts):
        raise DatasetError(f"interleave_probs has {len(probs)} values for {len(parts)} datasets")
    flat = [e for part in parts for e in part]
    starts = [sum(len(p) for p in parts[:k]) for k in range(len(parts))]
    indexed = [datasets.Dataset.from_dict({"i": list(range(start, start + len(part)))})
               for start, part in zip(starts, parts)]
    mixed = datasets.interleave_datasets(indexed, probabilities=list(probs) if probs else None, seed=seed,
                                         stopping_strategy=MIX_STRATEGIES[strategy])
    return [flat[i] for i in mixed["i"]]


def split_train_val(examples: list, val_size: float | int | None, seed: int = 42) -> tuple[list, list]:
    """Hold out a validation set: val_size < 1 is a fraction (rounded up), >= 1 a row count.
    Both parts keep the original order; which rows go to validation depends only on the seed."""
    if not val_size:
        return list(examples), []
    if isinstance(val_size, bool) or val_size < 0:
        raise DatasetError(f"val_size must be a fraction in (0, 1) or a row count >= 1, got {val_size!r}")
    n = len(examples)
    if val_size < 1:
        n_val = math.ceil(val_size * n)
    else:
        if float(val_size) != int(val_size):
            raise DatasetError(f"val_size >= 1 is a number of rows and must be a whole number, got {val_size}")
        n_val = int(val_size)
    if n_val >= n:
        raise DatasetError(f"val_size {val_size} takes {n_val} of the {n} rows for validation and leaves "
                           f"no training rows")
    chosen = set(random.Random(seed).sample(range(n), n_val))
    train = [e for i, e in enumerate(examples) if i not in chosen]
    val = [e for i, e in enumerate(examples) if i in chosen]
    return train, val


# ---------------------------------------------------------------------------------------------
# Registering a dataset (the web UI's Register form)
# ---------------------------------------------------------------------------------------------
def _validation_stages(entry: dict) -> list[str]:
    if entry.get("ranking"):
        return ["dpo"]
    if "kto_tag" in (entry.get("columns") or {}):
        return ["kto"]
    columns = entry.get("columns") or {}
    if entry.get("formatting", "alpaca") == "alpaca" and ("prompt" in columns or "text" in columns) \
            and not {"response", "query", "history"} & set(columns):
        return ["sft", "pt"]  # a raw-text corpus ({"prompt": "text"}) is a valid alpaca entry too
    return ["sft"]


def register_dataset(dataset_dir: str | os.PathLike | None, name: str, entry: dict,
                     overwrite: bool = False) -> DataReport:
    """Add `entry` as `name` to <dataset_dir>/dataset_info.json, after checking that the entry is
    valid and that its file loads with at least one good row. The file is replaced atomically
    (dataset_info.write_entry, the one writer), so a failure leaves the old one untouched. Returns the check's report."""
    if not isinstance(name, str) or not name.strip() or name != name.strip() or "," in name:
        raise DatasetError(f"dataset name {name!r} must be non-empty, without surrounding spaces or commas "
                           f"(commas separate dataset names)")
    problems = entry_problems(name, entry)
    if problems:
        raise DatasetError("; ".join(problems))
    dataset_dir = resolve_dataset_dir(dataset_dir)
    if not dataset_dir.is_dir():
        raise DatasetError(f"dataset_dir {dataset_dir} does not exist")
    info_path = dataset_dir / "dataset_info.json"
    check_new_entry(dataset_dir, name, overwrite)  # refused before the (slow) load check
    report = DataReport()
    first_error = None
    for stage in _validation_stages(entry):
        try:
            _, counts = _load_entry(name, entry, dataset_dir, info_path, stage=stage, max_samples=None, seed=42,
                                    identity=("{{name}}", "{{author}}"))
            report.datasets.append(counts)
            break
        except DatasetError as exc:
            first_error = first_error or exc
    else:
        raise first_error
    write_entry(dataset_dir, name, entry, overwrite)
    return report




def example_from_row(name: str, row: Any, dataset_dir: str | os.PathLike | None = None, *, stage: str = "sft",
                     identity_name: str = "TuneBoard Assistant", identity_author: str = "the TuneBoard team") -> dict:
    """One raw row in dataset `name`'s own format (its entry's formatting, columns and tags) -> the example training
    would make of it, as load_examples makes each file row (the Data tab's row editor renders an edited row with it).
    A row training would skip is a DatasetError naming the dataset and the reason."""
    info = read_dataset_info(resolve_dataset_dir(dataset_dir))
    spec = _entry_spec(name, info.entry(name))
    _check_stage(name, spec, stage)
    if not isinstance(row, dict):
        raise DatasetError(f"dataset '{name}': a row is a JSON object, got {type(row).__name__}")
    try:
        example = convert_row(row, spec, stage)
    except RowError as exc:
        raise DatasetError(f"dataset '{name}': this row would be skipped: {exc}") from None
    return _fill_identity(example, identity_name, identity_author)
