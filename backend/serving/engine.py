"""Inference engine shared by `tuneboard chat`, `tuneboard api` and (through the API) the Chat tab.

    Engine (protocol)        chat(messages, tools=None, **sampling) -> Reply
                             stream(messages, tools=None, stop_event=None, **sampling) -> Stream (iterates text)
    HFEngine                 transformers `generate`; streaming through TextIteratorStreamer in a thread
    VLLMEngine               vLLM, used only when it imports and a CUDA GPU is present
    LlamaCppEngine           llama.cpp on a GGUF file (infer_backend llamacpp, the llamacpp extra)
    load_engines(spec, ...)  {served name: engine}: the base model and every adapter, sharing one base

The prompt is rendered by the same template code as training (backend.dataprep.templates) and tokenized with
add_special_tokens=False, so the BOS the template writes is the only one. Generation ends on the
template's end-of-turn tokens (single-token stop words + the tokenizer's eos), on stop strings
(multi-token stop words and the request's `stop`), at max_new_tokens, when `stop_event` is set, or once
`time_limit` seconds have passed since the call (finish_reason "time_limit"). `max_tokens_cap` bounds
max_new_tokens per call (a server's operator limit): asked above it is a TokenCapError, left out it is cut.

Several adapters of one base share its weights: they are loaded as named peft adapters on one PeftModel
and each engine activates its own while it holds the model's turn (the base engine runs with adapters
disabled). A comma-separated stack of adapters is merged into its own copy of the base, as in training.

Requests on one model loaded by load_engines share its decode steps (backend.serving.batching.Batcher,
continuous batching): a request joins the running batch when it arrives and leaves it when it ends, and
gets the tokens `generate` would give it alone. An HFEngine without a batcher (built directly, or a model whose
cache the batch cannot stack) takes turns instead (backend.training.scheduler.TurnLock): each generation is
transformers' own `generate` with its own KV cache in its own thread, and hands the model to the next waiting
request every TOKENS_PER_TURN tokens from its StoppingCriteria, so a short request is never stuck behind a long one.
"""
from __future__ import annotations

import copy
import json
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import yaml

from backend.core.methods import method_of_adapter
from backend.dataprep.resolve import pick_template
from backend.core.rundir import SPEC_FILE
from backend.training.scheduler import TOKENS_PER_TURN, TurnLock
from backend.serving.batching import Batcher, Job, TokenPenalties, batchable
from backend.serving.llamacpp_model import LlamaTokenPenalties, open_llama
from backend.dataprep.templates import get_template

Warn = Callable[[str], None]

SAMPLING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop",
                 "fit_context", "frequency_penalty", "presence_penalty", "logit_bias")


# ------------------------------------------------------------------------------------------ results
@dataclass
class Reply:
    """One finished answer. tool_calls are in OpenAI's wire form:
    {"id": "call_...", "type": "function", "function": {"name": str, "arguments": JSON string}}.
    finish_reason: "stop" (end of turn or a stop string), "length" (max_new_tokens), "tool_calls",
    "abort" (stop_event was set) or "time_limit" (the call's time_limit ran out first)."""

    text: str
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the generated tokens (end-of-turn included), for logprobs


@dataclass
class TokenLogprob:
    """One token of a scored sequence: its log-probability given the tokens before it (None for the first,
    which nothing predicts) and the `top` most likely tokens there, as (token id, logprob), best first."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


class Stream:
    """Iterates the answer's text pieces as they are generated; `reply` is set once it is exhausted.
    Closing it early (break, or garbage collection) stops the generation."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.reply: Reply | None = None
        self._thread: threading.Thread | None = None
        self._criteria = None

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    def join(self, timeout: float | None = None) -> int | None:
        """Wait for the generation thread to end (after a stop_event, say); the number of tokens it
        generated, or None if it is still running after `timeout`."""
        thread = self._thread
        if thread is not None and thread.ident is not None:  # started
            thread.join(timeout)
            if thread.is_alive():
                return None
        if self._criteria is not None:
            return self._criteria.generated
        return self.reply.completion_tokens if self.reply else 0


class Engine(Protocol):
    name: str

    def chat(self, messages: list[dict], tools: list[dict] | None = None, *,
             stop_event: threading.Event | None = None, time_limit: float | None = None,
             max_tokens_cap: int | None = None, **sampling: Any) -> Reply: ...

    def stream(self, messages: list[dict], tools: list[dict] | None = None, *,
               stop_event: threading.Event | None = None, time_limit: float | None = None,
               max_tokens_cap: int | None = None, **sampling: Any) -> Stream: ...


# ----------------------------------------------------------------------------------------- sampling
@dataclass
class Sampling:
    """Generation settings. do_sample None: sample when temperature > 0. frequency_penalty, presence_penalty and
    logit_bias ({token id: bias}) are OpenAI's: counted over the generated tokens only (batching.TokenPenalties)."""

    max_new_tokens: int = 512
    do_sample: bool | None = None
    temperature: float = 0.95
    top_p: float = 0.7
    top_k: int = 50
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    fit_context: bool = False  # max_new_tokens is a ceiling: cut to what the context leaves, never refused for it
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.do_sample is False or self.temperature == 0


def sampling_defaults(spec: Any) -> dict:
    """The generation keys of a RunSpec (or any object with those attributes)."""
    out = {}
    for key in ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty"):
        value = getattr(spec, key, None)
        if value is not None:
            out[key] = value
    return out


