"""Ollama `Modelfile` for an exported GGUF: FROM, TEMPLATE (Go template syntax), PARAMETER stop, SYSTEM.

Why derived by rendering: the chat template may be one of our named templates or the tokenizer's own
jinja, and both are only reliably known through what they render. We render probe conversations with
sentinel contents, cut the text into the pieces an Ollama template is made of (system prefix/suffix,
user prefix/suffix, assistant prefix/suffix, generation prompt), then re-render the same conversations
from those pieces exactly as the Go template would (`render_pieces`) and compare with the real
template. A mismatch is reported, never written silently.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

S, U, A, V = "SYSQZXK", "USRQZXK", "ASTQZXK", "VVVQZXK"


@dataclass
class Pieces:
    bos: str
    sys_pre: str
    sys_suf: str
    user_pre: str
    user_suf: str
    asst_pre: str
    asst_suf: str          # end-of-turn marker + separator, written when another message follows
    gen: str               # generation prompt after the last user message
    fold: bool = False     # system text goes inside the first user turn (sys_pre/sys_suf around it)
    default_system: str | None = None


class TemplateError(ValueError):
    pass


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def _bos_of(template, tokenizer) -> str:
    spec = getattr(template, "spec", None)
    if spec is not None:
        return spec.get("bos", "") or ""
    bos = getattr(tokenizer, "bos_token", None)
    source = getattr(template, "_source", "") or ""
    render = template.render_text(_msgs(("user", U)), add_generation_prompt=True)
    return bos if bos and "bos_token" in source and render.startswith(bos) else ""


def _cut(text: str, *marks: str) -> list[str]:
    """text split around each mark in order: [before m1, between m1 and m2, ..., after the last]."""
    out, pos = [], 0
    for m in marks:
        i = text.find(m, pos)
        if i < 0:
            raise TemplateError(f"probe content {m!r} missing from the rendered template")
        out.append(text[pos:i])
        pos = i + len(m)
    out.append(text[pos:])
    return out


def _strip_suffix(text: str, suffix: str, what: str) -> str:
    if suffix and not text.endswith(suffix):
        raise TemplateError(f"cannot isolate {what}: {text!r} does not end with {suffix!r}")
    return text[: len(text) - len(suffix)] if suffix else text


def derive_pieces(template, tokenizer=None) -> Pieces:
    """Cut the template's renders into Ollama template pieces (TemplateError if it has no such shape)."""
    def render(msgs, gen):
        return template.render_text(msgs, add_generation_prompt=gen)

    spec = getattr(template, "spec", None) or {}
    style = spec.get("system_style", "native")
    if style == "fold" and spec.get("system_fold", "first") != "first":
        raise TemplateError(f"template {template.name!r} folds the system prompt into the last user turn, "
                            "which an Ollama template cannot express")
    bos = _bos_of(template, tokenizer)
    x0, x1, x2, x3, x4 = _cut(render(_msgs(("system", S), ("user", U), ("assistant", A), ("user", V)), True), S, U, A, V)
    # x4 = user suffix + generation prompt; the cut is after the end-of-turn marker (either cut renders
    # the same text, this one reads like the family's own templates)
    user_suf = x4[: _after_stop(x4, template)] if spec.get("generation_prompt") is None else \
        _strip_suffix(x4, template.generation_prompt, "the user suffix")
    gen = x4[len(user_suf):]
    if not x2.startswith(user_suf):
        raise TemplateError(f"cannot isolate the assistant prefix from {x2!r}")
    asst_pre = x2[len(user_suf):]
    p0, _, _, _ = _cut(render(_msgs(("user", U), ("assistant", A), ("user", V)), True), U, A, V)
    if not p0.startswith(bos):
        raise TemplateError(f"render does not start with the BOS text {bos!r}")
    default_system = None
    if style == "fold":
        user_pre = p0[len(bos):]
        if not x0.startswith(bos + user_pre):
            raise TemplateError("cannot isolate the folded system prefix")
        sys_pre, sys_suf = x0[len(bos + user_pre):], x1
        asst_suf = _strip_suffix(x3, user_pre, "the assistant suffix")
        default_system = spec.get("default_system")
    else:
        sys_pre = x0[len(bos):]
        head = p0[len(bos):]
        if sys_pre and head.startswith(sys_pre) and head.endswith(x1):
            # a default system prompt was inserted: head = sys_pre + D + sys_suf + user_pre
            default_system, user_pre = _split_default(head[len(sys_pre):], x1, template)
        else:
            user_pre = head
        sys_suf = _strip_suffix(x1, user_pre, "the system suffix")
        asst_suf = _strip_suffix(x3, user_pre, "the assistant suffix")
        if spec and spec.get("default_system") is not None:
            default_system = spec["default_system"]
    return Pieces(bos, sys_pre, sys_suf, user_pre, user_suf, asst_pre, asst_suf, gen, style == "fold", default_system)


