"""Chat templates: how a conversation becomes text, and which spans of it the model learns.

A template is a small data file `templates/<name>.yaml` (the schema is `_KEYS` below and
templates/README.md); all logic lives here. `Template.render` turns an OpenAI-style message list
into ordered `Segment`s whose texts concatenate to exactly the string the family's official chat
template produces, with `trained=True` on what the model must learn to emit: each assistant turn's
content and the end-of-turn marker right after it. Preprocessing tokenizes the joined text once and
labels tokens by character offsets, so masks never depend on pad/eos ids.

`get_template("auto", tokenizer)` wraps the tokenizer's own jinja chat template
(`TokenizerTemplate`) behind the same API, finding the trained spans by rendering the conversation
incrementally.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from backend.core.paths import TEMPLATES_DIR

ROLES = ("system", "user", "assistant", "tool")
SEGMENT_ROLES = ("bos", "system", "user", "assistant", "tool", "scaffold", "generation_prompt")


@dataclass
class Segment:
    """One contiguous piece of rendered text. `trained` pieces get real labels, the rest -100."""

    text: str
    trained: bool
    role: str


# ----------------------------------------------------------------------------------------- schema
# Every key a template file may have, with its default. Strings may use the placeholders
# {bos_token} / {eos_token} (filled from the tokenizer when one is given, else from `tokens`);
# formats use {content} (and {tools} / {json} / {name} / {arguments} where noted).
_KEYS: dict[str, Any] = {
    "name": None,                 # must equal the file name when present
    "family": "",                 # model family this format belongs to (informational)
    "notes": "",                  # where the format comes from, deviations, caveats
    "tokens": {},                 # defaults for {bos_token}/{eos_token} when no tokenizer is given
    "bos": "",                    # text emitted once at the very start (e.g. "<|begin_of_text|>")
    "bos_each_user_turn": False,  # llama2: the BOS text is repeated before every later user turn
    "system_style": "native",     # native | fold (merged into a user turn) | none (system is an error)
    "system": "{content}",        # native: the whole system turn; fold: the text put before the user content
    "system_fold": "first",       # fold: which user turn gets the system text: first | last
    "default_system": None,       # used when the conversation has no system message
    "user": "{content}",          # a user turn, markers included
    "assistant_prefix": "",       # role header before the assistant content (untrained)
    "assistant_content": "{content}",  # trained wrapper of the content (e.g. " {content}" when the model emits the space)
    "assistant_suffix": "",       # end-of-turn marker right after the content (TRAINED)
    "separator": "",              # untrained text after the end-of-turn marker (e.g. "\n")
    "trailing_separator": True,   # False: no separator after the final message (olmo2)
    "generation_prompt": None,    # text that opens the model's turn at inference; default assistant_prefix
    "end": "",                    # untrained text after a complete conversation (phi3's eos); not with a generation prompt
    "strip": [],                  # roles whose content is whitespace-trimmed, as the official template does
    "tool": None,                 # a tool-result turn ({content}); default: formatted like a user turn
    "tool_group": None,           # {prefix, item, suffix}: consecutive tool results share one turn (qwen)
    "tool_call": None,            # how an assistant turn calls tools (see _TOOL_CALL_KEYS); default JSON lines
    "tools": None,                # how the tool list is shown to the model (see _TOOLS_KEYS); default: JSON in the system prompt
    "thinking": None,             # qwen3 reasoning block: {open, close, trained}
    "stop_words": [],             # end-of-turn strings that end generation
}
_TOOL_CALL_KEYS = {
    "item": "{json}",             # one call; {json} = {"name": ..., "<arguments_key>": ...} (or the whole list when list: true)
    "join": "\n",                 # between calls
    "content_join": "\n",         # between the text content and the first call, when both exist
    "list": False,                # true: all calls of a turn as one JSON list in a single item
    "arguments_key": "arguments",  # llama3 uses "parameters"
    "prefix": None,               # assistant header used instead of assistant_prefix on tool-calling turns
    "content": None,              # trained wrapper instead of assistant_content on tool-calling turns
}
_TOOLS_KEYS = {
    "text": "{tools}",            # the block that presents the tools; {tools} = the items joined
    "item": "{json}",             # one tool; {json} = the tool schema as JSON
    "join": "\n",
    "list": False,                # true: {tools} is one JSON list of all tools
    "indent": None,               # JSON indent for each tool
    "wrap": True,                 # wrap schemas as {"type": "function", "function": schema} (OpenAI style)
    "position": "system",         # system (merged into the system content) | start (own block after BOS) | before_last_user
    "order": "system_first",      # system position: system_first | tools_first
    "system_join": "\n\n",        # between the system content and the tools block
}
_THINKING_KEYS = {"open": "<think>\n", "close": "\n</think>\n\n", "trained": True}
_TOOL_GROUP_KEYS = {"prefix": "", "item": "{content}", "suffix": ""}

# Documented fallback for families without a native tool format: tools listed as JSON lines in
# the system prompt, each call a JSON object {"name", "arguments"} on its own line in the
# assistant turn, results in a turn formatted like a user turn (or the template's `tool`).
DEFAULT_TOOLS = {
    "text": (
        "You have access to the following tools:\n{tools}\n\n"
        "To call a tool, reply with one JSON object per call, each on its own line: "
        '{"name": <tool name>, "arguments": <arguments object>}. '
        "The results come back in the next turn."
    ),
    "item": "{json}",
    "join": "\n",
    "wrap": False,
}

_PLACEHOLDER = re.compile(r"\{(content|tools|json|name|arguments|bos_token|eos_token)\}")


def _fill(fmt: str, **values: str) -> str:
    """Replace only the known placeholders, so literal JSON braces in formats need no escaping."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), fmt)