def make_sampling(defaults: dict, given: dict) -> Sampling:
    """defaults (from the spec) overridden by the non-None `given` values; ValueError names a bad key."""
    unknown = sorted(set(given) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown sampling option(s) {', '.join(unknown)} (known: {', '.join(SAMPLING_KEYS)})")
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    stop = values.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError("stop: must be a string or a list of strings")
    values["stop"] = [s for s in stop if s]
    values["logit_bias"] = _logit_bias(values.get("logit_bias"))
    s = Sampling(**values)
    checks = [("max_new_tokens", s.max_new_tokens >= 1, "must be >= 1"),
              ("temperature", s.temperature >= 0, "must be >= 0"),
              ("top_p", 0 < s.top_p <= 1, "must be in (0, 1]"),
              ("top_k", s.top_k >= 0, "must be >= 0"),
              ("repetition_penalty", s.repetition_penalty > 0, "must be > 0"),
              ("frequency_penalty", -2 <= s.frequency_penalty <= 2, "must be in [-2, 2]"),
              ("presence_penalty", -2 <= s.presence_penalty <= 2, "must be in [-2, 2]")]
    for name, ok, why in checks:
        if not ok:
            raise ValueError(f"{name}: {why} (got {getattr(s, name)!r})")
    return s


def _logit_bias(given) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}, the ids written as strings in JSON; ints taken too) as {id: bias};
    ValueError naming the key that is no token id or whose bias is not a number in [-100, 100]."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ValueError("logit_bias: must be a map of token ids to biases, such as {\"42\": -100}")
    out = {}
    for key, bias in given.items():
        if isinstance(key, bool) or not (isinstance(key, int) and key >= 0 or
                                         isinstance(key, str) and re.fullmatch(r"[0-9]+", key)):
            raise ValueError(f"logit_bias: key {key!r} is not a token id (a whole number from 0, as a string)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias: the bias of key {key!r} must be a number from -100 to 100 (got {bias!r})")
        out[int(key)] = float(bias)
    return out


def check_logit_bias(s: Sampling, vocab: int) -> None:
    """ValueError naming the first logit_bias key that is not in a vocabulary of `vocab` tokens."""
    bad = next((t for t in s.logit_bias if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"logit_bias: key '{bad}' is not a token id of this model's vocabulary (0 to {vocab - 1})")


def vocab_size(model, tokenizer) -> int:
    """How many token ids the model scores and the tokenizer knows (logit_bias keys must be below it)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return min(len(tokenizer), rows) if isinstance(rows, int) and rows > 0 else len(tokenizer)


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus the requested max_new_tokens, does not fit the model's context.
    `what` is "prompt" (the prompt alone is too long) or "max_new_tokens" (the asked-for length is)."""

    def __init__(self, what: str, prompt_tokens: int, max_new_tokens: int, context: int):
        self.what, self.prompt_tokens, self.max_new_tokens, self.context = what, prompt_tokens, max_new_tokens, context
        if what == "prompt":
            message = (f"the prompt has {prompt_tokens} tokens, which leaves no room in this model's context of "
                       f"{context} tokens")
        else:
            message = (f"max_new_tokens {max_new_tokens} is too large: the prompt has {prompt_tokens} tokens and "
                       f"this model's context is {context}, so at most {context - prompt_tokens} can be generated")
        super().__init__(message)


class TokenCapError(ValueError):
    """An explicitly requested max_new_tokens above the caller's per-request cap (`tuneboard api
    --max-tokens-per-request`), though it would fit the context."""

    def __init__(self, max_new_tokens: int, cap: int):
        self.max_new_tokens, self.cap = max_new_tokens, cap
        super().__init__(f"max_new_tokens {max_new_tokens} is more than the {cap} tokens allowed per request")


def fit_context(s: Sampling, prompt_tokens: int, context: int | None, explicit: bool,
                cap: int | None = None, asked: bool | None = None) -> Sampling:
    """Bound generation by the model's context, then by `cap`: a prompt that leaves no room, or an
    explicitly requested max_new_tokens past the context, is a ContextLengthError, and one past the cap a
    TokenCapError; a default one is cut to what fits and to the cap (as OpenAI does when max_tokens is not
    given). `asked` (default: explicit): max_new_tokens was given, though as a ceiling (fit_context): cut to the
    context, yet refused past the cap."""
    if cap and asked and not explicit and s.max_new_tokens > cap:
        raise TokenCapError(s.max_new_tokens, cap)
    if context:
        room = context - prompt_tokens
        if room < 1:
            raise ContextLengthError("prompt", prompt_tokens, s.max_new_tokens, context)
        if s.max_new_tokens > room:
            if explicit:
                raise ContextLengthError("max_new_tokens", prompt_tokens, s.max_new_tokens, context)
            s = replace(s, max_new_tokens=room)
    if cap and s.max_new_tokens > cap:
        if explicit:
            raise TokenCapError(s.max_new_tokens, cap)
        s = replace(s, max_new_tokens=cap)
    return s


def context_length(model, tokenizer) -> int | None:
    """How many tokens (prompt + answer) the model takes: its config's position limit, else the
    tokenizer's model_max_length when that is a real number (not transformers' 1e30 placeholder)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**7 else None


# ------------------------------------------------------------------------------------- stop strings
def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class StopFilter:
    """Streams text while holding back what could be the start of a stop string, so no piece of a stop
    string is ever shown, then ends at the first full one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buffer = ""
        self.done = False

    def feed(self, piece: str) -> str:
        if self.done:
            return ""
        self.buffer += piece
        text, hit = cut_at_stop(self.buffer, self.stops)
        if hit:
            self.done, self.buffer = True, ""
            return text
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.buffer)), keep, -1):
                if self.buffer.endswith(stop[:n]):
                    keep = n
                    break
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.done else self.buffer), ""
        return out


# --------------------------------------------------------------------------------------- tool calls
def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """OpenAI request tools ({"type": "function", "function": schema}) -> bare schemas, the form the
    templates take (they wrap them again where the family's format does)."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list of {type: function, function: {...}} objects")
    out = []
    for i, tool in enumerate(tools):
        schema = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else tool
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or not schema["name"]:
            raise ValueError(f"tools[{i}]: needs a function with a non-empty string 'name'")
        out.append(schema)
    return out


def _tool_call_format(template, text: str) -> tuple[str, str, str]:
    """(prefix, suffix, arguments key) of one call in this template's format."""
    cfg = getattr(template, "spec", {}).get("tool_call") if hasattr(template, "spec") else None
    if cfg:
        item = cfg.get("item", "{json}")
        prefix, _, suffix = item.partition("{json}")
        return prefix.strip(), suffix.strip(), cfg.get("arguments_key", "arguments")
    if "<tool_call>" in text:  # the tokenizer's own template (auto) of a Qwen-style model
        return "<tool_call>", "</tool_call>", "arguments"
    return "", "", "arguments"  # documented default: one JSON object per line


