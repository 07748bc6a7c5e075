"""The distill spec: flat YAML keys, validated here with messages that name the key (light: pydantic + yaml).

    tuneboard distill SPEC.yaml [key=value ...]

An API key is never a spec key: the spec names where the key is (`teacher_api_key_env`, an environment
variable, or `teacher_api_key_file`, a file holding it), so the spec, the run folder and the logs never hold it.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backend.core import paths
from backend.distill import STEPS
import yaml
from backend.core.spec import RunSpec, SpecError, parse_overrides, read_spec_file

SECRET_KEYS = ("teacher_api_key", "api_key", "openai_api_key", "key")


class DistillSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    # -- documents -------------------------------------------------------------------------------
    documents: str = Field(description="a folder (read recursively), a file, or a comma list of files: "
                                       ".txt, .md, .html/.htm, .pdf, .jsonl (one document per line)")
    text_column: str = Field("text", description="the JSONL field that holds a document's text")
    # -- task ------------------------------------------------------------------------------------
    task: str = Field(description="the instruction: what to do with each chunk (the student's prompt starts with it)")
    answer_format: Literal["json", "text"] = Field("json", description="json: each answer must parse as JSON "
                                                                        "(and validate against `schema` if given)")
    json_schema: Union[dict, str, None] = Field(None, description="a JSON Schema (inline mapping, JSON text, or a "
                                                                  ".json file) every answer must validate against")
    examples: Union[list, str, None] = Field(None, description="hand-written examples for the teacher prompt: a list "
                                                               "of {input, output}, or a .json/.jsonl file of them")
    # -- student ---------------------------------------------------------------------------------
    model_name_or_path: str = Field(paths.DEFAULT_MODEL_ID, description="the student model (its tokenizer sizes "
                                                                        "the chunks; it is fine-tuned and scored)")
    template: str = Field("auto", description="the student's chat template")
    cutoff_len: int = Field(1024, ge=64, description="the student's training length: chunk + instruction + answer fit in it")
    answer_tokens: int = Field(256, ge=8, description="room kept for the answer (student tokens); also the teacher's max_tokens")
    chunk_overlap: int = Field(64, ge=0, description="tokens shared by consecutive chunks of a document")
    # -- teacher ---------------------------------------------------------------------------------
    teacher: str = Field("local", description="'local' (a `tuneboard api` started for the run) or the base URL "
                                              "of any OpenAI-compatible endpoint, e.g. https://api.openai.com/v1")
    teacher_model: Optional[str] = Field(None, description="the teacher's model name (required for a URL; local: "
                                                           "the served model)")
    teacher_local_model: Optional[str] = Field(None, description="teacher local: the model to serve (default: the student)")
    teacher_local_adapter: Optional[str] = Field(None, description="teacher local: an adapter to serve on it")
    teacher_api_key_env: Optional[str] = Field("OPENAI_API_KEY", description="the environment variable that holds "
                                                                             "the teacher's API key (unset or empty "
                                                                             "= no key)")
    teacher_api_key_file: Optional[str] = Field(None, description="a file whose first line is the teacher's API "
                                                                  "key (instead of the environment variable)")
    concurrency: int = Field(4, ge=1, le=64, description="requests in flight at once (a local teacher takes one "
                                                        "at a time)")
    request_timeout: float = Field(120.0, gt=0, description="seconds one request may take")
    max_retries: int = Field(3, ge=0, le=20, description="retries of a request after 429, 5xx, a timeout or a "
                                                        "malformed reply")
    retry_backoff: float = Field(1.0, ge=0, description="first retry wait in seconds, doubled each retry "
                                                        "(a Retry-After header is honoured, up to 60 s)")
    max_requests: int = Field(0, ge=0, description="request budget of this run, retries included (0 = no limit)")
    temperature: float = Field(0.0, ge=0, le=2, description="the teacher's sampling temperature")
    # -- dataset ---------------------------------------------------------------------------------
    dataset_name: str = Field("distilled", description="the name registered in dataset_info.json (the held-out "
                                                       "part is <name>_eval)")
    dataset_dir: Optional[str] = Field(None, description="the folder with dataset_info.json (default: TuneBoard's data/)")
    eval_ratio: float = Field(0.2, ge=0, le=0.9, description="share of the documents held out (never split "
                                                             "across train and eval)")
    dedup_threshold: float = Field(0.9, gt=0, le=1, description="chunks whose word 3-gram Jaccard similarity to "
                                                                "an earlier chunk reaches this are dropped as duplicates")
    seed: int = Field(42, description="the document split's seed")
    output_dir: Optional[str] = Field(None, description="the distill run folder (default saves/distill/<dataset_name>)")
    # -- steps -----------------------------------------------------------------------------------
    steps: Union[list[str], str] = Field(default_factory=lambda: ["generate"], description="what to run, in order: generate, train, score "
                                                                  "(comma list)")
    train_args: dict = Field(default_factory=dict, description="step train: extra run-spec keys (max_steps, "
                                                               "lora_rank, ...) on top of the derived SFT spec")
    adapter_name_or_path: Optional[str] = Field(None, description="step score: the tuned adapter (default: the "
                                                                  "train step's output)")
    score_max_rows: int = Field(50, ge=1, description="step score: held-out pairs scored at most")

    @field_validator("documents", "task", "dataset_name", "teacher", "text_column")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not str(v).strip():
            raise ValueError("must not be empty")
        return str(v).strip()

    @field_validator("dataset_name")
    @classmethod
    def _name(cls, v: str) -> str:
        if "," in v or "/" in v or v.startswith("."):
            raise ValueError("use letters, digits, '_', '-', '.' (no commas or slashes)")
        return v

    @field_validator("steps")
    @classmethod
    def _steps(cls, v) -> list[str]:
        items = v if isinstance(v, list) else str(v).split(",")
        items = [str(s).strip() for s in items if str(s).strip()]
        bad = [s for s in items if s not in STEPS]
        if bad or not items:
            raise ValueError(f"{', '.join(bad) or 'nothing'}: choose from {', '.join(STEPS)}")
        return [s for s in STEPS if s in items]  # always in pipeline order

    @field_validator("teacher")
    @classmethod
    def _teacher(cls, v: str) -> str:
        if v != "local" and not v.startswith(("http://", "https://")):
            raise ValueError("give 'local' or an http(s):// base URL (e.g. http://127.0.0.1:8000/v1)")
        return v.rstrip("/")

    # -- derived ---------------------------------------------------------------------------------
    def resolved_output_dir(self) -> Path:
        if self.output_dir:
            return Path(self.output_dir).expanduser().resolve()
        return paths.saves_dir() / "distill" / self.dataset_name

    def resolved_dataset_dir(self) -> Path:
        return Path(self.dataset_dir).expanduser().resolve() if self.dataset_dir else paths.DATA_DIR

    def schema_dict(self) -> dict | None:
        """json_schema as a dict (read from its file or parsed from JSON text); None when unset."""
        value = self.json_schema
        if value is None or isinstance(value, dict):
            return value
        text = value.strip()
        if not text.startswith("{"):
            text = Path(text).expanduser().read_text(encoding="utf-8")
        return json.loads(text)

    def example_list(self) -> list[dict]:
        value = self.examples
        if not value:
            return []
        if isinstance(value, list):
            return value
        path = Path(value).expanduser()
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


class DistillSpecError(ValueError):
    """Every problem of a distill spec as (key, message) pairs; str() is one `key: message` per line."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = list(errors)
        super().__init__("\n".join(f"{k}: {m}" for k, m in self.errors))


