"""Which chat template a run uses (shared by train, preview and chat, so all three agree)."""
from __future__ import annotations

from typing import Callable
from backend.dataprep.templates import with_thinking, get_template

# Templates that carry no chat markers: using them on a base model is expected, not a mistake.
PLAIN_TEMPLATES = {"default", "empty", "alpaca", "vicuna"}


def pick_template(name: str, resolved, tokenizer, warn: Callable[[str], None] = print,
                  enable_thinking: bool | None = True):
    """`auto`: the tokenizer's own chat template, else the registry's template for the model,
    else `default` with a warning. A named template is used as is, with a warning when an
    instruct template is put on a model the registry knows as a base model. enable_thinking: false puts the
    empty think block of a reasoning template into the prompt (backend.dataprep.templates.with_thinking)."""

    return with_thinking(_pick(name, resolved, tokenizer, warn), enable_thinking)


def _pick(name: str, resolved, tokenizer, warn: Callable[[str], None]):
    registry_template = getattr(resolved, "template", None)
    if name == "auto":
        if getattr(tokenizer, "chat_template", None):
            return get_template("auto", tokenizer)
        if registry_template:
            return get_template(registry_template)
        warn(
            f"template auto: {getattr(resolved, 'model_id', 'the model')} has no chat template and is not in "
            "the model registry: using the 'default' template (set `template:` to the model's family)"
        )
        return get_template("default")
    template = get_template(name)
    if getattr(resolved, "instruct", None) is False and name not in PLAIN_TEMPLATES:
        warn(
            f"template {name} is an instruct (chat) template but {resolved.model_id} is a base model: "
            "it has never seen these markers; fine for teaching a chat format, unexpected otherwise"
        )
    return template
