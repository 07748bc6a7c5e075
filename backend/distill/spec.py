"""The distill spec: flat YAML keys, validated here with messages that name the key (light: pydantic + yaml).

    tuneboard distill SPEC.yaml [key=value ...]

An API key is never a spec key: the spec names where the key is (`teacher_api_key_env`, an environment
variable, or `teacher_api_key_file`, a file holding it), so the spec, the run folder and the logs never hold it.
"""
from __future__ import annotations

import difflib
import json
import tempfile
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backend.core import paths
from backend.distill import STEPS, TRAIN_DIRNAME, read_progress
import yaml
from backend.core.spec import RunSpec, SpecError, parse_overrides, read_spec_file, validate_spec
from backend.core.train_rules import train_command_errors

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
    room = spec.cutoff_len - spec.answer_tokens
    # the default (as the Distill tab sends it too) is lowered at run time, and the log says so
    overlap_default = type(spec).model_fields["chunk_overlap"].default
    if spec.chunk_overlap != overlap_default and spec.chunk_overlap > room // 2:
        errors.append(("chunk_overlap", f"{spec.chunk_overlap} is more than half of a chunk: a chunk has at most "
                                        f"cutoff_len - answer_tokens = {room} tokens (less the instruction), so "
                                        f"chunk_overlap may be {room // 2} at most"))
    if spec.json_schema is not None and spec.answer_format != "json":
        errors.append(("json_schema", "needs answer_format: json"))
    try:
        schema = spec.schema_dict()
    except (OSError, ValueError) as exc:
        errors.append(("json_schema", f"cannot read it: {exc}"))
        schema = None
    schema_ok = schema is not None
    if schema is not None:
        from jsonschema import Draft202012Validator  # heavy: loaded on use, so importing this module stays light
        from jsonschema.exceptions import SchemaError  # heavy: loaded on use, so importing this module stays light

        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            errors.append(("json_schema", f"not a valid JSON Schema: {exc.message}"))
            schema_ok = False
    try:
        for i, ex in enumerate(spec.example_list()):
            if not isinstance(ex, dict) or not {"input", "output"} <= set(ex):
                errors.append(("examples", f"item {i} must be a mapping with 'input' and 'output'"))
                break
            problem = _example_problem(ex["output"], spec.answer_format, schema if schema_ok else None)
            if problem:  # the teacher would learn from it an answer the validation then rejects
                errors.append(("examples", f"item {i}: its output {problem}"))
                break
    except (OSError, ValueError) as exc:
        errors.append(("examples", f"cannot read them: {exc}"))
    if "output_dir" in spec.train_args:
        errors.append(("train_args.output_dir", "not settable: the train step's folder is <output_dir>/"
                                                f"{TRAIN_DIRNAME} of the distill run (the score step reads the "
                                                "adapter there); set output_dir to move the whole run"))
    elif "train" in spec.steps:
        unknown = [k for k in spec.train_args if k not in RunSpec.model_fields]
        if unknown:
            errors.append(("train_args", f"unknown run-spec key(s) {', '.join(unknown)} (see `tuneboard fields`)"))
        else:  # the run spec step train will build, checked before any teacher request (a paid API call)
            errors += train_spec_errors(spec, check_files)
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


