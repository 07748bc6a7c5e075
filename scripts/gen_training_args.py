"""Record the installed `transformers.TrainingArguments` fields as JSON for backend/core/spec.py.

Why: like LLaMA-Factory, a TuneBoard spec accepts every TrainingArguments key (typed, passed through),
but backend/core/spec.py is imported by the web UI and must not import transformers. So the field table is
generated here, committed as backend/core/hf_training_args.json, and kept honest by
tests/backend/test_spec_training_args.py, which fails when the JSON no longer matches the installed
transformers.

Usage:  .venv/bin/python scripts/gen_training_args.py          (rewrites the JSON)
        .venv/bin/python scripts/gen_training_args.py --check  (exit 1 if it is out of date)
"""
from __future__ import annotations

import dataclasses
import enum
import json
import sys
import types
import typing
from pathlib import Path

OUT_PATH = Path(__file__).resolve().parents[1] / "backend" / "core" / "hf_training_args.json"

_BASIC = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}


def _describe(tp) -> tuple[str, bool, list | None]:
    """(type name, nullable, choices) for one annotation. Unions other than `X | None` and
    `Enum | str` have no single JSON type and become "any" (passed through unchecked)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = list(typing.get_args(tp))
        nullable = type(None) in args
        rest = [a for a in args if a is not type(None)]
        enums = [a for a in rest if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums and all(a is str or a in enums for a in rest):
            return "str", nullable, [e.value for e in enums[0]]
        if len(rest) == 1:
            name, _, choices = _describe(rest[0])
            return name, nullable, choices
        return "any", nullable, None
    if origin is typing.Literal:
        return "any", False, None
    if origin is not None:  # list[str], dict[str, Any]
        return _BASIC.get(origin, "any"), False, None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "str", False, [e.value for e in tp]
    return _BASIC.get(tp, "any"), False, None


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.value
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value


def build() -> dict:
    """The JSON document for the installed transformers."""
    import transformers
    from transformers import TrainingArguments

    try:
        hints = typing.get_type_hints(TrainingArguments)
    except Exception:  # an annotation that cannot be resolved: fall back to raw field types
        hints = {}
    fields = {}
    for f in dataclasses.fields(TrainingArguments):
        if not f.init or f.name.startswith("_"):
            continue
        tp = hints.get(f.name, f.type)
        type_name, nullable, choices = _describe(tp)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        default = _jsonable(default)
        help_text = (f.metadata.get("help") or "").strip().splitlines()
        entry = {
            "type": type_name,
            "nullable": nullable or default is None,
            "default": default,
            "help": help_text[0].strip() if help_text else "",
        }
        if choices:
            entry["choices"] = choices
        fields[f.name] = entry
    return {"transformers_version": transformers.__version__, "fields": fields}


def render(doc: dict) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    doc = build()
    if "--check" in argv:
        current = json.loads(OUT_PATH.read_text()) if OUT_PATH.exists() else {}
        if current.get("fields") != doc["fields"]:
            print(f"{OUT_PATH} is out of date: run scripts/gen_training_args.py", file=sys.stderr)
            return 1
        print("up to date")
        return 0
    OUT_PATH.write_text(render(doc))
    print(f"wrote {OUT_PATH} ({len(doc['fields'])} fields, transformers {doc['transformers_version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