def _after_stop(text: str, template) -> int:
    """Index just past the first end-of-turn marker in text and the newlines after it (0 if none)."""
    for word in getattr(template, "stop_words", []) or []:
        i = text.find(word)
        if i >= 0:
            j = i + len(word)
            while j < len(text) and text[j] == "\n":
                j += 1
            return j
    return 0


def _split_default(rest: str, x1: str, template) -> tuple[str, str]:
    """rest = D + x1 where x1 = sys_suf + user_pre: find where sys_suf ends (after the first end-of-turn
    marker and the newlines after it)."""
    d = rest[: len(rest) - len(x1)]
    j = _after_stop(x1, template)
    if not j:
        raise TemplateError("cannot separate the default system prompt's end from the user prefix")
    return d, x1[j:]


def render_pieces(p: Pieces, system: str | None, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """What the Go template from `go_template(p)` renders for Ollama (.System + .Messages)."""
    out = [p.bos]
    if system and not p.fold:
        out.append(p.sys_pre + system + p.sys_suf)
    first = True
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        if m["role"] == "user":
            out.append(p.user_pre)
            if p.fold and system and first:
                out.append(p.sys_pre + system + p.sys_suf)
            first = False
            out.append(m["content"] + p.user_suf)
            if last and add_generation_prompt:
                out.append(p.gen)
        elif m["role"] == "assistant":
            out.append(p.asst_pre + m["content"] + ("" if last else p.asst_suf))
    return "".join(out)


def _lit(text: str) -> str:
    """Literal text inside a Go template (only `{{` needs escaping)."""
    return text.replace("{{", '{{ "{{" }}')


def go_template(p: Pieces) -> str:
    sys_block = "{{ if .System }}" + _lit(p.sys_pre) + "{{ .System }}" + _lit(p.sys_suf) + "{{ end }}"
    fold = ("{{ if and $.System $first }}" + _lit(p.sys_pre) + "{{ $.System }}" + _lit(p.sys_suf) + "{{ end }}"
            "{{ $first = false }}") if p.fold else ""
    return (
        _lit(p.bos) + ("" if p.fold else sys_block)
        + "{{ $first := true }}{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
        + '{{ if eq .Role "user" }}' + _lit(p.user_pre) + fold + "{{ .Content }}" + _lit(p.user_suf)
        + "{{ if $last }}" + _lit(p.gen) + "{{ end }}"
        + '{{ else if eq .Role "assistant" }}' + _lit(p.asst_pre) + "{{ .Content }}"
        + "{{ if not $last }}" + _lit(p.asst_suf) + "{{ end }}{{ end }}{{ end }}"
    )


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def modelfile_text(gguf_name: str, p: Pieces, stop_words: list[str]) -> str:
    lines = [f"FROM ./{gguf_name}", "", 'TEMPLATE """' + go_template(p) + '"""', ""]
    for word in stop_words:
        lines.append(f"PARAMETER stop {_quote(word)}")
    if p.default_system:
        lines += ["", "SYSTEM " + system_value(p.default_system)]
    return "\n".join(lines) + "\n"


def system_value(text: str) -> str:
    """SYSTEM's value, written so that Ollama's Modelfile parser reads `text` back. The parser has no escapes: a value
    in triple quotes ends at the first triple quote followed by white space, so a text holding one is written bare (one
    line, no quote first, no white space at its ends: kept as it is). TemplateError where neither form would do."""
    if not re.search(r'"""\s', text):
        return '"""' + text + '"""'
    if "\n" not in text and "\r" not in text and not text.startswith('"') and text == text.strip():
        return text
    raise TemplateError(f"the default system prompt {text[:60]!r} holds a triple quote and spans lines (or starts "
                        "with a quote): an Ollama Modelfile cannot hold it")


PROBES = [
    _msgs(("user", "Hello there")),
    _msgs(("system", "Be brief."), ("user", "What is 2+2?")),
    _msgs(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")),
    _msgs(("user", "Hi"), ("assistant", "Hello!"), ("user", "Name three colours")),
]


def check_pieces(p: Pieces, template) -> list[str]:
    """Conversations where the Ollama template would render differently from the real one ([] = none)."""
    bad = []
    for msgs in PROBES:
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else p.default_system
        rest = msgs[1:] if msgs[0]["role"] == "system" else msgs
        want = template.render_text(msgs, add_generation_prompt=True)
        got = render_pieces(p, system, rest)
        if got != want:
            bad.append(f"{[m['role'] for m in msgs]}: template {want!r} vs Modelfile {got!r}")
    return bad


def pieces_dict(p: Pieces) -> dict:
    return asdict(p)