def _tojson(obj: Any, indent: int | None = None) -> str:
    """What transformers' jinja `tojson` filter produces."""
    return json.dumps(obj, ensure_ascii=False, indent=indent)


# ----------------------------------------------------------------------------------- validation
def _normalize_calls(calls: Any, i: int) -> list[tuple[str, dict | str]]:
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"messages[{i}]: tool_calls must be a non-empty list")
    out = []
    for k, call in enumerate(calls):
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = call["function"]  # OpenAI wire form {"type": "function", "function": {...}}
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise ValueError(f"messages[{i}].tool_calls[{k}]: needs a non-empty string 'name'")
        out.append((call["name"], tool_arguments(call.get("arguments"), f"messages[{i}].tool_calls[{k}]")))
    return out


def tool_arguments(args: Any, where: str) -> dict:
    """A tool call's arguments as a dict: a dict as it is, a JSON object string parsed, None or "" -> {}.
    ValueError naming `where` otherwise."""
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: 'arguments' is not valid JSON ({exc.msg})") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}: 'arguments' must be a JSON object, got {type(args).__name__}")
    return args


def validate_messages(messages: Any, add_generation_prompt: bool = False) -> list[dict]:
    """Check order and shape; return clean copies {role, content, tool_calls?, reasoning_content?}.

    Rules: optional system first; then user, then alternating; an assistant turn follows a user
    or tool turn; tool turns follow an assistant turn that called tools (or another tool turn) and
    are followed by an assistant (or tool) turn; a training render ends with an assistant turn, a
    generation render does not."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    prev: dict | None = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: expected an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] ({role}): content must be a string, got {type(content).__name__}")
        clean: dict = {"role": role, "content": content}
        if m.get("tool_calls"):
            if role != "assistant":
                raise ValueError(f"messages[{i}]: only assistant turns may have tool_calls (this one is {role})")
            clean["tool_calls"] = _normalize_calls(m["tool_calls"], i)
        if isinstance(m.get("reasoning_content"), str):
            clean["reasoning_content"] = m["reasoning_content"]
        p = prev["role"] if prev else None
        if role == "system":
            if i != 0:
                raise ValueError(f"messages[{i}]: a system message must be the first message")
        elif role == "user":
            if p == "user":
                raise ValueError(f"messages[{i}]: two user turns in a row (messages[{i - 1}] is also user)")
            if p == "tool":
                raise ValueError(f"messages[{i}]: a user turn follows a tool result; an assistant turn must answer it first")
        elif role == "assistant":
            if p in (None, "system"):
                raise ValueError(f"messages[{i}]: the conversation must start with a user turn, not assistant")
            if p == "assistant":
                raise ValueError(f"messages[{i}]: two assistant turns in a row (messages[{i - 1}] is also assistant)")
        elif role == "tool":
            if not (p == "tool" or (p == "assistant" and "tool_calls" in prev)):
                raise ValueError(f"messages[{i}]: a tool result must follow an assistant turn with tool_calls")
        out.append(clean)
        prev = clean
    last = out[-1]["role"]
    if add_generation_prompt:
        if last == "assistant":
            raise ValueError(f"messages[{len(out) - 1}]: the conversation already ends with an assistant turn; "
                             "a generation prompt needs it to end with a user or tool turn")
        if last == "system":
            raise ValueError("messages[0]: a generation prompt needs at least one user turn after the system message")
    elif last != "assistant":
        raise ValueError(f"messages[{len(out) - 1}]: the conversation ends with a {last} turn, so there is no "
                         "assistant turn to train (render with add_generation_prompt=True for a prompt)")
    return out


def _finish(pieces: list[tuple[str, str, bool, int]], *, add_generation_prompt: bool, train_on_prompt: bool,
            mask_history: bool) -> list[Segment]:
    """pieces: (text, role, is_model_output, assistant_turn_number) -> segments with the mask applied."""
    last_turn = max((t for _, _, out, t in pieces if out), default=-1)
    segs = []
    for text, role, out, turn in pieces:
        if not text:
            continue
        if add_generation_prompt:
            trained = False
        elif train_on_prompt:
            trained = role != "bos"
        else:
            trained = out and (not mask_history or turn == last_turn)
        segs.append(Segment(text, trained, role))
    return segs


# ------------------------------------------------------------------------------------ templates
@dataclass
class Template:
    """A named chat format loaded from templates/<name>.yaml. See `_KEYS` for the fields."""

    name: str
    spec: dict = field(repr=False)

    @property
    def default_system(self) -> str | None:
        return self.spec["default_system"]

    @property
    def stop_words(self) -> list[str]:
        return list(self.spec["stop_words"])

    @property
    def system_style(self) -> str:
        return self.spec["system_style"]

    @property
    def generation_prompt(self) -> str:
        gp = self.spec["generation_prompt"]
        return self.spec["assistant_prefix"] if gp is None else gp

    # -- tools
    def _tools_cfg(self) -> dict:
        return {**_TOOLS_KEYS, **(self.spec["tools"] or DEFAULT_TOOLS)}

    def _tools_text(self, tools: list[dict]) -> str:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be a list of function schema objects")
        cfg = self._tools_cfg()
        schemas = [t if (not cfg["wrap"] or "type" in t) else {"type": "function", "function": t} for t in tools]
        if cfg["list"]:
            body = _fill(cfg["item"], json=_tojson(schemas, cfg["indent"]))
        else:
            body = cfg["join"].join(_fill(cfg["item"], json=_tojson(s, cfg["indent"])) for s in schemas)
        return _fill(cfg["text"], tools=body)

    def _calls_text(self, calls: list[tuple[str, dict]]) -> str:
        cfg = {**_TOOL_CALL_KEYS, **(self.spec["tool_call"] or {})}
        objs = [{"name": n, cfg["arguments_key"]: a} for n, a in calls]
        if cfg["list"]:
            return _fill(cfg["item"], json=_tojson(objs))
        return cfg["join"].join(
            _fill(cfg["item"], json=_tojson(o), name=o["name"], arguments=_tojson(o[cfg["arguments_key"]]))
            for o in objs)

    # -- rendering
    def render(self, messages, tools=None, *, add_generation_prompt=False, train_on_prompt=False,
               mask_history=False) -> list[Segment]:
        """Render `messages` (OpenAI roles) into segments; see the module docstring for the mask."""
        s = self.spec
        msgs = validate_messages(messages, add_generation_prompt)
        strip = set(s["strip"])

        def c(m):  # content as the official template sees it
            return m["content"].strip() if m["role"] in strip else m["content"]

        pieces: list[tuple[str, str, bool, int]] = []

        def add(text, role, out=False, turn=-1):
            pieces.append((text, role, out, turn))

        add(s["bos"], "bos")
        system = c(msgs[0]) if msgs[0]["role"] == "system" else s["default_system"]
        rest = msgs[1:] if msgs[0]["role"] == "system" else msgs
        tools_text = self._tools_text(tools) if tools else None
        tcfg = self._tools_cfg()
        if tools_text is not None and tcfg["position"] == "system":
            if system is None:
                system = tools_text
            elif tcfg["order"] == "tools_first":
                system = tools_text + tcfg["system_join"] + system if tcfg["system_join"] else tools_text + system
            else:
                system = system + tcfg["system_join"] + tools_text
        if tools_text is not None and tcfg["position"] == "start":
            add(tools_text, "system")
        fold_text = ""
        if system is not None:
            if s["system_style"] == "native":
                add(_fill(s["system"], content=system), "system")
            elif s["system_style"] == "fold":
                fold_text = _fill(s["system"], content=system)
            else:
                raise ValueError(f"template {self.name!r} has no system role; drop the system message "
                                 "or pick a template that supports one")

        user_idx = [j for j, m in enumerate(rest) if m["role"] == "user"]
        fold_at = (user_idx[0] if s["system_fold"] == "first" else user_idx[-1]) if user_idx else None
        last_query = user_idx[-1] if user_idx else -1
        turn = 0
        for j, m in enumerate(rest):
            role = m["role"]
            is_last = j == len(rest) - 1
            if role == "user":
                if tools_text is not None and tcfg["position"] == "before_last_user" and j == last_query:
                    add(tools_text, "system")
                if s["bos_each_user_turn"] and j != user_idx[0]:
                    add(s["bos"], "scaffold")
                self._add_user(add, c(m), fold_text if j == fold_at else "")
            elif role == "assistant":
                self._add_assistant(add, m, c(m), turn, after_last_query=j > last_query, is_last=is_last)
                turn += 1
                if not is_last or s["trailing_separator"]:
                    add(s["separator"], "scaffold")
            else:  # tool
                group = s["tool_group"]
                if group:
                    g = {**_TOOL_GROUP_KEYS, **group}
                    first = rest[j - 1]["role"] != "tool"
                    last_in_group = is_last or rest[j + 1]["role"] != "tool"
                    text = (g["prefix"] if first else "") + _fill(g["item"], content=m["content"])
                    add(text + (g["suffix"] if last_in_group else ""), "tool")
                else:
                    add(_fill(s["tool"] if s["tool"] is not None else s["user"], content=m["content"]), "tool")
        if add_generation_prompt:
            add(self.generation_prompt, "generation_prompt")
        else:
            add(s["end"], "scaffold")
        return _finish(pieces, add_generation_prompt=add_generation_prompt, train_on_prompt=train_on_prompt,
                       mask_history=mask_history)

    def _add_user(self, add, content: str, fold: str) -> None:
        text = _fill(self.spec["user"], content=fold + content)
        if not fold:
            add(text, "user")
            return
        k = _fill(self.spec["user"], content="\x00").index("\x00")  # where the content starts
        add(text[:k], "user")
        add(fold, "system")
        add(text[k + len(fold):], "user")

    def _split_thinking(self, m: dict, content: str) -> tuple[str | None, str]:
        """qwen3: reasoning from `reasoning_content` or a <think>...</think> block in the content."""
        th = {**_THINKING_KEYS, **self.spec["thinking"]}
        open_tag, close_tag = th["open"].strip(), th["close"].strip()
        if "reasoning_content" in m:
            return m["reasoning_content"], content
        if close_tag in content:
            reasoning = content.split(close_tag)[0].rstrip("\n").split(open_tag)[-1].lstrip("\n")
            return reasoning, content.split(close_tag)[-1].lstrip("\n")
        return None, content

    def _add_assistant(self, add, m: dict, content: str, turn: int, *, after_last_query: bool, is_last: bool) -> None:
        s = self.spec
        calls = m.get("tool_calls")
        cfg = {**_TOOL_CALL_KEYS, **(s["tool_call"] or {})}
        prefix = cfg["prefix"] if (calls and cfg["prefix"] is not None) else s["assistant_prefix"]
        add(prefix, "scaffold")
        if s["thinking"]:
            th = {**_THINKING_KEYS, **s["thinking"]}
            reasoning, content = self._split_thinking(m, content)
            # Official Qwen3 template: turns after the last user query show their reasoning block
            # (an empty one on the final turn); earlier turns drop it.
            if after_last_query and (is_last or reasoning):
                block = th["open"] + (reasoning or "").strip("\n") + th["close"]
                add(block, "assistant" if (th["trained"] or reasoning) else "scaffold", th["trained"] or bool(reasoning), turn)
                content = content.lstrip("\n")
        body = _fill(cfg["content"] if (calls and cfg["content"] is not None) else s["assistant_content"],
                     content=content) if (content or not calls) else ""
        if calls:
            body += (cfg["content_join"] if content else "") + self._calls_text(calls)
        add(body, "assistant", True, turn)
        add(s["assistant_suffix"], "assistant", True, turn)

    def render_text(self, messages, tools=None, **kw) -> str:
        return "".join(seg.text for seg in self.render(messages, tools, **kw))


# ------------------------------------------------------------------------------- loading files
def _check_keys(data: dict, allowed: dict, where: str) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(key, list(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: unknown key {key!r}{hint}")


@lru_cache(maxsize=None)
def _load_spec(path: str) -> dict:
    """Read and validate one template file (cached)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a template file must be a mapping of keys")
    _check_keys(data, _KEYS, str(p))
    if data.get("name") not in (None, p.stem):
        raise ValueError(f"{p}: name {data['name']!r} does not match the file name {p.stem!r}")
    for key, sub in (("tool_call", _TOOL_CALL_KEYS), ("tools", _TOOLS_KEYS), ("thinking", _THINKING_KEYS),
                     ("tool_group", _TOOL_GROUP_KEYS), ("tokens", {"bos_token": 0, "eos_token": 0})):
        if data.get(key) is not None:
            if not isinstance(data[key], dict):
                raise ValueError(f"{p}: {key!r} must be a mapping")
            _check_keys(data[key], sub, f"{p}: {key}")
    spec = {**_KEYS, **data}
    if spec["system_style"] not in ("native", "fold", "none"):
        raise ValueError(f"{p}: system_style must be native, fold or none (got {spec['system_style']!r})")
    if spec["system_fold"] not in ("first", "last"):
        raise ValueError(f"{p}: system_fold must be first or last (got {spec['system_fold']!r})")
    pos = (spec["tools"] or {}).get("position", "system")
    if pos not in ("system", "start", "before_last_user"):
        raise ValueError(f"{p}: tools.position must be system, start or before_last_user (got {pos!r})")
    bad = [r for r in spec["strip"] if r not in ROLES]
    if bad:
        raise ValueError(f"{p}: strip lists unknown roles {bad}")
    for key in ("user", "system", "assistant_content"):
        if "{content}" not in spec[key]:
            raise ValueError(f"{p}: {key!r} must contain {{content}}")
    return spec