def _cross_checks(spec: DistillSpec, check_files: bool) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if spec.teacher != "local" and not spec.teacher_model:
        errors.append(("teacher_model", "required when teacher is a URL (the model name the endpoint serves)"))
    if spec.teacher != "local" and (spec.teacher_local_model or spec.teacher_local_adapter):
        key = "teacher_local_model" if spec.teacher_local_model else "teacher_local_adapter"
        errors.append((key, "only applies to teacher: local"))
    if spec.answer_tokens >= spec.cutoff_len - 32:
        errors.append(("answer_tokens", f"{spec.answer_tokens} leaves no room for a chunk in cutoff_len "
                                        f"{spec.cutoff_len}: lower it or raise cutoff_len"))
    if spec.json_schema is not None and spec.answer_format != "json":
        errors.append(("json_schema", "needs answer_format: json"))
    try:
        schema = spec.schema_dict()
    except (OSError, ValueError) as exc:
        errors.append(("json_schema", f"cannot read it: {exc}"))
        schema = None
    if schema is not None:
        from jsonschema import Draft202012Validator  # heavy: loaded on use, so importing this module stays light
        from jsonschema.exceptions import SchemaError  # heavy: loaded on use, so importing this module stays light

        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            errors.append(("json_schema", f"not a valid JSON Schema: {exc.message}"))
    try:
        for i, ex in enumerate(spec.example_list()):
            if not isinstance(ex, dict) or not {"input", "output"} <= set(ex):
                errors.append(("examples", f"item {i} must be a mapping with 'input' and 'output'"))
                break
    except (OSError, ValueError) as exc:
        errors.append(("examples", f"cannot read them: {exc}"))
    if "train" in spec.steps:
        unknown = [k for k in spec.train_args if k not in RunSpec.model_fields]
        if unknown:
            errors.append(("train_args", f"unknown run-spec key(s) {', '.join(unknown)} (see `tuneboard fields`)"))
    if check_files:
        docs = [p.strip() for p in spec.documents.split(",") if p.strip()]
        for d in docs:
            if not Path(d).expanduser().exists():
                errors.append(("documents", f"{d} does not exist"))
        if spec.teacher_api_key_file and not Path(spec.teacher_api_key_file).expanduser().is_file():
            errors.append(("teacher_api_key_file", f"{spec.teacher_api_key_file} is not a file"))
        if spec.adapter_name_or_path and not Path(spec.adapter_name_or_path).expanduser().is_dir():
            errors.append(("adapter_name_or_path", f"{spec.adapter_name_or_path} is not a folder"))
    return errors


