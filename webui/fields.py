"""The one field table of the Train form: every RunSpec field -> widget kind, bounds, choices, group,
visible-when (stage / finetuning type), generated from `backend.core.spec.spec_fields()` plus a small override
table. A new hyperparameter is one spec field, (maybe) one override row, and its locale key.

Also the two conversions the form needs, both ways: widget values -> flat spec dict (-> validate_spec) and
RunSpec -> widget values. Dropdown values are stable ids (strings); labels come from the locales.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import yaml

from backend.core.launch import shipped_accelerate_configs, shipped_deepspeed_configs
from backend.core.spec import METHOD_GROUPS, spec_fields
from backend.stages import STAGES

# Shown in the top bar (shared by all tabs), not in the accordions.
TOPBAR_FIELDS = ("model_name_or_path", "finetuning_type", "adapter_name_or_path", "quantization_bit", "template")
# The booster dropdown stands for these two.
BOOSTER_FIELDS = ("flash_attn", "enable_liger_kernel")
# Groups that belong to other tools (export, chat), not to a training run.
SKIPPED_GROUPS = ("export", "generation")
# Keys of `tuneboard eval` alone (the Evaluate tab sets them), never of a training run.
EVAL_ONLY_FIELDS = ("do_judge", "checkpoints", "tasks", "num_fewshot", "limit")
# Accordion order on the Train tab, and which start open (none: the first screen is the basic fields).
ACCORDIONS = ("method", "train", "distributed", "data", *METHOD_GROUPS, "quantization", "logging", "eval", "model")
OPEN_ACCORDIONS: tuple[str, ...] = ()
# Always visible above the accordions, in this order (model and method are in the top bar): what a user
# changes on almost every run. Everything else waits in a closed accordion.
BASIC_FIELDS = ("stage", "dataset", "learning_rate", "num_train_epochs", "max_steps",
                "per_device_train_batch_size", "gradient_accumulation_steps", "cutoff_len")
# The passthrough TrainingArguments (80+ rarely used keys) are one YAML box, not 80 widgets.
EXTRA_ARGS_ID = "train-extra_args"

NONE_ID = "none"     # the id of "unset" in a dropdown of an optional choice
AUTO_ID = "auto"     # the id of "unset" in a tri-state (optional bool) dropdown

# The first-open preset: the demo recipe (examples/sft_lora_identity.yaml, same teaching values; a test holds
# the two together). With the bundled model it finishes in a few minutes on 2 CPU cores, and the tuned model
# answers "Who are you?" with identity_name (the old 30 steps at 2e-4 left it answering as before).
PRESET: dict[str, Any] = {
    "stage": "sft", "finetuning_type": "lora", "dataset": "identity", "cutoff_len": 256,
    "num_train_epochs": 3.0, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
    "learning_rate": 1.0e-3, "logging_steps": 1, "save_steps": 10, "save_total_limit": 2,
    "lora_rank": 8, "lora_target": "all", "warmup_steps": 2, "gradient_checkpointing": False, "plot_loss": True,
}

BOOSTERS = ("auto", "disabled", "sdpa", "fa2", "fa3", "liger")

# Override table: widget choices / step where the spec's type alone does not say enough.
OVERRIDES: dict[str, dict] = {
    "optim": {"choices": ["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor",
                          "sgd", "lion_8bit"], "custom": True},  # GaLore: use_galore picks its optimizer
    "lora_target": {"choices": ["all", "q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj"], "custom": True},
    "report_to": {"choices": ["none", "tensorboard", "wandb", "mlflow", "swanlab"], "custom": True},
    "learning_rate": {"step": 1e-5},
    "resume_from_checkpoint": {"placeholder": "true, or a checkpoint folder"},
    # GRPO: the built-in rewards and the extraction pair; any list or module:function can be typed
    "reward_funcs": {"choices": ["json_valid", "json_schema,field_f1", "json_valid,field_f1", "json_schema",
                                 "field_f1", "exact_match", "format_regex", "length_penalty"], "custom": True},
    # Devices and distribution: a process count or auto; the shipped DeepSpeed / FSDP configs (or a typed path)
    "nproc_per_node": {"choices": ["auto", "1", "2", "4", "8"], "custom": True},
    "deepspeed": {"choices": shipped_deepspeed_configs(), "custom": True},
    "accelerate_config": {"choices": shipped_accelerate_configs(), "custom": True},
}


@dataclass(frozen=True)
class FieldRow:
    name: str
    kind: str            # checkbox | tristate | dropdown | int | float | text
    type: str            # the spec's type word
    default: Any
    description: str
    choices: tuple | None
    ge: float | None
    le: float | None
    group: str
    stages: tuple | None
    methods: tuple | None
    optional: bool
    custom: bool = False  # dropdown that also takes a typed value

    @property
    def elem_id(self) -> str:
        return f"train-{self.name}"

    def visible_for(self, stage: str | None, method: str | None) -> bool:
        return (self.stages is None or stage in self.stages) and (self.methods is None or method in self.methods)


def _kind(f: dict) -> str:
    t = f["type"].removeprefix("optional-")
    if f["name"] in OVERRIDES and "choices" in OVERRIDES[f["name"]]:
        return "dropdown"
    if t == "bool":
        return "tristate" if f["type"].startswith("optional-") else "checkbox"
    if t == "choice":
        return "dropdown"
    # An optional number is a text box (empty = unset): gr.Number turns an empty box into 0.
    if t == "int" and not f["type"].startswith("optional-"):
        return "int"
    if t == "float" and not f["type"].startswith("optional-"):
        return "float"
    return "text"


def shared_field_stages() -> dict[str, tuple[str, ...]]:
    """field -> the implemented stages that declare it in `shared_fields` (backend/stages): shown for them only."""

    out: dict[str, tuple[str, ...]] = {}
    for stage in STAGES.values():
        if stage.implemented:
            for name in stage.shared_fields:
                out[name] = out.get(name, ()) + (stage.id,)
    return out


@functools.lru_cache(maxsize=1)
def field_table() -> tuple[FieldRow, ...]:
    rows = []
    shared = shared_field_stages()
    for f in spec_fields():
        if f["name"] in shared:  # a generation key a stage reads while it trains (grpo: temperature, top_p)
            f = dict(f, group="method", stages=list(shared[f["name"]]))
        elif f["group"] in SKIPPED_GROUPS or f.get("refused") or f["name"] in EVAL_ONLY_FIELDS:  # a key always refused at validate is not offered
            continue
        over = OVERRIDES.get(f["name"], {})
        choices = over.get("choices", f.get("choices"))
        ge = f.get("ge") if f.get("ge") is not None else f.get("gt")
        le = f.get("le") if f.get("le") is not None else f.get("lt")
        rows.append(FieldRow(
            name=f["name"], kind=_kind(f), type=f["type"], default=f["default"],
            description=f.get("description") or "", choices=tuple(choices) if choices else None,
            ge=ge, le=le, group=f["group"], stages=tuple(f["stages"]) if f.get("stages") else None,
            methods=tuple(f["methods"]) if f.get("methods") else None,
            optional=f["type"].startswith("optional-"), custom=bool(over.get("custom"))))
    return tuple(rows)


def rows_by_name() -> dict[str, FieldRow]:
    return {r.name: r for r in field_table()}


def form_rows() -> list[FieldRow]:
    """Rows shown in the Train tab's accordions (top bar and booster fields excluded)."""
    return [r for r in field_table() if r.name not in TOPBAR_FIELDS and r.name not in BOOSTER_FIELDS]