def _resolve_tokens(obj: Any, values: dict[str, str]) -> Any:
    if isinstance(obj, str):
        return _fill(obj, **values)
    if isinstance(obj, list):
        return [_resolve_tokens(x, values) for x in obj]
    if isinstance(obj, dict):
        return {k: _resolve_tokens(v, values) for k, v in obj.items()}
    return obj


def list_templates() -> list[str]:
    """Names of the template files (sorted). "auto" (the tokenizer's own chat template) is not a file."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.yaml"))


def get_template(name: str, tokenizer=None) -> Template | "TokenizerTemplate":
    """A named template (templates/<name>.yaml) or, for "auto", the tokenizer's own chat template.

    With a tokenizer, {bos_token}/{eos_token} in generic templates (default, alpaca, vicuna) become
    that tokenizer's tokens."""
    if name == "auto":
        if tokenizer is None:
            raise ValueError('template "auto" needs a tokenizer (it uses the tokenizer\'s own chat template)')
        return TokenizerTemplate(tokenizer)
    names = list_templates()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown template {name!r}{hint} (available: auto, {', '.join(names)})")
    spec = _load_spec(str(TEMPLATES_DIR / f"{name}.yaml"))
    values = {k: str(v) for k, v in (spec["tokens"] or {}).items()}
    for key in ("bos_token", "eos_token"):
        tok = getattr(tokenizer, key, None) if tokenizer is not None else None
        if isinstance(tok, str) and tok:
            values[key] = tok
    values.setdefault("bos_token", "")
    values.setdefault("eos_token", "")
    return Template(name, _resolve_tokens(spec, values))


