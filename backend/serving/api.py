"""`tuneboard api`: an OpenAI-compatible HTTP server over backend.serving.engine.

    GET  /health                 {"status": "ok"}, no key needed (for a parent process waiting on it)
    GET  /v1/models              the served models: the base and each adapter
    POST /v1/chat/completions    non-streaming, or SSE streaming ending with `data: [DONE]`
    POST /v1/completions         raw text prompt (or token ids), no chat template (base models, eval
                                 harnesses); same streaming; echo supported, one prompt and n = 1 per request
    POST /v1/score/evaluation    with --reward-model RM_RUN: {"model", "messages": [text, ...], "max_length"?} ->
                                 {"id", "object", "model", "scores": [float, ...]}, the reward model's score of
                                 each rendered text (LLaMA-Factory's route; what stage ppo's reward_model_type
                                 api asks, backend.evaluation.reward_api)

Logprobs (not streamed): /v1/completions with `logprobs: k` gives OpenAI's legacy choices[].logprobs
(tokens, token_logprobs, top_logprobs: the k likeliest tokens and the chosen one, text_offset into the
choice's text); with `echo` they cover the prompt's tokens too (the first one's is null), and
`max_tokens: 0` with `echo` scores the prompt without generating (lm-eval's `local-completions` sends
token ids, echo and max_tokens 1, and reads the prompt's part). /v1/chat/completions with `logprobs: true`
(+ `top_logprobs: k`) gives choices[].logprobs.content[] (token, logprob, bytes, top_logprobs). They are
the model's own log-softmax (before temperature, top-p and the like), computed in one forward pass.

Any OpenAI client works against it (base_url http://HOST:PORT/v1). The request's `model` picks the
served model; unknown names get 404. With an API key (--api-key or $TUNEBOARD_API_KEY) every /v1
request needs `Authorization: Bearer KEY` (401 otherwise); a non-loopback --host needs a key (or an
explicit --insecure-no-auth). Errors are always OpenAI-style JSON
({"error": {"message", "type", "param", "code"}}): 400 bad values (a field of the wrong type, out of range or
unknown, named as OpenAI names it: messages[0].content), 401, 404, 413 a body over MAX_BODY_BYTES, 503 when
the queue is full, and a 500 only for a real engine failure, with a one-line message and no traceback.
What this server would not do is refused rather than ignored (`refuse_unsupported`): n > 1, response_format
other than text, a tool_choice that forces a call. A stop string cuts the logprobs with the text (`covering`).
frequency_penalty, presence_penalty (-2 to 2) and logit_bias ({"token id": -100 to 100}, ids of the model's
vocabulary, else a 400 naming the key) are applied as OpenAI defines them, on every backend: logits[j] +=
logit_bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j] counting token j in the answer so far
(not the prompt); each request of a batch with its own values (backend.serving.batching.TokenPenalties).

Streams: with stream_options.include_usage every chunk carries "usage": null but the last, an extra chunk with no
choices and the request's usage (OpenAI's shape); without it, no chunk has the field. A character whose bytes
max_tokens (or a stop) cut ends the text as U+FFFD, what the generated tokens decode to, streamed or not.

One request cannot hold the server:
- requests on one model (transformers backend) are decoded in one running batch (backend.serving.batching:
  continuous batching; a request joins on arrival and leaves when it ends), so a 5-token request sent beside an
  8000-token one gets its answer after a few of the long one's tokens, not after all of them; /health counts
  the batched steps; other backends take turns (backend.training.scheduler: TOKENS_PER_TURN tokens each);
- max_tokens is bounded by the model's context (400 naming the field, code context_length_exceeded, when
  the prompt plus max_tokens do not fit), then by --max-tokens-per-request (400 naming the field and the
  cap, code max_tokens_exceeded); left out, it is the spec's max_new_tokens cut to what fits and the cap;
  `fit_context: true` (TuneBoard's extension, the Chat tab sends it) makes a given max_tokens a ceiling that is
  cut to what the context leaves instead of a 400 (the per-request cap still refuses);
- a generation ends after --max-request-seconds (counted from when the request reaches the model, turns
  shared with others included) with finish_reason "time_limit", streamed or not: not "length" (that is
  max_tokens) and not "stop" (the answer did not end);
- a generation stops at its next token once its client disconnects (streamed or not, on every route);
- at most one request per loaded model plus --max-queue more are in progress at once, sharing the
  model's turns (more get 503 at once, with Retry-After).

Once the socket listens it prints `serving on http://HOST:PORT` (flushed) so a parent process (the
web UI, the tests) can wait for that line; `--port 0` takes a free port and prints it.
"""


import argparse
import asyncio
import ipaddress
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from typing import Annotated, Any, Literal, Optional, Union
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from backend.serving.engine import ContextLengthError, Reply, TokenCapError, load_engines, replace_spec
from backend.core.spec import load_or_report

API_KEY_ENV = "TUNEBOARD_API_KEY"
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; its legacy completions allowed 5


