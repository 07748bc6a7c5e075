"""default_system in an export: chat, the API and training put it before every conversation that has no system
message (backend.serving.engine, backend.dataprep.data.add_default_system), so the exported model's chat template does
the same, as LLaMA-Factory's export writes it into the template. A named template carries it as its own default system
prompt (template_to_jinja writes it); the tokenizer's own jinja (template auto) gets a first line that puts the system
message in front. The Modelfile's SYSTEM comes from the same template (modelfile.derive_pieces)."""
from __future__ import annotations

import json

from backend.dataprep.templates import Template, TokenizerTemplate


def system_jinja(system: str) -> str:
    """The jinja line that puts `system` before a conversation without a system message (JSON escapes are jinja's)."""
    return ("{%- if messages and messages[0]['role'] != 'system' %}{%- set messages = [{'role': 'system', 'content': "
            + json.dumps(system) + "}] + messages %}{%- endif %}")


def with_default_system(template, tokenizer, system: str | None):
    """`template` rendering `system` as the system message of a conversation that has none (as it is, for none).
    The tokenizer's chat_template is changed for template auto: it is what the export ships."""
    if not system:
        return template
    if isinstance(template, Template):
        return Template(template.name, {**template.spec, "default_system": system})
    if isinstance(template, TokenizerTemplate) and isinstance(tokenizer.chat_template, str):
        tokenizer.chat_template = system_jinja(system) + tokenizer.chat_template
        return TokenizerTemplate(tokenizer, enable_thinking=template.enable_thinking)
    raise ValueError("default_system: the tokenizer's chat template is not one jinja text, so the system prompt "
                     "cannot be written into the exported template; use a named template")