def _example_problem(output, answer_format: str, schema: dict | None) -> str | None:
    """Why an example's output is not an answer the validation accepts (answer_format json: JSON, valid
    against json_schema), or None."""
    if answer_format != "json":
        return None
    value = output
    if isinstance(output, str):
        try:
            value = json.loads(output)
        except ValueError as exc:
            return f"is not JSON ({exc}) but answer_format is json"
    if schema is not None:
        from jsonschema import Draft202012Validator  # heavy: loaded on use, so importing this module stays light

        error = next(iter(sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return f"fails json_schema at {where}: {error.message}"
    return None


# ------------------------------------------------------------------------------------ step train's spec
def _cli(value) -> str:
    """A run-spec value as a `key=value` override of `tuneboard train` (parsed back by parse_overrides)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def train_overrides(spec: DistillSpec, dataset: dict | None, output_dir: Path | None = None) -> dict:
    """The run-spec keys of a LoRA SFT run on the distilled dataset (the UI's "Fine-tune on it" fills the
    Train form with them; step train runs them): cutoff_len from the longest pair, rounded up to 64."""
    flat = {"stage": "sft", "model_name_or_path": spec.model_name_or_path, "finetuning_type": "lora",
            "template": spec.template, "dataset": spec.dataset_name,
            "cutoff_len": (dataset or {}).get("cutoff_len") or spec.cutoff_len}
    if spec.dataset_dir:
        flat["dataset_dir"] = str(spec.resolved_dataset_dir())
    if output_dir is not None:
        flat.update(output_dir=str(output_dir), overwrite_output_dir=True)
    flat.update(spec.train_args)
    return flat


def train_cli_args(spec: DistillSpec, dataset: dict | None, output_dir: Path | None = None) -> list[str]:
    """The `key=value` arguments step train passes to `tuneboard train` (which validates them with
    backend.core.spec.load_or_report: parse_overrides, then validate_spec)."""
    return [f"{k}={_cli(v)}" for k, v in train_overrides(spec, dataset, output_dir).items()]


def dataset_entry(name: str) -> dict:
    """The dataset_info.json entry step generate registers for dataset `name` (alpaca columns)."""
    return {"file_name": f"{name}.json", "columns": {"prompt": "instruction", "query": "input", "response": "output"}}


# the distill keys that step train's spec takes its keys from (any other key comes from train_args or a default)
_DERIVED = {"model_name_or_path": "model_name_or_path", "template": "template", "cutoff_len": "cutoff_len",
            "dataset": "dataset_name", "dataset_dir": "dataset_dir", "output_dir": "output_dir",
            "overwrite_output_dir": "output_dir"}


def _train_key(spec: DistillSpec, field: str) -> str:
    if field in spec.train_args:
        return f"train_args.{field}"
    if field in ("dataset", "eval_dataset") and "stage" in spec.train_args:
        return "train_args.stage"  # the distilled dataset is what generate makes: the stage asks for another kind
    return _DERIVED.get(field, f"train_args.{field}")


def train_spec_errors(spec: DistillSpec, check_files: bool = True) -> list[tuple[str, str]]:
    """What `tuneboard train` would refuse in the run spec step train builds (train_cli_args, parsed and validated
    as `tuneboard train` does: parse_overrides + validate_spec), each named by the distill key it comes from
    (`train_args.<key>`, or model_name_or_path, template, cutoff_len, dataset_name, dataset_dir, output_dir).

    Before step generate has run, the dataset it will register does not exist yet: the files are checked
    against a stand-in dataset folder that holds just the entries generate registers (so a stage that cannot
    train on an alpaca dataset is still refused); where train_args mix such a name with other datasets, the
    dataset checks are left to the train step. cutoff_len is the spec's, the most the train step will use
    (it lowers it to the longest pair)."""
    out = spec.resolved_output_dir()
    dataset = None if "generate" in spec.steps else read_progress(out).get("dataset")
    try:
        data = parse_overrides(train_cli_args(spec, dataset, out / TRAIN_DIRNAME))
        run_spec = validate_spec(data, check_files=False)
        beyond = train_command_errors(run_spec)  # what `tuneboard train` refuses beyond validate (do_judge, tasks, ...)
        if beyond:
            raise SpecError(beyond)
        if check_files:
            _train_files(spec, data, run_spec)
    except SpecError as exc:
        return [(_train_key(spec, field), f"{message} (step train's run spec)") for field, message in exc.errors]
    return []


def _train_files(spec: DistillSpec, data: dict, run_spec: RunSpec) -> None:
    """validate_spec with its file checks, on the dataset folder as it will be when step train starts."""
    generated = {spec.dataset_name, f"{spec.dataset_name}_eval"}
    names = set(run_spec.dataset_names) | set(run_spec.eval_dataset_names)
    same_dir = run_spec.resolved_dataset_dir() == spec.resolved_dataset_dir()
    if "generate" not in spec.steps or not same_dir or not names & generated:
        validate_spec(data, check_files=True)  # the datasets are there already (or never made by this run)
        return
    if not names <= generated:  # a distilled name next to other datasets: all but the dataset checks
        try:
            validate_spec(data, check_files=True)
        except SpecError as exc:
            kept = [(f, m) for f, m in exc.errors if f not in ("dataset", "eval_dataset")]
            if kept:
                raise SpecError(kept) from None
        return
    real = str(spec.resolved_dataset_dir())
    with tempfile.TemporaryDirectory(prefix="distill-train-check-") as tmp:
        info = {}
        for name in sorted(names):
            entry = dataset_entry(name)
            row = {"instruction": spec.task, "input": "chunk", "output": "answer"}
            (Path(tmp) / entry["file_name"]).write_text(json.dumps([row]), encoding="utf-8")
            info[name] = entry
        (Path(tmp) / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
        try:
            validate_spec({**data, "dataset_dir": tmp}, check_files=True)
        except SpecError as exc:
            raise SpecError([(f, m.replace(tmp, real)) for f, m in exc.errors]) from None


def dataset_dir_problem(spec: DistillSpec) -> str | None:
    """Why step generate cannot register its dataset in dataset_dir, or None. A dataset_dir that does not exist
    is created (one level: the folder itself), so its parent must be a folder already; a typo'd path is refused
    rather than created with every missing folder above it."""
    if not spec.dataset_dir:
        return None
    ddir = spec.resolved_dataset_dir()
    if ddir.exists():
        return None if ddir.is_dir() else f"{ddir} is a file, not a folder"
    if not ddir.parent.is_dir():
        return (f"{ddir} does not exist, nor does its parent {ddir.parent}: give an existing folder, or a new "
                "folder in an existing one")
    return None


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
    spec = validate_distill(data, check_files=check_files)
    problem = dataset_dir_problem(spec) if check_files else None
    if problem:  # the command line's check, before any teacher request (step generate checks it too)
        raise DistillSpecError([("dataset_dir", problem)])
    return spec


def distill_fields() -> list[dict]:
    """Every key with its description and default (for `tuneboard distill --help` and the UI)."""
    out = []
    for name, f in DistillSpec.model_fields.items():
        out.append({"name": name, "description": f.description or "",
                    "default": None if f.is_required() else f.get_default(call_default_factory=True),
                    "required": f.is_required()})
    return out