def _as_calls(obj: Any, args_key: str, names: set[str]) -> list[tuple[str, Any]] | None:
    objs = obj if isinstance(obj, list) else [obj]
    calls = []
    for o in objs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return None
        if names and o["name"] not in names:
            return None
        args = o.get(args_key, o.get("arguments", o.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append((o["name"], args))
    return calls or None


def parse_tool_calls(text: str, template, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """Split a reply into (content, OpenAI tool_calls) in the template's tool-call format: Qwen/ChatML
    `<tool_call>{json}</tool_call>`, Granite `<|tool_call|>[...]`, Mistral `[TOOL_CALLS] [...]`,
    Llama 3 / default: JSON objects on their own lines. Only calls to declared tools count."""
    names = {t["name"] for t in openai_tools(tools) or []}
    prefix, suffix, args_key = _tool_call_format(template, text)
    decoder = json.JSONDecoder()
    calls: list[tuple[str, Any]] = []
    content = text
    if prefix and prefix in text:
        content = text[:text.index(prefix)]
        for part in text.split(prefix)[1:]:
            part = part.strip()
            try:
                obj, _ = decoder.raw_decode(part)
            except json.JSONDecodeError:
                return text.strip(), []
            found = _as_calls(obj, args_key, names)
            if found is None:
                return text.strip(), []
            calls += found
    else:
        whole = text.strip()
        try:  # the whole reply is one JSON value (also Mistral's list once [TOOL_CALLS] is decoded away)
            found = _as_calls(json.loads(whole), args_key, names) if whole[:1] in "[{" and whole else None
        except json.JSONDecodeError:
            found = None
        if found:
            calls, content = found, ""
        else:
            kept = []
            for line in text.splitlines():
                s = line.strip()
                found = None
                if s.startswith("{"):
                    try:
                        found = _as_calls(json.loads(s), args_key, names)
                    except json.JSONDecodeError:
                        found = None
                if found:
                    calls += found
                else:
                    kept.append(line)
            if calls:
                content = "\n".join(kept)
    wire = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for n, a in calls]
    return content.strip(), wire


# --------------------------------------------------------------------------------------- HF engine
def stop_token_ids(tokenizer, template) -> list[int]:
    """The template's end-of-turn strings that are single tokens, plus the tokenizer's eos."""
    ids = set()
    for word in getattr(template, "stop_words", []) or []:
        tokens = tokenizer(word, add_special_tokens=False).input_ids
        if len(tokens) == 1:
            ids.add(tokens[0])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _stop_strings(tokenizer, template, extra: list[str]) -> list[str]:
    """Multi-token end-of-turn words (single-token ones stop by id) plus the request's stop strings."""
    words = [w for w in getattr(template, "stop_words", []) or []
             if w and len(tokenizer(w, add_special_tokens=False).input_ids) != 1]
    return list(dict.fromkeys(words + list(extra)))


class HFEngine:
    """transformers generate on one loaded model. `adapter`: the peft adapter to activate (None on a
    PeftModel = run the base with adapters disabled). `lock`, a TurnLock, is shared by every engine on the
    model: a generation holds it only during its turns (see backend.training.scheduler), and whoever holds it may
    switch the model's adapter."""

    enforces_time_limit = True

    def __init__(self, name: str, model, tokenizer, template, *, adapter: str | None = None,
                 lock: TurnLock | None = None, defaults: dict | None = None, default_system: str | None = None,
                 batcher: Batcher | None = None):
        self.name = name
        self.batcher = batcher  # shared by the engines on this model: their requests decode in one batch
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.adapter = adapter
        self.lock = lock or TurnLock()
        self.defaults = dict(defaults or {})
        self.default_system = default_system
        self.eos_ids = stop_token_ids(tokenizer, template)
        self.context_length = context_length(model, tokenizer)
        self.vocab_size = vocab_size(model, tokenizer)

    # -- prompt
    def prompt_ids(self, messages: list[dict] | str, tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered prompt (the template writes the BOS; the tokenizer adds none). A plain
        string is a raw completion prompt: no template, the tokenizer's own BOS if it adds one."""
        if isinstance(messages, str):
            return self.tokenizer(messages).input_ids
        if isinstance(messages, (list, tuple)) and messages and all(
                isinstance(t, int) and not isinstance(t, bool) for t in messages):  # a prompt given as token ids
            vocab = len(self.tokenizer)
            bad = next((t for t in messages if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is not in this model's vocabulary (0 to {vocab - 1})")
            return list(messages)
        if self.default_system and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.default_system}] + list(messages)
        tools = openai_tools(tools)
        text = self.template.render_text(messages, tools, add_generation_prompt=True)
        if tools and getattr(self.template, "name", None) == "auto" and \
                text == self.template.render_text(messages, None, add_generation_prompt=True):
            raise ValueError("tools: this model's own chat template (template auto) ignores tools; serve it with a "
                             "named template that has a tool format (e.g. template: qwen, llama3, mistral, default)")
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _activate(self) -> None:
        """Put the shared model in this engine's adapter state (the caller holds the turn): its adapter
        active, or all adapters disabled for the base. The lock's `state` records whose state the model is
        in, so turns between requests to one served model switch nothing. Not a context manager: turns of
        engines on one model interleave, so each turn sets the state it needs instead of undoing it."""
        key = ("adapter", self.adapter)
        if not hasattr(self.model, "peft_config") or self.lock.state == key:
            return
        if self.adapter is None:
            self.model.base_model.disable_adapter_layers()
        else:
            self.model.base_model.enable_adapter_layers()
            self.model.set_adapter(self.adapter)
        self.lock.state = key

    def _generate_kwargs(self, s: Sampling, prompt_len: int, stops: list[str], stop_event,
                         time_limit: float | None = None):
        # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        tok = self.tokenizer
        config = dict(max_new_tokens=s.max_new_tokens, do_sample=not s.greedy, eos_token_id=self.eos_ids,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else self.eos_ids[0],
                      repetition_penalty=s.repetition_penalty)
        if not s.greedy:
            config.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        deadline = time.monotonic() + time_limit if time_limit else None
        criteria = _Criteria(tok, prompt_len, stops, stop_event, deadline)
        kwargs = dict(generation_config=GenerationConfig(**config), stopping_criteria=StoppingCriteriaList([criteria]))
        if TokenPenalties.wanted(s.frequency_penalty, s.presence_penalty, s.logit_bias):  # after generate's own
            kwargs["logits_processor"] = LogitsProcessorList(  # repetition penalty, before its temperature (as batched)
                [TokenPenalties(prompt_len, s.frequency_penalty, s.presence_penalty, s.logit_bias)])
        return kwargs, criteria

    def _finish(self, text: str, criteria: "_Criteria", s: Sampling, prompt_len: int, stops: list[str],
                tools: list[dict] | None) -> Reply:
        text, hit = cut_at_stop(text, stops)
        if criteria.aborted:
            reason = "abort"
        elif hit or criteria.last_token in self.eos_ids:
            reason = "stop"
        elif criteria.generated >= s.max_new_tokens:
            reason = "length"
        else:
            reason = "time_limit" if criteria.timed_out else "stop"
        calls: list[dict] = []
        if tools:
            text, calls = parse_tool_calls(text, self.template, tools)
            if calls:
                reason = "tool_calls"
        return Reply(text=text, tool_calls=calls, finish_reason=reason, prompt_tokens=prompt_len,
                     completion_tokens=criteria.generated)

    def _run(self, ids: list[int], kwargs: dict, s: Sampling, criteria: "_Criteria", **extra):
        """generate() in turns on the shared model. None when the request ended (stop_event set: the client
        left; or its time limit ran out) while it waited for its first turn: nothing was generated. Once
        started, `criteria` hands the turn on every TOKENS_PER_TURN tokens while others wait."""
        # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
        import torch

        if self.batcher is not None:
            return self._run_batched(ids, s, criteria, extra.get("streamer"))
        inputs = torch.tensor([ids], device=self.model.device)
        if not self.lock.acquire(cancelled=criteria.ended):
            return None
        try:
            with torch.inference_mode():
                self._activate()
                if s.seed is not None:
                    torch.manual_seed(s.seed)
                criteria.turns = _Turns(self, seeded=s.seed is not None and not s.greedy)
                return self.model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), **kwargs,
                                           **extra)
        finally:
            criteria.turns = None
            self.lock.release()

    def _run_batched(self, ids: list[int], s: Sampling, criteria: "_Criteria", streamer=None):
        """_run through the model's Batcher: the same tokens `generate` would give, decoded in one batch with
        the other requests on the model."""
        # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
        import torch

        job = Job(ids=list(ids), state=("adapter", self.adapter), activate=self._activate,
                  max_new_tokens=s.max_new_tokens, eos_ids=self.eos_ids, criteria=criteria, greedy=s.greedy,
                  temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, repetition_penalty=s.repetition_penalty,
                  frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty, logit_bias=s.logit_bias,
                  seed=s.seed, streamer=streamer)
        if not self.batcher.run(job):
            return None
        return torch.tensor([job.ids + job.tokens])

    def _sampling(self, sampling: dict, prompt_tokens: int, cap: int | None = None) -> Sampling:
        s = make_sampling(self.defaults, sampling)
        check_logit_bias(s, self.vocab_size)
        asked = sampling.get("max_new_tokens") is not None
        return fit_context(s, prompt_tokens, self.context_length, explicit=asked and not s.fit_context, cap=cap,
                           asked=asked)

    def chat(self, messages, tools=None, *, stop_event=None, time_limit=None, max_tokens_cap=None,
             **sampling) -> Reply:
        make_sampling(self.defaults, sampling)  # bad sampling values are reported before the prompt's
        ids = self.prompt_ids(messages, tools)
        s = self._sampling(sampling, len(ids), max_tokens_cap)
        stops = _stop_strings(self.tokenizer, self.template, s.stop)
        kwargs, criteria = self._generate_kwargs(s, len(ids), stops, stop_event, time_limit)
        output = self._run(ids, kwargs, s, criteria)
        if output is None:  # ended before its first turn (criteria says why)
            return self._finish("", criteria, s, len(ids), stops, None)
        text = self.tokenizer.decode(output[0][len(ids):], skip_special_tokens=True)
        reply = self._finish(text, criteria, s, len(ids), stops, tools)
        reply.token_ids = output[0][len(ids):].tolist()
        return reply

    def score(self, ids: list[int], top: int = 0) -> list[TokenLogprob]:
        """The log-probability of each token of `ids` given those before it (the model's log-softmax, this
        engine's adapter state), with the `top` most likely tokens at each position: one forward pass, in
        the model's turn. A sequence longer than the model's context is a ContextLengthError."""
        # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
        import torch

        if not ids:
            raise ValueError("nothing to score: the prompt has no tokens")
        if self.context_length and len(ids) > self.context_length:
            raise ContextLengthError("prompt", len(ids), 0, self.context_length)
        inputs = torch.tensor([ids], device=self.model.device)
        self.lock.acquire()
        try:
            with torch.inference_mode():
                self._activate()
                logits = self.model(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits[0, :-1]
        finally:
            self.lock.release()
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, inputs[0, 1:, None])[:, 0].tolist()
        best = logp.topk(min(top, logp.shape[-1]), dim=-1) if top else None
        out = [TokenLogprob(ids[0], None)]
        for i, token in enumerate(ids[1:]):
            pairs = list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else []
            out.append(TokenLogprob(token, chosen[i], pairs))
        return out

    def stream(self, messages, tools=None, *, stop_event=None, time_limit=None, max_tokens_cap=None,
               **sampling) -> Stream:
        # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
        from transformers import TextIteratorStreamer

        make_sampling(self.defaults, sampling)
        ids = self.prompt_ids(messages, tools)  # errors surface here, before any thread starts
        s = self._sampling(sampling, len(ids), max_tokens_cap)
        stops = _stop_strings(self.tokenizer, self.template, s.stop)
        stop_event = stop_event or threading.Event()
        kwargs, criteria = self._generate_kwargs(s, len(ids), stops, stop_event, time_limit)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[BaseException] = []

        def work():
            try:
                if self._run(ids, kwargs, s, criteria, streamer=streamer) is None:
                    streamer.end()
            except BaseException as exc:  # re-raised in the consumer
                failure.append(exc)
                streamer.end()

        thread = threading.Thread(target=work, name=f"generate-{self.name}", daemon=True)
        result = Stream(iter(()))

        def pieces():
            thread.start()
            filt, text, own_stop = StopFilter(stops), [], False
            try:
                for piece in streamer:
                    out = filt.feed(piece)
                    if out:
                        text.append(out)
                        yield out
                    if filt.done:  # the criteria see it too; setting the event just makes sure
                        own_stop = True
                        stop_event.set()
                        break
                out = filt.flush()
                if out:
                    text.append(out)
                    yield out
            finally:
                if thread.is_alive():
                    stop_event.set()
                thread.join()
            if failure:
                raise failure[0]
            reply = self._finish("".join(text), criteria, s, len(ids), [], tools)
            if own_stop and reply.finish_reason == "abort":
                reply.finish_reason = "stop"
            result.reply = reply

        result._pieces, result._thread, result._criteria = pieces(), thread, criteria
        return result


class _Criteria:
    """StoppingCriteria, called by generate after every token: stop_event set, the deadline passed, or a
    stop string in the newest text. Also records how many tokens were generated and the last one (to tell
    an end-of-turn stop from the length limit), and, while others wait for the model, hands it on
    (`turns`)."""

    def __init__(self, tokenizer, prompt_len: int, stops: list[str], stop_event, deadline: float | None = None):
        self.tokenizer, self.prompt_len, self.stops, self.stop_event = tokenizer, prompt_len, stops, stop_event
        self.deadline = deadline  # time.monotonic() value, or None
        self.window = max((len(s) for s in stops), default=0) + 4
        self.generated, self.last_token, self.aborted, self.timed_out = 0, None, False, False
        self.turns: _Turns | None = None

    def ended(self) -> bool:
        """Whether the request must end now: stop_event set (-> aborted) or the deadline passed (-> timed_out)."""
        if self.stop_event is not None and self.stop_event.is_set():
            self.aborted = True
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            self.timed_out = True
        return self.aborted or self.timed_out

    def __call__(self, input_ids, scores=None, **kwargs):
        # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
        import torch

        self.generated = input_ids.shape[1] - self.prompt_len
        self.last_token = int(input_ids[0, -1])
        stop = self.ended()
        if not stop and self.stops:
            tail = input_ids[0, max(self.prompt_len, input_ids.shape[1] - self.window):]
            text = self.tokenizer.decode(tail, skip_special_tokens=True)
            stop = any(s in text for s in self.stops)
        if not stop and self.turns is not None and self.turns.step():
            stop = self.ended()  # it waited for the turn to come round: its client may have left meanwhile
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class _Turns:
    """One generation's share of its model (backend.training.scheduler.TurnLock): every TOKENS_PER_TURN tokens, if
    another request waits, the turn goes round; once it is back, this engine's adapter is set again and a
    seeded sampling request gets its own random state back (the others' sampling drew from the same
    generator meanwhile), so a seed gives the same answer with or without company."""

    def __init__(self, engine: HFEngine, seeded: bool):
        self.engine, self.seeded, self.tokens = engine, seeded, 0

    def step(self) -> bool:
        """After each token: True when the turn went round (others generated meanwhile)."""
        self.tokens += 1
        lock = self.engine.lock
        if self.tokens % TOKENS_PER_TURN or not lock.waiting():
            return False
        rng = _rng_state(self.engine.model.device) if self.seeded else None
        if not lock.pass_turn():
            return False
        self.engine._activate()
        if rng is not None:
            _set_rng_state(self.engine.model.device, rng)
        return True


def _rng_state(device) -> tuple:
    """The default generators' states used when sampling on `device` (the CPU's, and the accelerator's)."""
    # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
    import torch

    accel = getattr(torch, device.type, None) if device.type != "cpu" else None
    return torch.get_rng_state(), (accel.get_rng_state(device) if hasattr(accel, "get_rng_state") else None)


def _set_rng_state(device, state: tuple) -> None:
    # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
    import torch

    torch.set_rng_state(state[0])
    if state[1] is not None:
        getattr(torch, device.type).set_rng_state(state[1], device)


# ------------------------------------------------------------------------------------- vLLM engine
def vllm_unavailable() -> str | None:
    """Why vLLM cannot run here, or None when it can."""
    try:
        import torch  # heavy: the module top stays light (chat, API, distill import it)

        if not torch.cuda.is_available():
            return "no CUDA GPU"
        import vllm  # noqa: F401
    except Exception as exc:  # not installed, or built against another torch/CUDA
        return f"vllm does not import ({exc.__class__.__name__}: {exc})"
    return None


class VLLMEngine:
    """vLLM offline engine (one LLM per base model; adapters as LoRARequests). Prompts are passed as
    token ids rendered by our template, so vLLM adds no BOS of its own. `stream` yields the whole
    answer as one piece: the offline LLM API has no incremental output. It runs one request at a time and
    cannot stop one midway, so `time_limit` is not enforced (enforces_time_limit; the server warns)."""

    enforces_time_limit = False

    def __init__(self, name, llm, tokenizer, template, *, lora=None, lock=None, defaults=None, default_system=None):
        self.name, self.llm, self.tokenizer, self.template, self.lora = name, llm, tokenizer, template, lora
        self.lock = lock or threading.Lock()
        self.defaults = dict(defaults or {})
        self.default_system = default_system
        self.eos_ids = stop_token_ids(tokenizer, template)
        try:
            self.context_length = int(llm.llm_engine.model_config.max_model_len)
        except Exception:  # another vLLM release: the tokenizer's limit, if it has a real one
            self.context_length = context_length(None, tokenizer)
        self.vocab_size = len(tokenizer)

    prompt_ids = HFEngine.prompt_ids
    _sampling = HFEngine._sampling

    def chat(self, messages, tools=None, *, stop_event=None, time_limit=None, max_tokens_cap=None,
             **sampling) -> Reply:
        # optional (vllm extra, GPU only) and heavy: imported only when vLLM serves
        from vllm import SamplingParams

        make_sampling(self.defaults, sampling)
        ids = self.prompt_ids(messages, tools)
        s = self._sampling(sampling, len(ids), max_tokens_cap)
        stops = _stop_strings(self.tokenizer, self.template, s.stop)
        params = SamplingParams(max_tokens=s.max_new_tokens, temperature=0.0 if s.greedy else s.temperature,
                                top_p=1.0 if s.greedy else s.top_p, top_k=(s.top_k or -1) if not s.greedy else -1,
                                repetition_penalty=s.repetition_penalty, seed=s.seed, stop=stops or None,
                                stop_token_ids=self.eos_ids, skip_special_tokens=True,
                                # OpenAI's, natively: vLLM counts the penalties over the generated tokens too
                                frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                                **({"logit_bias": s.logit_bias} if s.logit_bias else {}))  # vLLM >= 0.6.3 takes it
        with self.lock:
            out = self.llm.generate([{"prompt_token_ids": ids}], params, lora_request=self.lora, use_tqdm=False)[0]
        done = out.outputs[0]
        text = done.text
        reason = "length" if done.finish_reason == "length" else "stop"
        calls: list[dict] = []
        if tools:
            text, calls = parse_tool_calls(text, self.template, tools)
            reason = "tool_calls" if calls else reason
        return Reply(text, calls, reason, len(ids), len(done.token_ids), list(done.token_ids))

    def stream(self, messages, tools=None, *, stop_event=None, time_limit=None, max_tokens_cap=None,
               **sampling) -> Stream:
        make_sampling(self.defaults, sampling)
        self._sampling(sampling, len(self.prompt_ids(messages, tools)), max_tokens_cap)  # refusals before streaming
        result = Stream(iter(()))

        def pieces():
            reply = self.chat(messages, tools, max_tokens_cap=max_tokens_cap, **sampling)
            result.reply = reply
            if reply.text:
                yield reply.text

        result._pieces = pieces()
        return result


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python, the llamacpp extra) on one GGUF file, e.g. a `tuneboard export` of a tuned
    model: the fast way to chat with it on a CPU. The prompt is rendered by our template and tokenized by the
    GGUF's own tokenizer (transformers reads it from the file), then passed to llama.cpp as token ids, so the
    ids are those the export check compared. One llama.cpp context: requests take turns on it whole (a lock,
    waited on while the request is still wanted). Streams token by token; logprobs from llama.cpp's logits."""

    enforces_time_limit = True

    def __init__(self, name, llm, tokenizer, template, *, defaults=None, default_system=None):
        self.name, self.llm, self.tokenizer, self.template = name, llm, tokenizer, template
        self.lock = threading.Lock()
        self.defaults = dict(defaults or {})
        self.default_system = default_system
        self.eos_ids = stop_token_ids(tokenizer, template)
        self.context_length = int(llm.n_ctx())
        self.vocab_size = min(int(llm.n_vocab()), len(tokenizer))

    prompt_ids = HFEngine.prompt_ids
    _sampling = HFEngine._sampling

    def _acquire(self, stop_event, deadline) -> bool:
        while not self.lock.acquire(timeout=0.05):
            if (stop_event is not None and stop_event.is_set()) or (deadline and time.monotonic() > deadline):
                return False
        return True

    def _generate(self, ids, s: Sampling, stops, stop_event, deadline, state: dict) -> Iterator[str]:
        """Text pieces of the answer (stop strings held back and cut); `state` gets the finish reason and the
        generated ids."""
        filt, out, shown = StopFilter(stops), [], ""
        state.update(reason="stop", ids=out)
        if not self._acquire(stop_event, deadline):
            state["reason"] = "abort" if stop_event is not None and stop_event.is_set() else "time_limit"
            return
        try:
            if s.seed is not None:
                self.llm.set_seed(s.seed)
            # the prompt is evaluated whole each time: llama-cpp-python's reuse of a matching prefix of the last
            # request evaluates in other batch shapes, which flips near-tied greedy tokens of a quantized model
            self.llm.reset()
            # OpenAI's penalties and logit_bias by our own processor, not llama.cpp's penalties sampler: that one
            # counts only the last last_n_tokens_size (64) tokens; OpenAI counts the whole answer
            processors = [LlamaTokenPenalties(len(ids), s.frequency_penalty, s.presence_penalty, s.logit_bias,
                                              self.llm.n_vocab())] \
                if TokenPenalties.wanted(s.frequency_penalty, s.presence_penalty, s.logit_bias) else None
            tokens = self.llm.generate(ids, reset=True, temp=0.0 if s.greedy else s.temperature,
                                       top_k=s.top_k if not s.greedy else 1, top_p=s.top_p if not s.greedy else 1.0,
                                       min_p=0.0, repeat_penalty=s.repetition_penalty, logits_processor=processors)
            try:
                for token in tokens:
                    token = int(token)
                    out.append(token)
                    if token in self.eos_ids:
                        break
                    text = self.tokenizer.decode(out, skip_special_tokens=True)
                    if not text.endswith("\ufffd"):  # a character split across tokens waits for its rest
                        piece = filt.feed(text[len(shown):])
                        shown = text
                        if piece:
                            yield piece
                        if filt.done:
                            break
                    if len(out) >= s.max_new_tokens:
                        state["reason"] = "length"
                        break
                    if stop_event is not None and stop_event.is_set():
                        state["reason"] = "abort"
                        break
                    if deadline and time.monotonic() > deadline:
                        state["reason"] = "time_limit"
                        break
            finally:
                tokens.close()
        finally:
            self.lock.release()
        # the text held back for a character's rest that never came (max_tokens, a stop, the end) is what the
        # tokens decode to, U+FFFD for the cut character, as the transformers backend gives it, streamed or not
        piece = filt.feed(self.tokenizer.decode(out, skip_special_tokens=True)[len(shown):]) + filt.flush()
        if piece:
            yield piece

    def stream(self, messages, tools=None, *, stop_event=None, time_limit=None, max_tokens_cap=None,
               **sampling) -> Stream:
        make_sampling(self.defaults, sampling)  # bad sampling values are reported before the prompt's
        ids = self.prompt_ids(messages, tools)
        s = self._sampling(sampling, len(ids), max_tokens_cap)
        stops = _stop_strings(self.tokenizer, self.template, s.stop)
        deadline = time.monotonic() + time_limit if time_limit else None
        result, state = Stream(iter(())), {}

        def pieces():
            text = []
            for piece in self._generate(ids, s, stops, stop_event, deadline, state):
                text.append(piece)
                yield piece
            answer, calls, reason = "".join(text), [], state["reason"]
            if tools:
                answer, calls = parse_tool_calls(answer, self.template, tools)
                reason = "tool_calls" if calls else reason
            result.reply = Reply(answer, calls, reason, len(ids), len(state["ids"]), list(state["ids"]))

        result._pieces = pieces()
        return result

    def chat(self, messages, tools=None, *, stop_event=None, time_limit=None, max_tokens_cap=None,
             **sampling) -> Reply:
        stream = self.stream(messages, tools, stop_event=stop_event, time_limit=time_limit,
                             max_tokens_cap=max_tokens_cap, **sampling)
        for _ in stream:
            pass
        return stream.reply

    def score(self, ids: list[int], top: int = 0) -> list[TokenLogprob]:
        """HFEngine.score from llama.cpp's logits (the context keeps every position's: logits_all)."""
        # optional dependency's companion: numpy comes with llama-cpp-python; the module top stays light
        import numpy as np

        if not ids:
            raise ValueError("nothing to score: the prompt has no tokens")
        if len(ids) > self.context_length:
            raise ContextLengthError("prompt", len(ids), 0, self.context_length)
        with self.lock:
            self.llm.reset()
            self.llm.eval(ids)
            logits = np.array(self.llm.scores[: len(ids) - 1], dtype=np.float64)
        logp = logits - logits.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        out = [TokenLogprob(ids[0], None)]
        for i, token in enumerate(ids[1:]):
            best = np.argsort(-logp[i])[:top] if top else []
            out.append(TokenLogprob(token, float(logp[i, token]), [(int(t), float(logp[i, t])) for t in best]))
        return out