# ------------------------------------------------------------------------------------ request schema
def _models():
    """Pydantic request models (built lazily so `tuneboard --help` does not import pydantic/fastapi)."""

    strict = ConfigDict(extra="forbid", strict=True)  # "5" is not 5, true is not 1 (OpenAI answers 400 for both)

    class Message(BaseModel):
        model_config = strict
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Union[str, list[dict[str, Any]], None] = None
        name: Optional[str] = None
        tool_calls: Optional[list[dict[str, Any]]] = None
        tool_call_id: Optional[str] = None
        refusal: Optional[str] = None

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)
        include_usage: Optional[bool] = False

    class Sampling(BaseModel):
        """What both endpoints share; top_k and repetition_penalty are extensions (vLLM's names). Anything
        not declared is a 400 naming the field. Values are not coerced: a string is not a number, a boolean not
        a count."""
        model_config = strict
        model: str
        temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
        top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
        top_k: Optional[int] = Field(None, ge=0)
        repetition_penalty: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
        stop: Union[str, list[str], None] = None
        n: Optional[int] = Field(1, ge=1)
        stream: Optional[bool] = False
        stream_options: Optional[StreamOptions] = None
        seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)  # torch.manual_seed's range
        fit_context: Optional[bool] = None  # TuneBoard's: max_tokens is a ceiling, cut to what the context leaves
        # OpenAI's, over the generated tokens (batching.TokenPenalties); logit_bias keys are token ids as strings,
        # checked against the model's vocabulary by the engine (a 400 naming the key)
        frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
        presence_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
        logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]]] = None
        # no effect on an answer: accepted for client compatibility
        user: Optional[str] = None
        service_tier: Optional[str] = None

    class ChatRequest(Sampling):
        """OpenAI's chat.completions fields."""
        messages: list[Message] = Field(min_length=1)
        max_tokens: Optional[int] = Field(None, ge=1)
        max_completion_tokens: Optional[int] = Field(None, ge=1)
        tools: Optional[list[dict[str, Any]]] = None
        tool_choice: Union[str, dict[str, Any], None] = None
        logprobs: Optional[bool] = None
        top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
        response_format: Optional[dict[str, Any]] = None  # {"type": "text"} only (refuse_unsupported)
        modalities: Optional[list[str]] = None  # ["text"] only (refuse_unsupported)
        # no effect on an answer: accepted for client compatibility
        parallel_tool_calls: Optional[bool] = None
        metadata: Optional[dict[str, Any]] = None
        store: Optional[bool] = None
        prediction: Optional[dict[str, Any]] = None  # a speed hint (predicted output): the answer is the same

    class CompletionRequest(Sampling):
        """OpenAI's legacy completions fields (raw prompt or token ids, no chat template). One prompt, n = 1."""
        prompt: Union[str, list[str], list[int], list[list[int]]]
        max_tokens: Optional[int] = Field(16, ge=0)
        echo: Optional[bool] = False
        suffix: Optional[str] = None
        logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
        best_of: Optional[int] = Field(None, ge=1, le=1)  # one answer per request here

    return ChatRequest, CompletionRequest


def _score_model():
    """The body of POST /v1/score/evaluation (LLaMA-Factory's ScoreEvaluationRequest): texts already rendered
    by the reward model's template, special tokens written out."""

    class ScoreRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        model: str
        messages: list[str] = Field(min_length=1)
        max_length: Optional[int] = Field(None, ge=1)

    return ScoreRequest


class APIError(Exception):
    """An error the client caused (or may fix), answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


class _Invalid(Exception):
    """A request that fails the schema (answered 400 with every problem named)."""

    def __init__(self, errors):
        super().__init__("invalid request")
        self.errors = errors


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def field_path(loc) -> str:
    """A pydantic error location as OpenAI names a field: ("messages", 0, "content", "str") -> messages[0].content
    (a union member's tag, such as "str" or "list[dict[str,any]]", is not part of the field's name)."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or "-" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out or "body"


def unpaired_surrogate(value, where: str = "") -> str | None:
    """The field of a decoded JSON body holding text that is not Unicode (a lone \\ud800-\\udfff escape: no
    tokenizer or UTF-8 encoder takes it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and unpaired_surrogate(key) is not None:
            return where or "body"
        found = unpaired_surrogate(item, f"{where}[{key}]" if isinstance(key, int) else
                                   f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def refuse_unsupported(req) -> None:
    """A 400 naming the field for what this server would otherwise silently not do: n > 1, structured output,
    tool_choice forcing a call, audio."""
    if req.n not in (None, 1):
        raise APIError(400, f"n: only n=1 is supported (got {req.n})", param="n")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", param="stream_options")
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.get("type") != "text":
        raise APIError(400, f"response_format: type {response_format.get('type')!r} is not enforced by this server "
                            "(no constrained decoding): leave it out or send {\"type\": \"text\"}",
                       param="response_format")
    modalities = getattr(req, "modalities", None)
    if modalities is not None and set(modalities) - {"text"}:
        raise APIError(400, f"modalities: only [\"text\"] is served (got {modalities})", param="modalities")
    choice = getattr(req, "tool_choice", None)
    if choice is not None:
        if not getattr(req, "tools", None):
            raise APIError(400, "tool_choice: only allowed when tools are given", param="tool_choice")
        if choice not in ("auto", "none"):
            raise APIError(400, f"tool_choice: {choice!r} would force a tool call, which this server does not "
                                "enforce: send \"auto\" (the model chooses) or \"none\"", param="tool_choice")


def error_param(message: str, default: str) -> str:
    """The request field an engine's ValueError names at its start ("tools[0]: ...", "stop: ..."), else default."""
    head = message.split(":", 1)[0].split("[", 1)[0].strip()
    return head if head in {"tools", "stop", "messages", "prompt", "temperature", "top_p", "top_k", "seed",
                            "repetition_penalty", "max_tokens", "frequency_penalty", "presence_penalty",
                            "logit_bias"} else default


