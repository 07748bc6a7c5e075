"""The fine-tuning methods, declared once (light: no torch). What `finetuning_type` may be and what each
value is; code asks this declaration ("does this run train an adapter?") instead of comparing names.
How a method is applied to a model lives in backend/training/adapters.py (one function per method).

    METHODS["lora"].adapter        True: trains a peft adapter saved apart from the base
    method(name)                   the declaration, or a ValueError naming the choices
    adapter_methods()              ids of the adapter methods (lora, oft)
    method_of_adapter(folder)      the method an adapter folder was trained with (its adapter_config.json)

Adding a method: one `Method` here, one `apply` function in backend/training/adapters.py, its spec fields (group =
the method id, `methods=[id]`) and locale keys. ARCHITECTURE.md shows the walk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Method:
    id: str
    title: str              # what the form and messages call it
    adapter: bool           # a peft adapter folder (adapter_config.json) is the run's output; merged on export
    trains: str             # what is trained, in words (the form's help and the run log)
    quantized_base: bool    # may train on a 4/8-bit base (bitsandbytes): the base stays frozen
    full_weights: bool      # updates the model's own weights (GaLore and friends need this)
    form_group: str | None  # the spec field group holding its own keys (shown in the form when picked)
    trainable_share: float = 1.0  # rough share of the weights trained (the memory preflight's optimizer state)
    peft_type: str | None = None  # adapter_config.json's peft_type for an adapter method


METHODS: dict[str, Method] = {m.id: m for m in (
    Method("lora", "LoRA", adapter=True, trains="low-rank adapters beside the chosen linear layers",
           quantized_base=True, full_weights=False, form_group="lora", trainable_share=0.02, peft_type="LORA"),
    Method("oft", "OFT", adapter=True, trains="orthogonal rotations of the chosen linear layers' outputs",
           quantized_base=False, full_weights=False, form_group="oft", trainable_share=0.02, peft_type="OFT"),
    Method("freeze", "Freeze", adapter=False, trains="the last (or first) N decoder layers, the rest frozen",
           quantized_base=False, full_weights=True, form_group="freeze", trainable_share=0.15),
    Method("full", "Full", adapter=False, trains="every weight", quantized_base=False, full_weights=True,
           form_group=None),
)}

DEFAULT = "lora"


def method(name: str | None) -> Method:
    """The declaration of a finetuning_type (case-insensitive; empty = the default)."""
    key = str(name or DEFAULT).lower()
    if key not in METHODS:
        raise ValueError(f"finetuning_type: unknown value '{name}' (choose {', '.join(METHODS)})")
    return METHODS[key]


def is_adapter(name: str | None) -> bool:
    return str(name or DEFAULT).lower() in METHODS and method(name).adapter


def adapter_methods() -> tuple[str, ...]:
    return tuple(m.id for m in METHODS.values() if m.adapter)


def quantizable_methods() -> tuple[str, ...]:
    return tuple(m.id for m in METHODS.values() if m.quantized_base)


def _oft_errors(spec) -> list[tuple[str, str, tuple[str, ...]]]:
    if (spec.oft_rank == 0) == (spec.oft_block_size == 0):
        return [("oft_block_size", "OFT needs exactly one of oft_rank and oft_block_size above 0 (the other 0; "
                 f"got oft_rank {spec.oft_rank}, oft_block_size {spec.oft_block_size})", ("oft_rank", "finetuning_type"))]
    return []


# A method's own cross-field rules: spec -> [(field, message, other fields involved)]; spec.py calls them.
RULES = {"oft": _oft_errors}


def method_errors(spec) -> list[tuple[str, str, tuple[str, ...]]]:
    """The rules of the spec's finetuning_type (none for an unknown one: its Literal type refuses it)."""
    rule = RULES.get(str(spec.finetuning_type or DEFAULT).lower())
    return rule(spec) if rule else []


def field_applies(spec, name: str) -> bool:
    """Whether a spec field declared for some methods (`methods=[...]` in backend/core/spec.py) applies to the
    spec's finetuning_type (a field declared for every method always does)."""
    extra = type(spec).model_fields[name].json_schema_extra
    wanted = extra.get("methods") if isinstance(extra, dict) else None
    return wanted is None or spec.finetuning_type in wanted


def method_of_adapter(folder: str | Path) -> str | None:
    """The method id an adapter folder was trained with (adapter_config.json's peft_type), None when the
    folder holds no readable adapter config or a peft type TuneBoard does not declare."""
    try:
        config = json.loads((Path(folder).expanduser() / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    peft_type = str(config.get("peft_type", "")).upper() if isinstance(config, dict) else ""
    return next((m.id for m in METHODS.values() if m.peft_type and m.peft_type == peft_type), None)