# ------------------------------------------------------------------------------------------ loading
@dataclass
class Served:
    """One model the engine serves: `adapters` empty (the base), one path, or a stack merged in order."""

    name: str
    adapters: list[str]


def _is_adapter(path: str) -> bool:
    return (Path(path).expanduser() / "adapter_config.json").is_file()


def check_adapter(path: str) -> str:
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"adapter '{path}' does not exist")
    if not _is_adapter(path):
        if (p / "config.json").is_file():
            raise ValueError(f"'{path}' is a full model, not a LoRA adapter: serve it with --model {path}")
        raise ValueError(f"adapter '{path}' is not an adapter folder (no adapter_config.json)")
    return str(p.resolve())


def adapter_display_name(path: str) -> str:
    """saves/run/checkpoint-40 -> run/checkpoint-40; saves/run -> run."""
    p = Path(path).expanduser().resolve()
    return f"{p.parent.name}/{p.name}" if re.fullmatch(r"checkpoint-\d+", p.name) else p.name


def trained_template(adapter: str) -> str | None:
    """The template named in the adapter's run_spec.yaml (or its run dir's, for checkpoint-N): chat then
    renders exactly as training did even when the tokenizer's own template differs."""
    for folder in (Path(adapter), Path(adapter).parent):
        f = folder / SPEC_FILE
        if f.is_file():
            try:
                name = (yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("template")
            except (OSError, yaml.YAMLError):
                return None
            return name if isinstance(name, str) and name != "auto" else None
    return None


def adapter_template(name: str, adapters, tokenizer, base_template):
    """The template a model with these adapters is served with: with template auto, the one the last adapter was
    trained with (trained_template), else `base_template` (pick_template's). One answer for chat, the API and
    tuneboard export, so an export ships the template chat renders with."""
    if name == "auto" and adapters:
        trained = trained_template(str(adapters[-1]))
        if trained:
            return get_template(trained, tokenizer)
    return base_template


def plan_served(spec, adapters: list[str] = (), *, include_base: bool = True) -> list[Served]:
    """The served list: the base (named like model_name_or_path), the spec's adapter_name_or_path
    (a comma list is one stacked model) and each extra adapter, given as PATH or NAME=PATH
    (PATH may be a comma list too). Names are unique."""
    served: list[Served] = []
    used: set[str] = set()

    def add(name: str, paths: list[str]):
        base, k = name, 2
        while name in used:
            name, k = f"{base}-{k}", k + 1
        used.add(name)
        served.append(Served(name, paths))

    if include_base:
        add(str(spec.model_name_or_path), [])
    entries = []
    if getattr(spec, "adapter_name_or_path", None):
        entries.append((None, spec.adapter_name_or_path))
    for item in adapters:
        name, sep, path = item.partition("=")
        entries.append((name.strip(), path) if sep and not _is_adapter(item) else (None, item))
    for name, paths in entries:
        stack = [check_adapter(p.strip()) for p in str(paths).split(",") if p.strip()]
        if not stack:
            raise ValueError(f"adapter '{paths}': no path given")
        add(name or "+".join(adapter_display_name(p) for p in stack), stack)
    return served


def load_engines(spec, adapters: list[str] = (), *, include_base: bool = True, warn: Warn | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, Engine]:
    """Load the base model once and build one engine per served model (see plan_served). Single
    adapters share the base as named peft adapters; stacks get their own merged copy."""
    warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr))
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    served = plan_served(spec, adapters, include_base=include_base)
    if not served:
        raise ValueError("nothing to serve: give a model or an adapter")
    backend = getattr(spec, "infer_backend", "huggingface")
    if backend == "llamacpp":
        return _load_llamacpp(spec, served, warn, log)
    if backend == "vllm":
        why = vllm_unavailable()
        if why is None:
            return _load_vllm(spec, served, warn, log)
        warn(f"infer_backend vllm: {why}: using transformers (huggingface) instead")

    # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
    from backend.training.adapters import apply_finetuning
    from backend.training.models import load_model, load_tokenizer, resolve_model  # heavy: loaded on use, so importing this module stays light

    resolved = resolve_model(spec.model_name_or_path)
    log(f"loading {resolved.model_id} ...")
    tokenizer = load_tokenizer(resolved, trust_remote_code=bool(getattr(spec, "trust_remote_code", False)),
                               new_special_tokens=getattr(spec, "new_special_tokens", None))
    defaults = sampling_defaults(spec)
    system = getattr(spec, "default_system", None)
    base_template = pick_template(spec.template, resolved, tokenizer, warn=warn,
                                  enable_thinking=getattr(spec, "enable_thinking", True))

    def template_for(entry: Served):
        return adapter_template(spec.template, entry.adapters, tokenizer, base_template)

    singles = [e for e in served if len(e.adapters) <= 1]
    stacks = [e for e in served if len(e.adapters) > 1]
    engines: dict[str, Engine] = {}
    if singles:
        model = load_model(spec, resolved, for_training=False, warn=warn)
        keys = {}
        for i, entry in enumerate(e for e in singles if e.adapters):
            # heavy (torch, transformers, peft): the module top stays light (chat, API, distill import it)
            from peft import PeftModel

            keys[entry.name] = f"adapter_{i}"
            log(f"loading adapter {entry.adapters[0]} as '{entry.name}'")
            if i == 0:
                model = PeftModel.from_pretrained(model, entry.adapters[0], adapter_name=keys[entry.name])
            else:
                model.load_adapter(entry.adapters[0], adapter_name=keys[entry.name])
        model.eval()
        lock = TurnLock()  # the engines on this model take turns on it
        batcher = Batcher(model, lock) if batchable(model) else None  # and decode their requests in one batch
        for entry in singles:
            engines[entry.name] = HFEngine(entry.name, model, tokenizer, template_for(entry),
                                           adapter=keys.get(entry.name), lock=lock, defaults=defaults,
                                           default_system=system, batcher=batcher)
    for entry in stacks:
        log(f"loading {resolved.model_id} + {len(entry.adapters)} merged adapters as '{entry.name}'")
        one = replace_spec(spec, adapter_name_or_path=",".join(entry.adapters),
                           finetuning_type=method_of_adapter(entry.adapters[-1]) or "lora")
        model = apply_finetuning(load_model(one, resolved, for_training=False, warn=warn), one,
                                 for_training=False, warn=warn)
        model.eval()
        lock = TurnLock()
        engines[entry.name] = HFEngine(entry.name, model, tokenizer, template_for(entry), defaults=defaults,
                                       default_system=system, lock=lock,
                                       batcher=Batcher(model, lock) if batchable(model) else None)
    return {e.name: engines[e.name] for e in served}  # in the served order


