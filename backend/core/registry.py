"""The model registry (model_registry.yaml): which hub ids TuneBoard knows, their family, chat template and
whether each is an instruct model. Light (yaml only): backend.training.models resolves models through it and the UI
reads it for its model choices, so the file is parsed in this one place.

    load_registry()          {lowercased id: RegistryEntry}, in file order (per group: base, then instruct)
    lookup_registry(name)    entry for a hub id, or a folder / file name that contains an id's last part
    model_ids()              every id, per group instruct first (the order the UI lists them)
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REGISTRY_FILE = Path(__file__).with_name("model_registry.yaml")


@dataclass(frozen=True)
class RegistryEntry:
    model_id: str
    family: str
    template: str | None
    instruct: bool


@functools.lru_cache(maxsize=1)
def _groups() -> tuple[dict, ...]:
    groups = yaml.safe_load(REGISTRY_FILE.read_text(encoding="utf-8"))
    for i, group in enumerate(groups or []):
        if not isinstance(group, dict) or "family" not in group:
            raise ValueError(f"{REGISTRY_FILE}: group {i} needs a 'family' key")
    return tuple(groups or [])


@functools.lru_cache(maxsize=1)
def load_registry() -> dict[str, RegistryEntry]:
    """model_registry.yaml as {lowercased id: entry}."""
    entries: dict[str, RegistryEntry] = {}
    for group in _groups():
        for key, instruct in (("base", False), ("instruct", True)):
            for model_id in group.get(key) or []:
                entries[model_id.lower()] = RegistryEntry(model_id, group["family"], group.get("template"), instruct)
    return entries


def lookup_registry(name: str) -> RegistryEntry | None:
    """Registry entry for a hub id (case-insensitive), or for a folder / file name that contains an id's
    last component, e.g. 'SmolLM2-135M-Instruct.Q4_1.gguf' -> HuggingFaceTB/SmolLM2-135M-Instruct.
    The longest such component wins, so '...-Instruct' beats the base id it starts with."""
    registry = load_registry()
    key = name.strip().lower().rstrip("/")
    if key in registry:
        return registry[key]
    base = key.replace("\\", "/").rsplit("/", 1)[-1]
    best: RegistryEntry | None = None
    for model_id, entry in registry.items():
        last = model_id.rsplit("/", 1)[-1]
        # whole-word match: "qwen2.5-7b" must not match inside "qwen2.5-7b0" or "xqwen2.5-7b"
        if re.search(rf"(?<![a-z0-9]){re.escape(last)}(?![a-z0-9])", base):
            if best is None or len(last) > len(best.model_id.rsplit("/", 1)[-1]):
                best = entry
    return best


def model_ids() -> list[str]:
    """Every registered id, per group the instruct ids first."""
    ids: list[str] = []
    for group in _groups():
        for key in ("instruct", "base"):
            for model_id in group.get(key) or []:
                if model_id not in ids:
                    ids.append(model_id)
    return ids