def validate_distill(data: dict[str, Any], check_files: bool = True) -> DistillSpec:
    """A flat mapping -> DistillSpec, or DistillSpecError naming every bad key."""
    errors: list[tuple[str, str]] = []
    data = dict(data or {})
    for key in list(data):
        if key.lower() in SECRET_KEYS:
            errors.append((key, "an API key is never written in a spec: put it in an environment variable named "
                                "by teacher_api_key_env, or in a file named by teacher_api_key_file"))
            data.pop(key)
    try:
        spec = DistillSpec.model_validate(data)
    except ValidationError as exc:
        for e in exc.errors():
            key = str(e["loc"][0]) if e.get("loc") else "spec"
            if e.get("type") == "extra_forbidden":
                close = difflib.get_close_matches(key, list(DistillSpec.model_fields), n=1)
                errors.append((key, "unknown key" + (f" (did you mean {close[0]}?)" if close else "")))
            elif e.get("type") == "missing":
                errors.append((key, f"required: {DistillSpec.model_fields[key].description}"))
            else:
                errors.append((key, e.get("msg", "invalid").removeprefix("Value error, ")))
        raise DistillSpecError(errors) from None
    errors += _cross_checks(spec, check_files)
    if errors:
        raise DistillSpecError(errors)
    return spec


def load_distill(args: list[str], check_files: bool = True) -> DistillSpec:
    """`[SPEC.yaml] [key=value ...]` -> DistillSpec (DistillSpecError names the problems)."""

    path = args[0] if args and "=" not in args[0] else None
    overrides = args[1:] if path else list(args)
    try:
        data = read_spec_file(path) if path else {}
        data.update(parse_overrides(overrides))
    except SpecError as exc:
        raise DistillSpecError(exc.errors) from None
    except (OSError, ValueError) as exc:
        raise DistillSpecError([(str(path or "spec"), str(exc))]) from None
    return validate_distill(data, check_files=check_files)


def distill_fields() -> list[dict]:
    """Every key with its description and default (for `tuneboard distill --help` and the UI)."""
    out = []
    for name, f in DistillSpec.model_fields.items():
        out.append({"name": name, "description": f.description or "",
                    "default": None if f.is_required() else f.get_default(call_default_factory=True),
                    "required": f.is_required()})
    return out