def replace_spec(spec, **changes):
    """A copy of the spec with some fields changed (a pydantic RunSpec or a dataclass/namespace)."""
    if hasattr(spec, "model_copy"):
        return spec.model_copy(update=changes)
    try:
        return replace(spec, **changes)
    except TypeError:
        new = copy.copy(spec)
        for k, v in changes.items():
            setattr(new, k, v)
        return new


def _load_vllm(spec, served: list[Served], warn: Warn, log) -> dict[str, Engine]:
    # optional (vllm extra, GPU only) and heavy: imported only when vLLM serves
    from vllm import LLM
    from vllm.lora.request import LoRARequest  # optional dependency: imported only where it is used

    from backend.training.models import load_tokenizer, model_folder, resolve_model  # heavy: loaded on use, so importing this module stays light

    if any(len(e.adapters) > 1 for e in served):
        raise ValueError("infer_backend vllm serves one adapter per model: merge stacked adapters first "
                         "(tuneboard export) or use infer_backend: huggingface")
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer, warn=warn)
    ranks = [json.loads((Path(e.adapters[0]) / "adapter_config.json").read_text()).get("r", 8)
             for e in served if e.adapters]
    log(f"loading {resolved.model_id} with vLLM ...")
    llm = LLM(model=str(model_folder(resolved)), enable_lora=bool(ranks), max_lora_rank=max(ranks or [8]),
              max_loras=max(1, len(ranks)), trust_remote_code=bool(getattr(spec, "trust_remote_code", False)))
    lock, defaults = threading.Lock(), sampling_defaults(spec)
    engines: dict[str, Engine] = {}
    for i, e in enumerate(served):
        lora = LoRARequest(e.name, i + 1, e.adapters[0]) if e.adapters else None
        engines[e.name] = VLLMEngine(e.name, llm, tokenizer, template, lora=lora, lock=lock, defaults=defaults,
                                     default_system=getattr(spec, "default_system", None))
    return engines