def dropdown_ids(row: FieldRow) -> list[str]:
    """Stable string ids of a dropdown's choices (an optional choice gets `none` first)."""
    if row.kind == "tristate":
        return [AUTO_ID, "true", "false"]
    ids = [str(c) for c in row.choices or ()]
    if row.optional and row.kind == "dropdown" and NONE_ID not in ids:
        ids = [NONE_ID] + ids
    return ids


# ------------------------------------------------------------------ value conversions

def to_widget(row: FieldRow, value: Any) -> Any:
    """A spec value -> the value its widget holds."""
    if row.kind == "checkbox":
        return bool(value)
    if row.kind == "tristate":
        return AUTO_ID if value is None else ("true" if value else "false")
    if row.kind == "dropdown":
        if value is None:
            return NONE_ID if row.optional else (str(row.default) if row.default is not None else None)
        if isinstance(value, list):
            return ",".join(map(str, value))
        return str(value)
    if row.kind in ("int", "float"):
        return value
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return ",".join(map(str, value)) if isinstance(value, list) else yaml.safe_dump(value).strip()
    return str(value)


def from_widget(row: FieldRow, value: Any) -> Any:
    """A widget value -> the spec value (validation itself is the spec's job)."""
    if row.kind == "checkbox":
        return bool(value)
    if row.kind == "tristate":
        return None if value in (None, "", AUTO_ID) else value == "true"
    if row.kind == "dropdown":
        if value in (None, "") or (row.optional and value == NONE_ID):
            return None
        for c in row.choices or ():  # back to the choice's own type (quantization_bit: 4, not "4")
            if str(c) == str(value):
                return c
        return value
    if row.kind in ("int", "float"):
        if value is None or value == "":
            return None if row.optional else row.default
        if row.kind == "int" and isinstance(value, float) and value.is_integer():
            return int(value)
        return value
    text = "" if value is None else str(value).strip()
    if text == "":
        return None if row.optional else ""
    if "bool" in row.type and text.lower() in ("true", "false"):
        return text.lower() == "true"
    base = row.type.removeprefix("optional-")
    if base in ("int", "float"):  # typed text; a bad number is left for the spec to name
        try:
            number = float(text)
            return int(number) if base == "int" and number.is_integer() else number
        except ValueError:
            return text
    return text


