"""The fine-tuning methods, declared once (light: no torch). What `finetuning_type` may be and what each
value is; code asks this declaration ("does this run train an adapter?") instead of comparing names.
How a method is applied to a model lives in backend/training/adapters.py (one function per method).

    METHODS["lora"].adapter        True: trains a peft adapter saved apart from the base
    method(name)                   the declaration, or a ValueError naming the choices
    adapter_methods()              ids of the adapter methods (lora, oft)
    method_of_adapter(folder)      the method an adapter folder was trained with (its adapter_config.json)

Adding a method: one `Method` here with its keys class (its spec fields: group = the method id, `methods=[id]`;
listed in `METHOD_KEYS`, which RunSpec inherits), one entry in backend/training/adapters.py and locale keys.
ARCHITECTURE.md shows the walk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import field_validator

from backend.core.refusals import REFUSED
from backend.core.spec_keys import Keys, spec_key as _f


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
    bf16_by_default: bool = False  # bf16 left unset trains in bf16 on a native-bf16 CPU (with a stage that says so)


METHODS: dict[str, Method] = {m.id: m for m in (
    Method("lora", "LoRA", adapter=True, trains="low-rank adapters beside the chosen linear layers",
           quantized_base=True, full_weights=False, form_group="lora", trainable_share=0.02, peft_type="LORA",
           bf16_by_default=True),  # measured to learn like fp32 (bench/README.md 2026-12-04); frozen weights stay bf16
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


# ---------------------------------------------------------------- each method's own spec keys (RunSpec inherits them)
# One group per class: RunSpec puts each class among the keys of its group (backend/core/spec_keys.key_order).
class LoraModelKeys(Keys):  # LoRA's key among the model keys (where LLaMA-Factory has it)
    use_unsloth: bool = _f(False, "Use Unsloth's optimized LoRA kernels (GPU only).", "model", methods=["lora"], refused="Unsloth is not integrated (its kernels need a GPU and the package is not installed): drop use_unsloth; flash_attn and enable_liger_kernel are the supported speed-ups")


class LoraKeys(Keys):
    comma_keys = ("lora_target", "additional_target")

    lora_target: str = _f("all", "Modules that get LoRA adapters: 'all' (every linear layer but the head) or names, comma-separated.", "lora", methods=["lora"])
    lora_rank: int = _f(8, "LoRA rank r (adapter size).", "lora", methods=["lora"], ge=1)
    lora_alpha: Optional[int] = _f(None, "LoRA scale numerator alpha (scale = alpha / rank); empty = 2 x rank.", "lora", methods=["lora"], ge=1)
    lora_dropout: float = _f(0.0, "Dropout on the LoRA input, 0 to 1.", "lora", methods=["lora"], ge=0, le=1)
    additional_target: Optional[str] = _f(None, "Extra modules trained in full and saved with the adapter (e.g. embed_tokens,lm_head).", "lora", methods=list(adapter_methods()))
    use_dora: bool = _f(False, "Use DoRA (weight-decomposed LoRA).", "lora", methods=["lora"])
    use_rslora: bool = _f(False, "Use rank-stabilised LoRA scaling (alpha / sqrt(rank)).", "lora", methods=["lora"])
    pissa_init: bool = _f(False, "Initialise LoRA with PiSSA (principal singular vectors).", "lora", methods=["lora"])
    pissa_iter: int = _f(16, "Fast-SVD iterations for PiSSA; -1 = exact SVD.", "lora", methods=["lora"], ge=-1)
    loraplus_lr_ratio: Optional[float] = _f(None, "LoRA+ learning-rate ratio lr_B / lr_A (empty = off).", "lora", methods=["lora"], gt=0)
    create_new_adapter: bool = _f(False, "Train a new adapter on top of adapter_name_or_path instead of continuing it.", "lora", methods=list(adapter_methods()))

    @property
    def resolved_lora_alpha(self) -> int:
        """lora_alpha, or 2 x lora_rank when unset (LLaMA-Factory's default)."""
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank


class OftKeys(Keys):
    comma_keys = ("oft_target",)

    oft_target: str = _f("all", "Modules that get OFT rotations: 'all' (every linear layer but the head) or names, comma-separated.", "oft", methods=["oft"])
    oft_block_size: int = _f(32, "OFT block size (each block rotates this many output features); 0 = set oft_rank instead.", "oft", methods=["oft"], ge=0)
    oft_rank: int = _f(0, "OFT rank: the number of blocks per layer; 0 = set oft_block_size instead.", "oft", methods=["oft"], ge=0)
    module_dropout: float = _f(0.0, "OFT multiplicative dropout: the share of blocks replaced by the identity in a step, 0 to 1.", "oft", methods=["oft"], ge=0, le=1)


class FreezeKeys(Keys):  # and GaLore, which trains full weights
    comma_keys = ("freeze_trainable_modules", "freeze_extra_modules", "galore_target")

    freeze_trainable_layers: int = _f(2, "Layers to train: positive = the last N, negative = the first N.", "freeze", methods=["freeze"])
    freeze_trainable_modules: str = _f("all", "Modules trained inside those layers: 'all' or names, comma-separated.", "freeze", methods=["freeze"])
    freeze_extra_modules: Optional[str] = _f(None, "Modules outside the layers to train as well (e.g. embed_tokens), comma-separated.", "freeze", methods=["freeze"])
    use_llama_pro: bool = _f(False, "LLaMA Pro: train only the expanded (new) blocks.", "freeze", methods=["freeze"], refused="LLaMA Pro (a model expanded with new blocks) is not implemented: use finetuning_type freeze with freeze_trainable_layers, or LoRA")
    use_galore: bool = _f(False, "Use GaLore gradient low-rank projection (full or freeze).", "freeze", methods=["full", "freeze"])
    galore_rank: int = _f(16, "GaLore projection rank.", "freeze", methods=["full", "freeze"], ge=1)
    galore_target: str = _f("all", "Modules GaLore applies to: 'all' or names, comma-separated.", "freeze", methods=["full", "freeze"])
    galore_update_interval: int = _f(200, "Steps between GaLore projection updates.", "freeze", methods=["full", "freeze"], ge=1)
    galore_scale: float = _f(2.0, "GaLore gradient scale.", "freeze", methods=["full", "freeze"], gt=0)

    @field_validator("freeze_trainable_layers")
    @classmethod
    def _nonzero_layers(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must not be 0 (positive = last N layers, negative = first N layers)")
        return value


# The methods' keys, in their order within a group.
METHOD_KEYS: tuple[type[Keys], ...] = (LoraModelKeys, LoraKeys, OftKeys, FreezeKeys)


def _oft_errors(spec) -> list[tuple[str, str, tuple[str, ...]]]:
    if (spec.oft_rank == 0) == (spec.oft_block_size == 0):
        return [("oft_block_size", "OFT needs exactly one of oft_rank and oft_block_size above 0 (the other 0; "
                 f"got oft_rank {spec.oft_rank}, oft_block_size {spec.oft_block_size})", ("oft_rank", "finetuning_type"))]
    return []


# keys that shape what a switch turns on: set while the switch is off, they would change nothing
SWITCHED = {"pissa_iter": "pissa_init", "galore_rank": "use_galore", "galore_target": "use_galore",
            "galore_update_interval": "use_galore", "galore_scale": "use_galore"}


def _switched_errors(spec) -> list[tuple[str, str, tuple[str, ...]]]:
    """A key of a switch that is off (pissa_iter without pissa_init, galore_* without use_galore) is refused: the run
    would ignore it."""
    fields = type(spec).model_fields
    return [(key, f"{REFUSED}: {key} shapes {switch}, which is off: set {switch}: true, or drop {key}",
             (switch,)) for key, switch in SWITCHED.items()
            if key in fields and getattr(spec, key) != fields[key].default and not getattr(spec, switch)]


# keys naming modules of the model -> which names they may be (backend.core.model_modules.ModuleNames: validate
# reads them from the model's files; backend/training/adapters.py checks the loaded model the same way)
MODULE_KEYS = {"lora_target": "linear", "oft_target": "linear", "galore_target": "linear",
               "additional_target": "modules", "freeze_trainable_modules": "layer_parts",
               "freeze_extra_modules": "outer"}


# A method's own cross-field rules: spec -> [(field, message, other fields involved)]; spec.py calls them.
RULES = {"oft": _oft_errors}


def method_errors(spec) -> list[tuple[str, str, tuple[str, ...]]]:
    """The rules of the spec's finetuning_type (none for an unknown one: its Literal type refuses it), and the keys
    of a switch that is off, whatever the method."""
    rule = RULES.get(str(spec.finetuning_type or DEFAULT).lower())
    return (rule(spec) if rule else []) + _switched_errors(spec)


def field_applies(spec, name: str) -> bool:
    """Whether a spec field declared for some methods (`methods=[...]`, spec_key) applies to the
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