def _load_llamacpp(spec, served: list[Served], warn: Warn, log) -> dict[str, Engine]:
    """One LlamaCppEngine on the GGUF file model_name_or_path names (a .gguf file, or a folder holding one: an
    export folder). Adapters are not applied by llama.cpp here: they are merged into the file by tuneboard export."""
    from backend.core import llamacpp  # light; here so the module top names no optional dependency
    from backend.training.models import resolve_model  # heavy: loaded on use, so importing this module stays light

    if not llamacpp.available():
        raise ValueError(llamacpp.missing("infer_backend llamacpp"))
    if any(e.adapters for e in served):
        raise ValueError("infer_backend llamacpp serves a GGUF file as it is: merge the adapter into one first "
                         "(tuneboard export with export_format: gguf) and serve that file, or use infer_backend: "
                         "huggingface")
    resolved = resolve_model(spec.model_name_or_path)
    if not resolved.gguf_file:
        raise ValueError(f"infer_backend llamacpp needs a .gguf file (or an export folder holding one): "
                         f"model_name_or_path {spec.model_name_or_path} is a transformers folder; export it with "
                         "export_format: gguf, or use infer_backend: huggingface")
    from transformers import AutoTokenizer  # heavy: loaded on use, so importing this module stays light


    gguf_path = Path(resolved.path) / resolved.gguf_file
    log(f"loading {gguf_path} with llama.cpp ...")
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path), gguf_file=resolved.gguf_file)
    template = pick_template(spec.template, resolved, tokenizer, warn=warn,
                             enable_thinking=getattr(spec, "enable_thinking", True))
    llm = open_llama(str(gguf_path), n_ctx=0, logits_all=True, verbose=False)  # n_ctx 0: the file's context
    entry = served[0]
    return {entry.name: LlamaCppEngine(entry.name, llm, tokenizer, template, defaults=sampling_defaults(spec),
                                       default_system=getattr(spec, "default_system", None))}
