"""Reward functions for the online RL stages (grpo, rloo): the built-in ones, a user's own `module:function`, and
reward models.

Light (no torch): `tuneboard validate` and the web UI read BUILTINS. Every reward function has TRL's
GRPOTrainer signature: `f(prompts, completions, **kwargs) -> list[float | None]`, one number per completion
(None = "does not apply to this row": TRL ignores it in the means). The keyword arguments a function can read:
- `completion_ids`: the completions' token ids,
- `reference`: each row's reference answer (the dataset's last assistant turn; None where the row has none),
- `schema`: the JSON Schema given by `reward_schema` (None when unset),
- `trainer_state`, `log_extra`, `log_metric`: TRL's (see its GRPOTrainer docs).
- `conversation`: each row's prompt turns as JSON ({"messages": [...], "tools": ...}: what a reward model renders
  with its own template).
Every built-in returns a score in [0, 1] (1 = best), so `reward_weights` weigh like against like.

A reward model is a folder in the list: `reward_funcs: json_valid,saves/rm-run` (the output_dir of a stage rm
run, LoRA or full, or a sequence-classification model folder with one label and its tokenizer): it scores each
completion with its score head (any real number), logged as rewards/<folder name>/mean.

A user's function is one file and one spec line: `reward_funcs: json_valid,my_rewards.py:brevity` (a file
path, relative to where the command runs) or `my_package.rewards:brevity` (an importable module). One that
raises, or returns anything but one number (or None) per completion, ends the run with a message naming it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from backend.core.metrics import field_counts, parse_json

DEFAULT_FORMAT_REGEX = r"\s*\{.*\}\s*"  # format_regex without reward_regex: one JSON object, nothing around it


class RewardError(ValueError):
    """A reward function that cannot be loaded or misbehaves: one line naming it."""


# -- the built-in reward functions ----------------------------------------------------------------

def json_valid(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion parses as JSON (a ```json fence around it is allowed), else 0.0."""
    return [float(parse_json(c)[0]) for c in completions]


def schema_score(completion: str, schema: dict) -> float:
    """How well one completion satisfies a JSON Schema, in [0, 1]: 1.0 when it validates; 0.0 when it is not
    JSON; otherwise partial credit: 0.9 x the share of the schema's required fields that are present and
    valid against their own property schema (so a near miss still beats garbage, and only a fully valid
    answer gets 1.0). Without required fields an invalid answer scores 0.0."""
    from jsonschema import Draft202012Validator  # heavy: loaded on use, so importing this module stays light

    ok, value = parse_json(completion)
    if not ok:
        return 0.0
    validator = Draft202012Validator(schema)
    if validator.is_valid(value):
        return 1.0
    required = schema.get("required") or []
    if not required or not isinstance(value, dict):
        return 0.0
    properties = schema.get("properties") or {}
    good = sum(1 for key in required
               if key in value and Draft202012Validator(properties.get(key, {})).is_valid(value[key]))
    return 0.9 * good / len(required)


def schema_from_reference(reference: str | None) -> dict | None:
    """A row's own schema when none is given: the reference answer's top-level keys are required, each with
    the JSON type of its reference value (an integer reference accepts any number). None if the reference
    is not a JSON object."""
    ok, value = parse_json(reference) if reference else (False, None)
    if not ok or not isinstance(value, dict):
        return None

    def json_type(v: Any) -> str | list[str]:
        if isinstance(v, bool):
            return "boolean"
        if isinstance(v, (int, float)):
            return "number"
        if v is None:
            return "null"
        return {str: "string", list: "array", dict: "object"}[type(v)]

    return {"type": "object", "required": list(value),
            "properties": {k: {"type": json_type(v)} for k, v in value.items()}}


def json_schema(prompts, completions, reference=None, schema=None, **kwargs) -> list[float | None]:
    """Partial-credit JSON Schema validation (schema_score). The schema is `reward_schema` when the spec
    gives one, else each row's own, inferred from its reference answer (schema_from_reference); a row with
    neither scores None (not counted)."""
    references = reference or [None] * len(completions)
    schemas = schema or [None] * len(completions)
    out: list[float | None] = []
    for completion, ref, given in zip(completions, references, schemas):
        row_schema = (json.loads(given) if isinstance(given, str) else given) or schema_from_reference(ref)
        out.append(None if row_schema is None else schema_score(completion, row_schema))
    return out