def with_thinking(template, enable_thinking: bool | None):
    """The template for LLaMA-Factory's `enable_thinking` (None/True: the template as it is). False, on a
    reasoning template (qwen3): the empty think block goes into the prompt (the generation prompt ends with
    it, and in training rows it is untrained scaffold), so the model learns to answer without thinking;
    rows that do carry reasoning keep it trained. This is exactly templates/qwen3_nothink.yaml. On the
    tokenizer's own template ("auto"), False is passed to apply_chat_template as enable_thinking (Qwen3's
    jinja reads it). A template without a reasoning switch: ValueError (nothing would change)."""
    if enable_thinking is not False:
        return template
    if isinstance(template, TokenizerTemplate):
        if "enable_thinking" not in template._source:
            raise ValueError("enable_thinking: false: the tokenizer's chat template has no enable_thinking switch "
                             "(nothing would change); drop enable_thinking or use a reasoning template (qwen3)")
        return TokenizerTemplate(template.tokenizer, enable_thinking=False)
    thinking = template.spec["thinking"]
    if not thinking:
        raise ValueError(f"enable_thinking: false: template {template.name!r} has no reasoning (think) block "
                         "(nothing would change); drop enable_thinking or use a reasoning template (qwen3)")
    th = {**_THINKING_KEYS, **thinking}
    spec = {**template.spec, "thinking": {**th, "trained": False},
            "generation_prompt": template.generation_prompt + th["open"] + th["close"]}
    return Template(template.name, spec)