def to_engine_messages(messages) -> list[dict]:
    """OpenAI messages -> the normalized messages the templates take (text content only). A message without
    content (null, left out or no parts) is refused, but for an assistant's turn that calls tools."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if (content is None or content == []) and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages[{i}].content: required (a {m.role} message needs its text)",
                           param=f"messages[{i}].content")
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{k}]: only text parts are supported "
                                        f"(got type {part.get('type')!r})", param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        out.append(msg)
    return out


# ---------------------------------------------------------------------------------------------- app
SCORE_PATH = "/v1/score/evaluation"
MAX_BODY_BYTES = 8 << 20  # a 128k-token context is ~0.5 MB of text (~1 MB as token ids): a larger body is a 413
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", SCORE_PATH)
DEFAULT_MAX_QUEUE = 8
# Operator limits per request (issue #25: one 8000-token request held a model for ~10 minutes). 1024 tokens
# is a long answer yet a fraction of today's contexts; 300 s is far more than a healthy 1024-token answer
# takes on a GPU, and ends a runaway one on a slow CPU. 0 turns either off.
DEFAULT_MAX_TOKENS_PER_REQUEST = 1024
DEFAULT_MAX_REQUEST_SECONDS = 300.0


class _Load:
    """How busy the server is (event loop only): generation requests in progress, and those whose prompt
    was handed to a model."""

    def __init__(self):
        self.requests = 0
        self.generating = 0


class _Gate:
    """Plain ASGI middleware in front of the app: the API key on /v1 (401), then a bound on generation
    requests in progress (counted from their arrival): `running` (one per loaded model) plus `max_queue`
    more, all taking turns on their model; any further one is answered 503 at once instead of waiting
    without end. A plain ASGI middleware (not Starlette's BaseHTTPMiddleware) so the endpoints see the
    client's disconnect message."""

    def __init__(self, app, *, api_key: str | None, running: int, max_queue: int, load: "_Load"):
        self.app, self.api_key, self.capacity, self.max_queue = app, api_key, running + max_queue, max_queue
        self.load = load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.responses import JSONResponse  # heavy: loaded on use, so importing this module stays light

        path, method = scope["path"], scope["method"]
        if self.api_key and path.startswith("/v1") and method != "OPTIONS":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = header[7:].strip() if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                message = ("missing API key: send 'Authorization: Bearer KEY'" if not token
                           else "incorrect API key provided")
                response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401)
                return await response(scope, receive, send)
        if method != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.load.requests >= self.capacity:
            message = (f"the server is busy: {self.load.requests} requests are generating or waiting, the most it "
                       f"takes (--max-queue {self.max_queue}); retry later")
            response = JSONResponse(error_body(message, "server_error", code="server_overloaded"), status_code=503,
                                    headers={"Retry-After": "1"})
            return await response(scope, receive, send)
        self.load.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.requests -= 1