def field_f1(prompts, completions, reference=None, **kwargs) -> list[float | None]:
    """Field-level F1 against the row's reference answer, in [0, 1]: the JSON leaves and empty containers
    (by path, e.g. ("colors", 0)) that equal the reference's (strings compared case-insensitively) over predicted and expected
    leaves (backend.core.metrics.field_counts, as `tuneboard eval` counts them). None where the reference is not
    JSON."""
    out: list[float | None] = []
    for completion, ref in zip(completions, reference or [None] * len(completions)):
        counts = field_counts(completion, ref) if ref else None
        if counts is None:
            out.append(None)
            continue
        p = counts["matched"] / counts["predicted"] if counts["predicted"] else 0.0
        r = counts["matched"] / counts["expected"] if counts["expected"] else 0.0
        out.append(2 * p * r / (p + r) if p + r else 0.0)
    return out


def exact_match(prompts, completions, reference=None, **kwargs) -> list[float | None]:
    """1.0 when the completion equals the reference answer (surrounding whitespace ignored), else 0.0;
    None where the row has no reference."""
    refs = reference or [None] * len(completions)
    return [None if ref is None else float(c.strip() == ref.strip()) for c, ref in zip(completions, refs)]


def length_penalty(prompts, completions, reference=None, completion_ids=None, *, max_completion_length: int = 256,
                   **kwargs) -> list[float]:
    """Length in [0, 1]: with a reference answer, 1 - |len(completion) - len(reference)| / len(reference) in
    characters (floored at 0: as long as the reference is best); without one, 1 - tokens / max_completion_length
    (shorter is better; a completion cut at the limit scores 0)."""
    refs = reference or [None] * len(completions)
    ids = completion_ids or [None] * len(completions)
    out = []
    for completion, ref, tokens in zip(completions, refs, ids):
        if ref:
            out.append(max(0.0, 1.0 - abs(len(completion) - len(ref)) / len(ref)))
        else:
            n = len(tokens) if tokens is not None else len(completion)
            out.append(max(0.0, 1.0 - n / max_completion_length))
    return out


def format_regex(prompts, completions, *, pattern: str = DEFAULT_FORMAT_REGEX, **kwargs) -> list[float]:
    """1.0 when the whole completion matches the regular expression `reward_regex` (Python syntax, `.` also
    matches newlines; default: one JSON object and nothing around it), else 0.0."""
    compiled = re.compile(pattern, re.S)
    return [float(compiled.fullmatch(c) is not None) for c in completions]


BUILTINS: dict[str, Callable] = {f.__name__: f for f in (json_valid, json_schema, field_f1, exact_match,
                                                          length_penalty, format_regex)}


def load_schema(value: str) -> dict:
    """reward_schema -> the JSON Schema: a .json file, or the schema written inline as JSON. ValueError says
    what is wrong (no file, not JSON, not a valid schema)."""
    from jsonschema import Draft202012Validator  # heavy: loaded on use, so importing this module stays light
    from jsonschema.exceptions import SchemaError  # heavy: loaded on use, so importing this module stays light

    text = str(value).strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"{text} is neither inline JSON nor a file")
        text = path.read_text(encoding="utf-8")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON Schema is an object ({...})")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
    return schema


# -- names -> functions -----------------------------------------------------------------------------