# ---------------------------------------------------------------------------- tokenizer's own
# End-of-turn markers of common families: the trained span of an assistant turn extends over the
# first one that follows the content (besides the tokenizer's eos_token).
KNOWN_EOT = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|END_OF_TURN_TOKEN|>",
             "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>", "<|eot|>")


class TokenizerTemplate:
    """Template "auto": the tokenizer's jinja chat_template, with segments found incrementally.

    For assistant turn i, `render(messages[:i], add_generation_prompt=True)` is the prompt the model
    sees; everything after it up to the end of the content and the end-of-turn marker that follows
    is what the model emits (trained). The rest (role headers, newlines) is not."""

    name = "auto"
    system_style = "native"
    default_system = None

    def __init__(self, tokenizer, enable_thinking: bool | None = None):
        self.enable_thinking = enable_thinking  # passed to the jinja template when set (see with_thinking)
        template = getattr(tokenizer, "chat_template", None)
        if not template or not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("the tokenizer has no chat_template; use a named template (see list_templates())")
        self.tokenizer = tokenizer
        self._source = template if isinstance(template, str) else json.dumps(template)
        eos = getattr(tokenizer, "eos_token", None)
        self._eot = tuple(dict.fromkeys(([eos] if eos else []) + [m for m in KNOWN_EOT if m in self._source]))
        self.stop_words = list(self._eot[:1]) + [m for m in self._eot[1:] if m in self._source]

    def _apply(self, msgs, tools, agp) -> str:
        if not msgs:
            return ""
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        out = self.tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False, add_generation_prompt=agp,
                                                 **extra)
        return out if isinstance(out, str) else out[0]

    @staticmethod
    def _hf(m: dict) -> dict:
        out = {"role": m["role"], "content": m["content"]}
        if "tool_calls" in m:
            out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in m["tool_calls"]]
        if "reasoning_content" in m:
            out["reasoning_content"] = m["reasoning_content"]
        return out

    def render(self, messages, tools=None, *, add_generation_prompt=False, train_on_prompt=False,
               mask_history=False) -> list[Segment]:
        msgs = [self._hf(m) for m in validate_messages(messages, add_generation_prompt)]
        full = self._apply(msgs, tools, add_generation_prompt)
        # message boundaries where the render is prefix-stable, to label prompt pieces by role
        cuts: list[tuple[int, str, bool, int]] = []  # (position, role of text from here, output?, turn)
        bos = getattr(self.tokenizer, "bos_token", None)
        pos0 = 0
        if bos and "bos_token" in self._source and full.startswith(bos):
            cuts.append((0, "bos", False, -1))
            pos0 = len(bos)
        cuts.append((pos0, msgs[0]["role"], False, -1))
        turn = 0
        for i, m in enumerate(msgs):
            before = self._apply(msgs[:i], tools, False)
            if i and full.startswith(before) and len(before) >= cuts[-1][0]:
                cuts.append((max(len(before), pos0), m["role"] if m["role"] != "assistant" else "scaffold", False, -1))
            if m["role"] != "assistant":
                continue
            prompt = self._apply(msgs[:i], tools, True)
            if not full.startswith(prompt):
                raise ValueError(f"the tokenizer's chat template does not render messages[{i}] after the prompt it "
                                 "renders for it (not prefix-stable); use a named template")
            start = len(prompt)
            content = m["content"].strip()
            cend = full.find(content, start) + len(content) if content else start
            if content and cend < len(content) + start:
                raise ValueError(f"messages[{i}]: assistant content not found in the tokenizer's render")
            through = self._apply(msgs[: i + 1], tools, False)
            turn_end = len(through) if full.startswith(through) else None
            end = cend
            hits = [(full.find(t, cend), t) for t in self._eot if full.find(t, cend) >= 0]
            if hits:
                p, t = min(hits)
                if turn_end is None or p + len(t) <= turn_end:
                    end = p + len(t)
            elif turn_end is not None:
                end = max(cend, len(full[:turn_end].rstrip("\n")))
            cuts.append((start, "assistant", True, turn))
            cuts.append((end, "scaffold", False, -1))
            turn += 1
        if add_generation_prompt:
            base = self._apply(msgs, tools, False)
            if full.startswith(base) and len(base) >= cuts[-1][0]:
                cuts.append((len(base), "generation_prompt", False, -1))
        pieces = []
        for k, (p, role, out, t) in enumerate(cuts):
            nxt = cuts[k + 1][0] if k + 1 < len(cuts) else len(full)
            pieces.append((full[p:nxt], role, out, t))
        segs = _finish(pieces, add_generation_prompt=add_generation_prompt, train_on_prompt=train_on_prompt,
                       mask_history=mask_history)
        assert "".join(x.text for x in segs) == full
        return segs

    def render_text(self, messages, tools=None, **kw) -> str:
        return "".join(seg.text for seg in self.render(messages, tools, **kw))