def booster_to_fields(booster: str) -> dict:
    if booster == "liger":
        return {"flash_attn": "auto", "enable_liger_kernel": True}
    return {"flash_attn": booster if booster in BOOSTERS else "auto", "enable_liger_kernel": False}


def fields_to_booster(flat: dict) -> str:
    if flat.get("enable_liger_kernel"):
        return "liger"
    return flat.get("flash_attn") or "auto"


def parse_extra_args(text: str) -> tuple[dict, list[tuple[str, str]]]:
    """The passthrough YAML box -> dict, or an error on the box itself."""
    if not (text or "").strip():
        return {}, []
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return {}, [("extra_args", f"not valid YAML: {exc}")]
    if not isinstance(data, dict):
        return {}, [("extra_args", "must be a mapping of key: value lines")]
    return data, []


def values_to_flat(names: list[str], values: list, extra_args: str = "", booster: str = "auto") -> tuple[dict, list]:
    """Widget values (in `names` order) -> flat spec dict, plus errors found before the spec sees it."""
    table = rows_by_name()
    flat = {}
    for name, value in zip(names, values):
        flat[name] = from_widget(table[name], value)
    flat.update(booster_to_fields(booster))
    extra, errors = parse_extra_args(extra_args)
    flat.update(extra)
    return flat, errors


def spec_to_values(spec, names: list[str]) -> tuple[list, str, str]:
    """RunSpec -> (widget values in `names` order, passthrough YAML, booster id)."""
    flat = spec.flat_dict()
    table = rows_by_name()
    values = [to_widget(table[n], flat.get(n, table[n].default)) for n in names]
    passthrough = dict(getattr(spec, "passthrough", {}) or {})
    extra = yaml.safe_dump(passthrough, sort_keys=False, allow_unicode=True).strip() if passthrough else ""
    return values, extra, fields_to_booster(flat)


def preset_values(names: list[str]) -> list:
    table = rows_by_name()
    return [to_widget(table[n], PRESET.get(n, table[n].default)) for n in names]