async def _until_disconnected(receive) -> None:
    """Returns once the client has gone (the request body is read by then: what is left is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(engines: dict, *, api_key: str | None = None, cors: list[str] | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_tokens_per_request: int | None = DEFAULT_MAX_TOKENS_PER_REQUEST,
               max_request_seconds: float | None = DEFAULT_MAX_REQUEST_SECONDS, scorers: dict | None = None):
    """The FastAPI app serving `engines` ({name: Engine}, in /v1/models order). max_tokens_per_request and
    max_request_seconds: the per-request limits (None or 0: none but the context). `scorers`: {name: reward model
    (backend.evaluation.reward_score.RewardModelReward)} answering POST /v1/score/evaluation."""
    from fastapi import FastAPI, Request  # heavy: loaded on use, so importing this module stays light
    from fastapi.exceptions import RequestValidationError  # heavy: loaded on use, so importing this module stays light
    from fastapi.responses import JSONResponse  # heavy: loaded on use, so importing this module stays light
    from starlette.concurrency import run_in_threadpool  # heavy: loaded on use, so importing this module stays light
    from starlette.exceptions import HTTPException as StarletteHTTPException  # heavy: loaded on use, so importing this module stays light


    ChatRequest, CompletionRequest = _models()
    ScoreRequest = _score_model()
    scorers = dict(scorers or {})
    scoring_lock = threading.Lock()  # one scoring forward at a time per server: reward models are small next to it
    app = FastAPI(title="TuneBoard OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    # engines on one base share its TurnLock: their requests take turns on that one loaded model
    models_at_once = len({id(getattr(e, "lock", e)) for e in engines.values()}) + len(scorers) or 1
    load = _Load()
    app.add_middleware(_Gate, api_key=api_key, running=models_at_once, max_queue=max_queue, load=load)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status)

    def validation_response(errors) -> JSONResponse:
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(error_body("the request body is not valid JSON"), status_code=400)
        said: dict[str, list[str]] = {}  # field -> what is wrong (a union's alternatives each say theirs)
        for e in errors:
            where = field_path(e.get("loc", ()))
            what = {"extra_forbidden": "unknown field", "missing": "required field missing"}.get(e.get("type"),
                                                                                                  e.get("msg"))
            if what not in said.setdefault(where, []):
                said[where].append(what)
        message = "; ".join(f"{where}: {' or '.join(whats)}" for where, whats in said.items())
        return JSONResponse(error_body(message, param=next(iter(said))), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return validation_response(exc.errors())

    async def parse(request: Request, schema=None):
        """The JSON body as a ChatRequest (or `schema`), whatever the Content-Type (curl -d sends a form type)."""

        from starlette.requests import ClientDisconnect  # heavy: loaded on use, so importing this module stays light

        too_big = APIError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB, the most this server "
                                f"reads", code="request_too_large")
        declared = request.headers.get("content-length") or "0"
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_big
        try:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:  # it left before sending the whole body: nobody reads the answer
            raise APIError(400, "the client disconnected before sending its request") from None
        try:
            data = json.loads(b"".join(chunks) or b"null")
            bad_text = unpaired_surrogate(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        if bad_text:
            raise APIError(400, f"{bad_text}: holds an unpaired surrogate (\\ud800-\\udfff), which is not Unicode text",
                           param=bad_text)
        try:
            return (schema or ChatRequest).model_validate(data)
        except ValidationError as exc:
            raise _Invalid(exc.errors()) from None

    @app.exception_handler(_Invalid)
    async def _invalid(request, exc):
        return validation_response(exc.errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", code=code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))  # 405's Allow

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        traceback.print_exc(file=sys.stderr)  # the server log keeps it; the client gets one line
        return JSONResponse(error_body(f"internal error: {exc.__class__.__name__}: {exc}", "server_error"),
                            status_code=500)

    if cors:
        from fastapi.middleware.cors import CORSMiddleware  # heavy: loaded on use, so importing this module stays light

        app.add_middleware(CORSMiddleware, allow_origins=cors, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.get("/health")
    def health():
        """Also how busy it is: `requests` = generation requests in progress (counted against --max-queue),
        `generating` = those whose prompt was handed to a model (running or waiting for it); `batching`: per
        batched model (transformers backend), its decode steps, those with more than one request in the batch,
        the largest batch and the requests it took, and the KV cache reused across a chat's turns: requests
        prefilled on a saved prefix (kv_hits) or in full (kv_misses), prompt tokens reused and prefilled
        (backend.serving.batching)."""
        batchers = {id(e.batcher): (name, e.batcher) for name, e in engines.items()
                    if getattr(e, "batcher", None) is not None}
        return {"status": "ok", "requests": load.requests, "generating": load.generating,
                "batching": {name: dict(b.stats) for name, b in batchers.values()}}

    @app.get("/v1/models")
    def list_models():
        return {"object": "list",
                "data": [{"id": name, "object": "model", "created": created, "owned_by": "tuneboard"}
                         for name in [*engines, *scorers]]}

    @app.get("/v1/models/{name:path}")
    def retrieve_model(name: str):
        if name not in engines and name not in scorers:
            raise APIError(404, f"the model '{name}' does not exist; served: {', '.join([*engines, *scorers])}",
                           param="model", code="model_not_found")
        return {"id": name, "object": "model", "created": created, "owned_by": "tuneboard"}

    def pick(name: str):
        engine = engines.get(name)
        if engine is None and name in scorers:
            raise APIError(400, f"'{name}' is a reward model: it answers POST {SCORE_PATH} only", param="model",
                           code="model_not_supported")
        if engine is None:
            raise APIError(404, f"the model '{name}' does not exist; served: {', '.join(engines)}",
                           param="model", code="model_not_found")
        return engine

    def sampling_of(req) -> dict:
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        return dict(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
                    do_sample=(req.temperature > 0) if req.temperature is not None else None,
                    fit_context=req.fit_context, frequency_penalty=req.frequency_penalty,
                    presence_penalty=req.presence_penalty, logit_bias=req.logit_bias)

    limits = dict(max_tokens_cap=max_tokens_per_request or None, time_limit=max_request_seconds or None)

    def over_cap(exc: TokenCapError, req) -> APIError:
        """The 400 for a max_tokens that fits the context but not the operator's per-request cap."""
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        return APIError(400, f"{field}: {exc.max_new_tokens} is more than this server allows per request: at most "
                             f"{exc.cap} (its --max-tokens-per-request)", param=field, code="max_tokens_exceeded")

    def too_long(exc: ContextLengthError, req, prompt_field: str) -> APIError:
        """The 400 for a request that does not fit the model's context, naming the field to change."""
        if exc.what == "prompt":
            return APIError(400, f"{prompt_field}: {exc}", param=prompt_field, code="context_length_exceeded")
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        return APIError(400, f"{field}: {exc}".replace("max_new_tokens ", "", 1), param=field,
                        code="context_length_exceeded")

    async def generate(request: Request, cid: str, call, *args, **kwargs):
        """call(*args, stop_event=..., **kwargs) in a worker thread, stopped at its next token if the client
        disconnects first (then logged with the count, like a dropped stream, and None is returned)."""
        stop_event = threading.Event()
        work = asyncio.ensure_future(run_in_threadpool(call, *args, stop_event=stop_event, **kwargs))
        gone = asyncio.ensure_future(_until_disconnected(request.receive))
        try:
            load.generating += 1
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                stop_event.set()
                reply = await work
                print(f"{cid}: client disconnected; generation stopped after {reply.completion_tokens} tokens "
                      f"(limit {kwargs.get('max_new_tokens')})", file=sys.stderr, flush=True)
                return None
            return work.result()
        finally:
            load.generating -= 1
            stop_event.set()  # also when this handler is cancelled: the thread stops at its next token
            gone.cancel()

    def gone_response() -> JSONResponse:
        """What a request whose client left gets (nobody reads it; 499 as nginx logs it)."""
        return JSONResponse(error_body("client disconnected"), status_code=499)

    async def scored(engine, ids: list[int], top: int, prompt_field: str):
        """engine.score(ids, top) in a worker thread: each token's logprob and the `top` likeliest tokens."""
        if not hasattr(engine, "score"):
            raise APIError(400, "logprobs: not available with infer_backend vllm: serve with infer_backend: "
                                "huggingface", param="logprobs")
        try:
            return await run_in_threadpool(engine.score, ids, top)
        except ContextLengthError as exc:
            raise APIError(400, f"{prompt_field}: {exc}", param=prompt_field, code="context_length_exceeded") from None

    def tools_of(req):
        if req.tool_choice == "none":
            return None
        return req.tools or None

    @app.post(SCORE_PATH)
    async def score_evaluation(request: Request):
        """Each text's reward-model score. `model` names a served reward model; with one served, any name is it
        (LLaMA-Factory's client sends "model")."""
        req = await parse(request, ScoreRequest)
        scorer = scorers.get(req.model) or (next(iter(scorers.values())) if len(scorers) == 1 else None)
        if scorer is None:
            served = ", ".join(scorers) or "none (start tuneboard api with --reward-model RM_RUN)"
            raise APIError(404, f"model: '{req.model}' is not a served reward model; served: {served}",
                           param="model", code="model_not_found")
        empty = next((i for i, text in enumerate(req.messages) if not text), None)
        if empty is not None:
            raise APIError(400, f"messages[{empty}]: an empty text has nothing to score", param="messages")

        def work() -> list[float]:
            with scoring_lock:
                return scorer.score_texts(req.messages, req.max_length)

        load.generating += 1
        try:
            scores = await run_in_threadpool(work)
        finally:
            load.generating -= 1
        sid = f"scoreeval-{uuid.uuid4().hex}"
        print(f"{sid}: {scorer.__name__} scored {len(scores)} texts", file=sys.stderr, flush=True)
        return {"id": sid, "object": "score.evaluation", "model": scorer.__name__, "scores": scores}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request)
        engine = pick(req.model)
        refuse_unsupported(req)
        messages = to_engine_messages(req.messages)
        tools, sampling = tools_of(req), sampling_of(req)
        cid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        if req.logprobs and req.stream:
            raise APIError(400, "logprobs: not sent in a stream here; send stream: false", param="logprobs")
        if not req.stream:
            try:
                reply = await generate(request, cid, engine.chat, messages, tools, **sampling, **limits)
            except ContextLengthError as exc:
                raise too_long(exc, req, "messages") from None
            except TokenCapError as exc:
                raise over_cap(exc, req) from None
            except ValueError as exc:
                raise APIError(400, str(exc), param=error_param(str(exc), "messages")) from None
            if reply is None:
                return gone_response()
            message: dict[str, Any] = {"role": "assistant", "content": reply.text if reply.text or not reply.tool_calls
                                       else None}
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            logprobs = None
            if req.logprobs:
                prompt_ids = engine.prompt_ids(messages, tools)
                answer = reply.token_ids[:-1] if reply.token_ids[-1:] and reply.token_ids[-1] in engine.eos_ids \
                    else reply.token_ids  # the end-of-turn token is not part of the answer
                answer = covering(engine.tokenizer, answer, reply.text or "")
                tokens = (await scored(engine, prompt_ids + answer, req.top_logprobs or 0, "messages"))[len(prompt_ids):]
                logprobs = chat_logprobs(engine.tokenizer, tokens)
            return {"id": cid, "object": "chat.completion", "created": now, "model": req.model,
                    "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                 "finish_reason": _finish(reply.finish_reason)}],
                    "usage": _usage(reply)}

        stop_event = threading.Event()
        try:
            if tools:  # tool calls are only known once the answer is complete
                stream = None
                reply_now = await generate(request, cid, engine.chat, messages, tools, **sampling, **limits)
                if reply_now is None:
                    return gone_response()
            else:  # the prompt is tokenized in a worker thread: a huge one does not hold the other requests
                stream = await run_in_threadpool(lambda: engine.stream(messages, None, stop_event=stop_event,
                                                                       **sampling, **limits))
                reply_now = None
        except ContextLengthError as exc:
            raise too_long(exc, req, "messages") from None
        except TokenCapError as exc:
            raise over_cap(exc, req) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=error_param(str(exc), "messages")) from None

        def chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> dict:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            return {"id": cid, "object": "chat.completion.chunk", "created": now, "model": req.model,
                    "choices": choices, **({"usage": usage} if _include_usage(req) else {})}

        def whole(reply):
            if reply.text:
                yield chunk({"content": reply.text})
            if reply.tool_calls:
                yield chunk({"tool_calls": [{"index": k, **call} for k, call in enumerate(reply.tool_calls)]})

        return _sse(cid, stream, reply_now, stop_event, sampling.get("max_new_tokens"), load, request.receive,
                    head=[chunk({"role": "assistant", "content": ""})], piece=lambda text: chunk({"content": text}),
                    whole=whole, finish=lambda reason: chunk({}, reason),
                    usage=(lambda u: chunk(None, usage=u)) if _include_usage(req) else None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        """Raw text completion with no chat template (what base models and eval harnesses use)."""
        req = await parse(request, CompletionRequest)
        engine = pick(req.model)
        refuse_unsupported(req)
        one_ids = isinstance(req.prompt, list) and bool(req.prompt) and isinstance(req.prompt[0], int)
        prompts = [req.prompt] if isinstance(req.prompt, str) or one_ids else req.prompt
        if not prompts or prompts[0] in ("", []):
            raise APIError(400, "prompt: empty: give the text (or token ids) to continue", param="prompt")
        if len(prompts) != 1:
            raise APIError(400, f"prompt: one prompt per request is supported (got {len(prompts)})", param="prompt")
        if req.suffix:
            raise APIError(400, "suffix: insertion (fill-in-the-middle) is not supported", param="suffix")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: 0 only scores the prompt, which needs echo: true", param="max_tokens")
        if req.stream and (req.logprobs is not None or req.max_tokens == 0):
            field = "logprobs" if req.logprobs is not None else "max_tokens"
            raise APIError(400, f"{field}: logprobs and max_tokens 0 are not streamed here; send stream: false",
                           param=field)
        prompt, sampling = prompts[0], sampling_of(req)
        if not isinstance(prompt, str) and not prompt:
            raise APIError(400, "prompt: no tokens given", param="prompt")
        cid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            echo = "" if not req.echo else prompt if isinstance(prompt, str) else \
                await run_in_threadpool(lambda: engine.tokenizer.decode(engine.prompt_ids(prompt)))
            if not req.stream:
                if req.max_tokens == 0:  # score the prompt, generate nothing
                    count = len(await run_in_threadpool(engine.prompt_ids, prompt))
                    reply = Reply("", finish_reason="length", prompt_tokens=count)
                else:
                    reply = await generate(request, cid, engine.chat, prompt, None, **sampling, **limits)
                if reply is None:
                    return gone_response()
                logprobs = None
                if req.logprobs is not None:
                    prompt_ids = await run_in_threadpool(engine.prompt_ids, prompt)
                    answer = covering(engine.tokenizer, reply.token_ids, reply.text)
                    tokens = await scored(engine, prompt_ids + answer, req.logprobs, "prompt")
                    logprobs = legacy_logprobs(engine.tokenizer, tokens if req.echo else tokens[len(prompt_ids):])
                return {"id": cid, "object": "text_completion", "created": now, "model": req.model,
                        "choices": [{"index": 0, "text": echo + reply.text, "logprobs": logprobs,
                                     "finish_reason": _finish(reply.finish_reason)}],
                        "usage": _usage(reply)}
            stop_event = threading.Event()
            stream = await run_in_threadpool(lambda: engine.stream(prompt, None, stop_event=stop_event, **sampling,
                                                                   **limits))
        except ContextLengthError as exc:
            raise too_long(exc, req, "prompt") from None
        except TokenCapError as exc:
            raise over_cap(exc, req) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=error_param(str(exc), "prompt")) from None

        def chunk(text: str | None, finish: str | None = None, usage: dict | None = None) -> dict:
            choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
            return {"id": cid, "object": "text_completion", "created": now, "model": req.model,
                    "choices": choices, **({"usage": usage} if _include_usage(req) else {})}

        return _sse(cid, stream, None, stop_event, sampling.get("max_new_tokens"), load, request.receive,
                    head=[chunk(echo)] if echo else [], piece=chunk, whole=None,
                    finish=lambda reason: chunk("", reason),
                    usage=(lambda u: chunk(None, usage=u)) if _include_usage(req) else None)

    return app