# --------------------------------------------------------------------------------- export to jinja
def _lit(s: str) -> str:
    """A jinja string literal for s (JSON escapes are valid jinja escapes)."""
    return json.dumps(s)


def _split_content(fmt: str, key: str, name: str) -> tuple[str, str]:
    parts = fmt.split("{content}")
    if len(parts) != 2:
        raise NotImplementedError(f"template {name!r}: {key} must contain {{content}} exactly once for jinja export")
    return parts[0], parts[1]


def template_to_jinja(template: Template) -> str:
    """A Hugging Face chat_template (jinja) that renders plain conversations (system/user/assistant/
    tool turns, generation prompt) exactly as `template.render_text` does, to save with an exported
    model. Tool schemas and tool_calls are not rendered by it (assistant content only), and templates
    with a reasoning block (qwen3) are not exportable: NotImplementedError."""
    s = template.spec
    if s["thinking"]:
        raise NotImplementedError(f"template {template.name!r} has a reasoning block; keep the model's own chat template")
    strip = set(s["strip"])

    def content(role: str) -> str:
        return "message['content'] | trim" if role in strip else "message['content']"

    u_pre, u_suf = _split_content(s["user"], "user", template.name)
    sys_pre, sys_suf = _split_content(s["system"], "system", template.name)
    a_pre, a_suf = _split_content(s["assistant_content"], "assistant_content", template.name)
    sys_val = "messages[0]['content'] | trim" if "system" in strip else "messages[0]['content']"
    default = _lit(s["default_system"]) if s["default_system"] is not None else "none"
    j = [
        "{%- if messages[0]['role'] == 'system' -%}",
        f"{{%- set system_message = {sys_val} -%}}{{%- set loop_messages = messages[1:] -%}}",
        f"{{%- else -%}}{{%- set system_message = {default} -%}}{{%- set loop_messages = messages -%}}{{%- endif -%}}",
        "{%- set ns = namespace(fold=-1, first=-1) -%}",
        "{%- for m in loop_messages -%}{%- if m['role'] == 'user' -%}",
        "{%- if ns.first == -1 -%}{%- set ns.first = loop.index0 -%}{%- endif -%}",
        "{%- if ns.fold == -1 or " + ("true" if s["system_fold"] == "last" else "false")
        + " -%}{%- set ns.fold = loop.index0 -%}{%- endif -%}",
        "{%- endif -%}{%- endfor -%}",
        f"{{{{- {_lit(s['bos'])} -}}}}",
    ]
    if s["system_style"] == "native":
        j.append(f"{{%- if system_message is not none -%}}{{{{- {_lit(sys_pre)} + system_message + {_lit(sys_suf)} -}}}}"
                 "{%- endif -%}")
    elif s["system_style"] == "none":
        j.append("{%- if system_message is not none -%}{{- raise_exception('this template has no system role') -}}"
                 "{%- endif -%}")
    j.append("{%- for message in loop_messages -%}")
    # user
    j.append("{%- if message['role'] == 'user' -%}")
    if s["bos_each_user_turn"]:
        j.append(f"{{%- if loop.index0 != ns.first -%}}{{{{- {_lit(s['bos'])} -}}}}{{%- endif -%}}")
    j.append(f"{{%- set content = {content('user')} -%}}")
    if s["system_style"] == "fold":
        j.append("{%- if loop.index0 == ns.fold and system_message is not none -%}"
                 f"{{%- set content = {_lit(sys_pre)} + system_message + {_lit(sys_suf)} + content -%}}{{%- endif -%}}")
    j.append(f"{{{{- {_lit(u_pre)} + content + {_lit(u_suf)} -}}}}")
    # assistant
    j.append("{%- elif message['role'] == 'assistant' -%}")
    j.append(f"{{{{- {_lit(s['assistant_prefix'])} + {_lit(a_pre)} + {content('assistant')} + {_lit(a_suf)}"
             f" + {_lit(s['assistant_suffix'])} -}}}}")
    if s["trailing_separator"]:
        j.append(f"{{{{- {_lit(s['separator'])} -}}}}")
    else:
        j.append(f"{{%- if not loop.last -%}}{{{{- {_lit(s['separator'])} -}}}}{{%- endif -%}}")
    # tool
    j.append("{%- elif message['role'] == 'tool' -%}")
    if s["tool_group"]:
        g = {**_TOOL_GROUP_KEYS, **s["tool_group"]}
        i_pre, i_suf = _split_content(g["item"], "tool_group.item", template.name)
        j.append("{%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' -%}"
                 f"{{{{- {_lit(g['prefix'])} -}}}}{{%- endif -%}}")
        j.append(f"{{{{- {_lit(i_pre)} + message['content'] + {_lit(i_suf)} -}}}}")
        j.append("{%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' -%}"
                 f"{{{{- {_lit(g['suffix'])} -}}}}{{%- endif -%}}")
    else:
        t_pre, t_suf = _split_content(s["tool"] if s["tool"] is not None else s["user"], "tool", template.name)
        j.append(f"{{{{- {_lit(t_pre)} + message['content'] + {_lit(t_suf)} -}}}}")
    j.append("{%- endif -%}{%- endfor -%}")
    j.append(f"{{%- if add_generation_prompt -%}}{{{{- {_lit(template.generation_prompt)} -}}}}"
             f"{{%- else -%}}{{{{- {_lit(s['end'])} -}}}}{{%- endif -%}}")
    return "".join(j)