def split_names(value) -> list[str]:
    """reward_funcs as a list: a YAML list or a comma-separated string."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


def is_model_name(name: str) -> bool:
    """Whether a reward_funcs entry names a folder (a reward model) rather than a function: a path without ':'."""
    return name not in BUILTINS and ":" not in name and (
        name.startswith((".", "~")) or "/" in name or "\\" in name or Path(name).expanduser().is_dir())


def metric_name(name: str) -> str:
    """The name TRL logs a reward under (rewards/<name>/mean): a function's own name, a reward model's folder name."""
    if is_model_name(name):
        return Path(name.rstrip("/\\")).name or name
    return name.rpartition(":")[2]


def name_problem(name: str, *, check_files: bool = True) -> str | None:
    """Why a reward_funcs entry cannot be a reward function, or None (import happens at run time; whether a
    folder holds a reward model is validate's check, backend.core.rundir.is_reward_model_dir)."""
    if name in BUILTINS:
        return None
    if is_model_name(name):
        if check_files and not Path(name).expanduser().is_dir():
            return (f"{name} is not a folder (a reward model is the output_dir of a stage rm run, or a "
                    "sequence-classification model folder)")
        return None
    if ":" not in name:
        return (f"{name!r} is not a built-in reward ({', '.join(BUILTINS)}), a 'module:function' or "
                "'path/to/file.py:function' reference, nor a reward model folder")
    where, _, func = name.rpartition(":")
    if not func.isidentifier() or not where:
        return f"{name!r}: expected 'module:function' or 'path/to/file.py:function'"
    if where.endswith(".py"):
        if check_files and not Path(where).expanduser().is_file():
            return f"{name!r}: {where} is not a file"
    elif not all(part.isidentifier() for part in where.split(".")):
        return f"{name!r}: {where!r} is not a module name (a file must end with .py)"
    return None


def load_user_function(name: str) -> Callable:
    """`path/to/file.py:function` or `module:function` -> the function (RewardError names what failed)."""
    where, _, func_name = name.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            spec = importlib.util.spec_from_file_location(f"tuneboard_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as exc:  # a user's file: any error in it is theirs to fix, said in one line
        raise RewardError(f"reward function {name}: importing {where} failed: {type(exc).__name__}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise RewardError(f"reward function {name}: {where} has no function {func_name!r}")
    return func


def checked(func: Callable, name: str) -> Callable:
    """`func` wrapped so that an exception or a wrong result becomes a RewardError naming `name`."""

    @functools.wraps(func)
    def reward(prompts, completions, **kwargs):
        try:
            scores = func(prompts=prompts, completions=completions, **kwargs)
        except RewardError:
            raise
        except Exception as exc:  # the user's code: report it as theirs, in one line
            raise RewardError(f"reward function {name} raised {type(exc).__name__}: {exc}") from None
        if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
            raise RewardError(f"reward function {name} returned {type(scores).__name__}: it must return a list "
                              f"with one number (or None) per completion ({len(completions)})")
        scores = list(scores)
        if len(scores) != len(completions):
            raise RewardError(f"reward function {name} returned {len(scores)} scores for {len(completions)} "
                              "completions: it must return one number (or None) per completion")
        out = []
        for i, score in enumerate(scores):
            if score is None:
                out.append(None)
                continue
            if isinstance(score, (str, bytes)) or not hasattr(score, "__float__"):
                raise RewardError(f"reward function {name} returned {score!r} ({type(score).__name__}) for "
                                  f"completion {i}: expected a number or None")
            value = float(score)
            if not math.isfinite(value):
                raise RewardError(f"reward function {name} returned {value} for completion {i}: expected a finite "
                                  "number or None")
            out.append(value)
        return out

    reward.__name__ = metric_name(name)  # TRL names the metrics rewards/<name>/mean|std after it
    return reward


def build_reward_funcs(names, *, max_completion_length: int = 256, regex: str | None = None,
                       reward_model: Callable[[str], Callable] | None = None) -> list[Callable]:
    """reward_funcs -> checked callables named as the user wrote them (built-ins bound to their settings);
    a folder becomes reward_model(folder) (the heavy loader: backend.evaluation.reward_score.RewardModelReward)."""
    funcs = []
    for name in split_names(names):
        problem = name_problem(name)
        if problem:
            raise RewardError(f"reward_funcs: {problem}")
        if is_model_name(name):
            if reward_model is None:
                raise RewardError(f"reward_funcs: {name} is a reward model, and nothing here loads one")
            funcs.append(reward_model(name))
            continue
        if name == "length_penalty":
            func = functools.partial(length_penalty, max_completion_length=max_completion_length)
        elif name == "format_regex":
            func = functools.partial(format_regex, pattern=regex or DEFAULT_FORMAT_REGEX)
        else:
            func = BUILTINS.get(name) or load_user_function(name)
        funcs.append(checked(func, name))
    return funcs