def _token_names(tokenizer, tokens) -> dict[int, str]:
    """token id -> its text (special tokens written out), for every token and top token of `tokens`."""
    ids = sorted({t.token_id for t in tokens} | {i for t in tokens for i, _ in t.top})
    return dict(zip(ids, tokenizer.batch_decode([[i] for i in ids]))) if ids else {}


def covering(tokenizer, ids: list[int], text: str) -> list[int]:
    """The first of the answer's token ids that make up `text`, the answer as returned: a stop string cuts the
    text, not the tokens generated, and logprobs cover what the client gets (the last one kept may hold the
    stop string's start where the cut falls inside a token)."""
    if not ids or tokenizer.decode(ids, skip_special_tokens=True) == text:
        return list(ids)
    low, high = 0, len(ids)  # the fewest tokens whose text reaches len(text)
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= len(text):
            high = mid
        else:
            low = mid + 1
    return list(ids[:low])


def legacy_logprobs(tokenizer, tokens) -> dict:
    """OpenAI's legacy completions logprobs of engine TokenLogprobs: tokens, token_logprobs, top_logprobs
    ({text: logprob} of the likeliest tokens and the chosen one; null where the logprob is) and text_offset
    (where each token's text starts in the choice's text)."""
    names, out, offset = _token_names(tokenizer, tokens), {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}, 0
    for t in tokens:
        text = names[t.token_id]
        top = None
        if t.logprob is not None:
            top = {}
            for i, value in t.top:  # best first: a text two tokens share keeps the higher logprob
                top.setdefault(names[i], value)
            top.setdefault(text, t.logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer, tokens) -> dict:
    """OpenAI's chat logprobs of engine TokenLogprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    names = _token_names(tokenizer, tokens)

    def entry(token_id: int, value: float) -> dict:
        return {"token": names[token_id], "logprob": value, "bytes": list(names[token_id].encode("utf-8"))}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                        for t in tokens], "refusal": None}


def _include_usage(req) -> bool:
    """Whether a stream ends with a usage chunk; then every chunk has the field, null but in that one (OpenAI's:
    without it no chunk has the field)."""
    return bool(req.stream_options and req.stream_options.include_usage)


def _sse(cid: str, stream, reply_now, stop_event: threading.Event, limit, load: _Load, receive, *, head, piece,
         whole, finish, usage):
    """The server-sent events of one streamed answer: `head` chunks, then piece(text) per generated piece
    of `stream` (or whole(reply_now), when the answer had to be complete first), finish(reason), and
    usage(counts) when asked for; each chunk a dict. An error after the headers went out is reported in
    the stream, as OpenAI does. However the stream ends (done, error, client gone), stop_event is set so
    the generation thread stops at its next token; a client that went away is logged with the count. The
    disconnect is watched (`receive`) while waiting for the next piece too, so a stream still queued for
    the model ends when its client leaves, not when its first token comes."""
    from starlette.concurrency import run_in_threadpool  # heavy: loaded on use, so importing this module stays light
    from fastapi.responses import StreamingResponse  # heavy: loaded on use, so importing this module stays light

    def data(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events():
        end, finished = object(), False
        load.generating += stream is not None
        try:
            for body in head:
                yield data(body)
            if stream is None:
                reply = reply_now
                for body in whole(reply):
                    yield data(body)
            else:
                pieces = iter(stream)
                gone = asyncio.ensure_future(_until_disconnected(receive))
                try:
                    while True:
                        step = asyncio.ensure_future(run_in_threadpool(next, pieces, end))
                        await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
                        if not step.done():  # the client left: stop, let the thread hand back its piece
                            stop_event.set()
                            await step
                            return
                        text = step.result()
                        if text is end:
                            break
                        yield data(piece(text))
                finally:
                    gone.cancel()
                reply = stream.reply
            yield data(finish(_finish(reply.finish_reason)))
            if usage:
                yield data(usage(_usage(reply)))
            finished = True
        except Exception as exc:  # headers are sent: report in-band
            traceback.print_exc(file=sys.stderr)
            yield data(error_body(f"{exc.__class__.__name__}: {exc}", "server_error"))
            finished = True
        finally:
            load.generating -= stream is not None
            stop_event.set()
            if not finished and stream is not None:  # cancelled or closed: the client went away
                threading.Thread(target=_report_disconnect, args=(cid, stream, limit), daemon=True).start()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _report_disconnect(cid: str, stream, limit) -> None:
    """One log line once the generation behind a dropped stream has really ended."""
    generated = stream.join(timeout=120)
    said = "still running after 120 s" if generated is None else f"stopped after {generated} tokens"
    print(f"{cid}: client disconnected; generation {said} (limit {limit})", file=sys.stderr, flush=True)


def _finish(reason: str) -> str:
    """The engine's finish_reason on the wire: stop, length, tool_calls, or time_limit (this server's
    --max-request-seconds ended the answer; OpenAI has no such limit, so no name of its own for it)."""
    return "stop" if reason == "abort" else reason


def _usage(reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


# ------------------------------------------------------------------------------------------- server
def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 = a free one), so the ready line can name the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def end_when_stdin_closes() -> None:
    """SIGTERM this process (uvicorn's graceful shutdown) once standard input reaches end of file."""
    def watch() -> None:
        # the file descriptor, not sys.stdin: a thread blocked in the buffered reader holds its lock, and an exit
        # while it waits (a startup error) aborts the interpreter ("could not acquire lock for <stdin>")
        try:
            while os.read(0, 65536):
                pass
        except OSError:  # no standard input at all: nothing to wait for
            return
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def serve(app, sock: socket.socket, host: str, announce=print) -> None:
    import uvicorn  # heavy: loaded on use, so importing this module stays light

    port = sock.getsockname()[1]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:
                announce(f"serving on {url}")

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    Server(config).run(sockets=[sock])


def load_scorers(entries: list[str], spec) -> dict:
    """--reward-model [NAME=]PATH entries -> {name: RewardModelReward}, loaded as stage ppo loads a reward model
    (so the scores are the ones it computes in-process); ValueError naming the entry when one is no reward model."""
    from backend.evaluation.reward_score import RewardModelReward  # heavy (torch): only when a reward model is served

    scorers = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or os.path.exists(entry):
            name, path = os.path.basename(entry.rstrip("/\\")) or entry, entry
        try:
            scorers[name] = RewardModelReward(path, name, trust_remote_code=bool(getattr(spec, "trust_remote_code",
                                                                                       False)))
        except ValueError as exc:
            raise ValueError(f"--reward-model {entry}: {exc}") from None
    return scorers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tuneboard api",
        description="Serve a model (+ adapters) over an OpenAI-compatible HTTP API.",
        epilog="Each served model is chosen by the request's `model` field: the base model under its "
               "model_name_or_path, each adapter under its folder name (or NAME from NAME=PATH).")
    p.add_argument("spec", nargs="*", help="[SPEC.yaml] [key=value ...]: model_name_or_path, adapter_name_or_path "
                                          "(comma list = stacked into one model), template, sampling defaults, ...")
    p.add_argument("--model", help="model id or path (overrides model_name_or_path; default: the bundled model)")
    p.add_argument("--adapter", action="append", default=[], metavar="[NAME=]PATH",
                   help="serve this LoRA adapter (or checkpoint-N) as its own model; repeatable; "
                        "PATH may be a comma list of adapters merged in order")
    p.add_argument("--no-base", action="store_true", help="do not serve the base model itself")
    p.add_argument("--reward-model", action="append", default=[], metavar="[NAME=]PATH",
                   help="serve this reward model (a stage rm run's folder, LoRA or full, or a sequence-classification "
                        f"folder) on POST {SCORE_PATH} (what stage ppo's reward_model_type api asks); repeatable. "
                        "Alone (no spec, --model or --adapter) it is the only model served")
    p.add_argument("--template", help="chat template (overrides template)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port; the ready line names it)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without an API key (anyone who reaches it can use it)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="requests in progress beyond one per loaded model (all take turns on the model, a few "
                        f"tokens each); more get 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-tokens-per-request", type=int, default=DEFAULT_MAX_TOKENS_PER_REQUEST, metavar="N",
                   help="most tokens one request may generate: asking more is a 400 naming max_tokens and N; "
                        "left out, max_tokens is at most N (and what fits the context). A flat default, well "
                        f"under today's contexts, whatever the model (default {DEFAULT_MAX_TOKENS_PER_REQUEST}; "
                        "0: only the context bounds it)")
    p.add_argument("--max-request-seconds", type=float, default=DEFAULT_MAX_REQUEST_SECONDS, metavar="S",
                   help="a generation running longer ends with finish_reason \"time_limit\", streamed or not "
                        f"(default {DEFAULT_MAX_REQUEST_SECONDS:g}; 0: no limit; not enforced by infer_backend vllm)")
    p.add_argument("--exit-with-stdin", action="store_true",
                   help="end when standard input closes: the web UI gives its chat server a pipe it never writes to, "
                        "so the server ends with the UI process however that ends (even killed)")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from this origin (repeatable; off by default)")
    return p


def option_problem(opts) -> str | None:
    """The one line for a --host, --port or --api-key that cannot work, or None."""
    if not opts.host:
        return "--host is empty: give an address to listen on, such as 127.0.0.1"
    if not 0 <= opts.port <= 65535:
        return f"--port must be 0-65535 (got {opts.port})"
    key = opts.api_key if opts.api_key is not None else os.environ.get(API_KEY_ENV)
    if key and not (key.isascii() and key.isprintable()):
        return ("the API key holds characters other than printable ASCII: an HTTP client cannot send it in its "
                "Authorization header")
    return None


def main(argv: list[str]) -> int:
    opts = build_parser().parse_intermixed_args(argv)
    opts.host = opts.host.strip()
    if opts.host.startswith("[") and opts.host.endswith("]"):  # [::1], as URLs write it
        opts.host = opts.host[1:-1]
    problem = option_problem(opts)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if opts.exit_with_stdin:  # before the model loads: a UI that dies meanwhile leaves nothing behind
        end_when_stdin_closes()
    spec = load_or_report(opts.spec)
    if spec is None:
        return 1
    changes = {}
    if opts.model:
        changes["model_name_or_path"] = opts.model
    if opts.template:
        changes["template"] = opts.template
    api_key = opts.api_key if opts.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if not api_key and not is_loopback(opts.host) and not opts.insecure_no_auth:
        print(f"error: refusing to serve on {opts.host} without an API key: anyone who can reach this machine "
              f"could use the model. Add --api-key KEY (or set ${API_KEY_ENV}), or pass --insecure-no-auth if "
              "you really mean it.", file=sys.stderr)
        return 2
    if not api_key and not is_loopback(opts.host):
        print(f"warning: serving on {opts.host} without an API key (--insecure-no-auth): anyone who can reach it "
              "can use it", file=sys.stderr, flush=True)
    for flag, value in (("--max-queue", opts.max_queue), ("--max-tokens-per-request", opts.max_tokens_per_request),
                        ("--max-request-seconds", opts.max_request_seconds)):
        if not value >= 0:  # also NaN
            print(f"error: {flag} must be >= 0 (got {value:g})", file=sys.stderr)
            return 2


    spec = replace_spec(spec, **changes) if changes else spec
    include_base = not opts.no_base or not (opts.adapter or spec.adapter_name_or_path)
    try:
        sock = bind(opts.host, opts.port)  # before loading: a taken port fails fast
    except OSError as exc:
        print(f"error: cannot listen on {opts.host}:{opts.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        scorers = load_scorers(opts.reward_model, spec)
        only_scoring = bool(scorers) and not (opts.spec or opts.model or opts.adapter)
        engines = {} if only_scoring else load_engines(spec, opts.adapter, include_base=include_base)
    except (ValueError, FileNotFoundError, NotImplementedError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name in engines:
        print(f"model: {name}", flush=True)
    for name in scorers:
        print(f"reward model: {name} (POST {SCORE_PATH})", flush=True)
    if opts.max_request_seconds and not all(getattr(e, "enforces_time_limit", False) for e in engines.values()):
        print(f"warning: --max-request-seconds {opts.max_request_seconds:g} is not enforced by this backend (vLLM): "
              "only --max-tokens-per-request bounds a request", file=sys.stderr, flush=True)
    app = create_app(engines, api_key=api_key, cors=opts.cors or None, max_queue=opts.max_queue,
                     max_tokens_per_request=opts.max_tokens_per_request,
                     max_request_seconds=opts.max_request_seconds, scorers=scorers)
    serve(app, sock, opts.host, announce=lambda line: print(line, flush=True))
    return 0
