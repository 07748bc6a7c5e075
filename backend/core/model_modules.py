"""The module names a model has, read from its files without loading it (config.json and the safetensors headers'
tensor tables), so `validate` refuses a target that names no module of the model (lora_target: q_prj) instead of
a run that stops after launch. backend/training/adapters.py checks the same names on the loaded model; this reads
a superset of what it accepts (a name it would refuse may pass here, never the other way round).

    linear       short names of the 2-D weights but the embedding and the output head (rows = the vocabulary):
                 what lora_target / oft_target / galore_target may name (the loader: every nn.Linear but the head)
    modules      short names of every module holding weights, and of the modules above them (additional_target)
    layer_parts  a decoder layer's children holding weights: self_attn, mlp, ... (freeze_trainable_modules)
    outer        modules with weights outside the decoder layers: embed_tokens, norm, lm_head (freeze_extra_modules)

A .gguf model is read from its converted folder (backend.training.models.materialize_gguf, after its first use);
a model whose weights are not safetensors, or not converted yet, is not read (the loader checks the names).
Light: standard library only."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from backend.core import model_files

_LAYER = re.compile(r"^(.+?)\.(\d+)\.([^.]+)\.")


@dataclass(frozen=True)
class ModuleNames:
    linear: frozenset[str]
    modules: frozenset[str]
    layer_parts: frozenset[str]
    outer: frozenset[str]


def _tensors(folder: Path) -> dict[str, list[int]]:
    """Every tensor's name and shape in a folder's safetensors files (their JSON headers only)."""
    found: dict[str, list[int]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        found.update({k: v.get("shape", []) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)})
    return found


def _text_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def names_in_folder(folder: Path) -> ModuleNames | None:
    """The module names of a model folder (config.json + safetensors), or None where they cannot be read."""
    try:
        config = _text_config(folder)
        tensors = _tensors(folder)
    except (OSError, ValueError, AttributeError):
        return None
    if not tensors:
        return None
    vocab, layers = config.get("vocab_size"), config.get("num_hidden_layers")
    modules = {part for name in tensors for part in name.split(".")[:-1] if not part.isdigit()}
    linear = {name.split(".")[-2] for name, shape in tensors.items()
              if name.endswith(".weight") and len(shape) == 2 and shape[0] != vocab and name.count(".") >= 1}
    stacks: dict[str, set[int]] = {}
    for name in tensors:
        match = _LAYER.match(name)
        if match:
            stacks.setdefault(match[1], set()).add(int(match[2]))
    decoder = [prefix for prefix, ids in stacks.items() if len(ids) == layers]
    tied = config.get("tie_word_embeddings", True) is not False  # a tied head holds the embedding's weight
    extra = {"lm_head"} if tied else set()
    if len(decoder) != 1:
        return ModuleNames(frozenset(linear), frozenset(modules | extra), frozenset(), frozenset())
    prefix = decoder[0] + "."
    parts = {m[3] for name in tensors if (m := _LAYER.match(name)) and m[1] == decoder[0] and m[2] == "0"}
    outer = {name.rsplit(".", 2)[-2] for name in tensors if not name.startswith(prefix) and name.count(".") >= 1}
    return ModuleNames(frozenset(linear), frozenset(modules | extra), frozenset(parts), frozenset(outer | extra))


def model_folder(name: str) -> Path | None:
    """The folder holding model `name`'s config.json and safetensors, where one is on this machine
    (backend.core.model_files.locate; a .gguf model's converted folder after its first use); else None."""
    try:
        folder, gguf = model_files.locate(name)
        if gguf:
            folder = model_files.gguf_cache_folder(folder / gguf)
    except (OSError, ValueError):
        return None
    return folder if (folder / "config.json").is_file() else None


def hidden_size(model: str) -> int | None:
    """The width of `model`'s hidden states (config.json's hidden_size, a multimodal model's text part), where its
    folder is on this machine; else None."""
    folder = model_folder(model)
    try:
        value = _text_config(folder).get("hidden_size") if folder else None
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def unknown_names(model: str, wanted: dict[str, tuple[list[str], str]]) -> list[tuple[str, str]]:
    """(key, message) for each key whose names are not modules of `model`: wanted maps a key to (its names, which
    ModuleNames set they come from). Nothing when the model's names cannot be read here."""
    folder = model_folder(model)
    names = names_in_folder(folder) if folder is not None else None
    if names is None:
        return []
    errors = []
    for key, (given, kind) in wanted.items():
        available = getattr(names, kind)
        unknown = [g for g in given if g not in available]
        if unknown and available:
            errors.append((key, f"unknown module{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                           f"in {model}; available: {', '.join(sorted(available))}"))
    return errors
