"""How a spec key is declared (light: pydantic only). RunSpec (backend/core/spec.py) is assembled from key classes:
its own sections, each method's keys (backend/core/methods.py `METHOD_KEYS`) and each stage family's keys
(backend/stages/__init__.py `STAGE_KEYS`), so a method's or a stage's keys are declared beside it.

    class LoraKeys(Keys):
        lora_rank: int = spec_key(8, "LoRA rank r (adapter size).", "lora", methods=["lora"], ge=1)
"""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field


class Keys(BaseModel):
    """A section of RunSpec's keys; RunSpec inherits it (its fields, validators and properties). `comma_keys`: its
    keys that hold a comma-separated list (a YAML list is accepted and joined)."""

    comma_keys: ClassVar[tuple[str, ...]] = ()


def spec_key(default: Any, description: str, group: str, *, methods: list[str] | None = None,
             choices: tuple | None = None, refused: str | None = None, **constraints: Any) -> Any:
    """A field with its one-line description and the UI metadata (group, methods, the choices offered
    when they are fewer than the type allows). Which stages a field applies to is declared by the stages
    themselves (backend/stages). `refused`: a LLaMA-Factory key TuneBoard does not do; any value but the
    default is refused at validate with this reason (the form does not offer it)."""
    extra: dict[str, Any] = {"group": group}
    if refused is not None:
        extra["refused"] = refused
    if choices is not None:
        extra["choices"] = list(choices)
    if methods is not None:
        extra["methods"] = methods
    return Field(default, description=description, json_schema_extra=extra, **constraints)


def key_order(groups: tuple[str, ...], *sections: type[Keys]) -> tuple[type[Keys], ...]:
    """RunSpec's bases: the sections sorted by their group's place in `groups` (stable: in the given order within a
    group), reversed because pydantic lists the fields of the last base first. A section holds keys of one group."""
    def place(section: type[Keys]) -> int:
        found = {(f.json_schema_extra or {}).get("group") for f in section.model_fields.values()}
        if len(found) != 1:
            raise TypeError(f"{section.__name__}: a keys class holds the keys of one group (it has {sorted(found)})")
        return groups.index(found.pop())
    return tuple(reversed(sorted(sections, key=place)))
