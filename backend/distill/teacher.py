"""The teacher: any OpenAI-compatible chat endpoint, or a `tuneboard api` started for the run (teacher: local).

httpx, not the `openai` package: we need our own retry policy (which statuses, Retry-After, a request budget
shared by every thread, retries counted against it) and the exact failure of each attempt for the log; the
openai client retries on its own and hides the attempts. Failures are sorted into:
- TeacherFatal: retrying cannot help (refused API key 401/403, unknown model 404, a request the endpoint
  rejects 400/422, the endpoint unreachable after every retry): the run stops with one clear line;
- TeacherError: this chunk failed after its retries (429, 5xx, timeouts, a malformed or truncated reply):
  counted as "teacher error", not cached, asked again by the next run;
- BudgetExhausted: max_requests is spent.
The API key comes from an environment variable or a file; it is sent in the Authorization header and is
never logged: every message built here goes through `redact()`. No redirect is followed (a 3xx is fatal and
names its target), so the header only ever goes to the base URL the key was configured with; for the web
UI (backend.core.teacher_access.restricted()) the client also refuses, at connect time, a host that resolves to
an internal address, unless the operator allowed its base URL.

A reply is read up to a byte budget derived from max_tokens (reply_budget: 16 bytes a token + 32 KiB for
the envelope): past it, reading stops, and the reply is an Answer with finish_reason CUT and only the head
of the body kept (the pipeline rejects it as "too long"); an error body is read up to 16 KiB.
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from backend.core import paths, teacher_access
from backend.core.supervise import die_with_parent
import httpx

RETRY_STATUSES = {408, 409, 425, 429, 500, 502, 503, 504}
MAX_RETRY_AFTER_S = 60.0
REPLY_BYTES_PER_TOKEN = 16        # a token is a few characters; JSON-escaped non-ASCII text is 6 bytes a char
REPLY_MARGIN_BYTES = 32 * 1024    # the envelope: id, model, usage, a provider's extra fields
ERROR_BODY_BYTES = 16 * 1024      # of an error reply, enough for its message
HEAD_BYTES = 4096                 # of a reply over its budget: what is kept to show
CUT = "cut"                       # Answer.finish_reason of a reply whose body went past the budget


def reply_budget(max_tokens: int) -> int:
    """Bytes a reply body may have for `max_tokens` answer tokens; reading stops past it."""
    return max_tokens * REPLY_BYTES_PER_TOKEN + REPLY_MARGIN_BYTES


class TeacherError(Exception):
    """One chunk could not be answered (after its retries)."""


class TeacherFatal(Exception):
    """The teacher cannot answer any chunk: stop the run."""


class BudgetExhausted(Exception):
    """max_requests is spent. `attempts`: the requests this chunk had made before (0: it was never asked);
    `last`: why the last of them failed (a chunk retried until the budget ran out)."""

    def __init__(self, message: str, attempts: int = 0, last: str = ""):
        super().__init__(message)
        self.attempts, self.last = attempts, last


@dataclass
class Answer:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    attempts: int
    reply_bytes: int = 0  # the body's size (a CUT reply: its Content-Length, else the bytes read before stopping)


def read_api_key(env_name: str | None, key_file: str | None) -> str | None:
    """The key from key_file's first line, else from $env_name; None when neither has one."""
    if key_file:
        lines = Path(key_file).expanduser().read_text(encoding="utf-8").splitlines()
        key = lines[0].strip() if lines else ""
        return key or None
    return (os.environ.get(env_name) or "").strip() or None if env_name else None


class Budget:
    """max_requests shared by every worker thread (0 = unlimited)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self.limit and self.used >= self.limit:
                raise BudgetExhausted(f"max_requests {self.limit} spent")
            self.used += 1


class Teacher:
    def __init__(self, base_url: str, model: str, api_key: str | None, *, timeout: float, max_retries: int,
                 backoff: float, temperature: float, max_tokens: int, budget: Budget, stop=lambda: False,
                 log=print, guard: bool = False):
        """`guard`: refuse to connect to an internal address (the web UI's policy, backend.core.teacher_access)."""

        self.base_url, self.model, self.temperature, self.max_tokens = base_url.rstrip("/"), model, temperature, max_tokens
        self.max_retries, self.backoff, self.budget, self.stop, self.log = max_retries, backoff, budget, stop, log
        self.max_bytes = reply_budget(max_tokens)
        self._secret = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        transport = httpx.HTTPTransport()
        if guard:
            transport._pool._network_backend = _guarded_backend()  # httpcore's pool makes each connection with it
        # follow_redirects=False (httpx's default, said out loud): the key goes to this base URL and nowhere else
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport,
                                   follow_redirects=False)

    def close(self) -> None:
        self.client.close()

    def redact(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop():
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    def list_models(self) -> list[str]:
        """/models ids (used to name the local teacher's model); [] when the endpoint has no such route."""
        try:
            with self.client.stream("GET", "/models") as r:
                body, _, cut = _read_capped(r, self.max_bytes)
            if r.status_code != 200 or cut:
                return []
            return [str(m["id"]) for m in json.loads(body).get("data", [])]
        except TeacherFatal:
            raise
        except Exception:  # noqa: BLE001 - optional convenience
            return []

    def ask(self, messages: list[dict]) -> Answer:
        """One chat completion, with retries on 429/5xx/timeouts/malformed replies, each attempt taken from
        the budget. Raises TeacherError, TeacherFatal or BudgetExhausted."""

        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            if self.stop():
                raise TeacherError("stopped")
            try:
                self.budget.take()
            except BudgetExhausted as exc:
                raise BudgetExhausted(str(exc), attempt, last if attempt else "") from None
            wait = self.backoff * (2 ** attempt)
            try:
                with self.client.stream("POST", "/chat/completions", json=body) as r:
                    limit = self.max_bytes if r.status_code == 200 else ERROR_BODY_BYTES
                    raw, size, cut = _read_capped(r, limit)
            except httpx.TimeoutException:
                last = f"timed out after {self.client.timeout.read:g} s (request_timeout)"
            except httpx.ConnectError as exc:
                last = f"cannot connect to {self.base_url}: {exc}"
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                last = f"the connection broke mid-reply ({type(exc).__name__}: {exc})"
            else:
                if r.status_code == 200 and cut:
                    head = raw[:HEAD_BYTES].decode("utf-8", errors="replace")
                    return Answer(text=head, finish_reason=CUT, prompt_tokens=0, completion_tokens=0,
                                  attempts=attempt + 1, reply_bytes=size)
                if r.status_code == 200:
                    try:
                        return self._parse(raw, attempt + 1)
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        last = f"malformed reply (HTTP 200 but {str(exc)[:300]})"
                elif r.is_redirect or 300 <= r.status_code < 400:
                    target = " ".join(str(r.headers.get("location") or "nowhere").split())[:200]
                    raise TeacherFatal(self.redact(
                        f"teacher {self.base_url}: HTTP {r.status_code} redirect to {target}: redirects are not "
                        "followed (the API key is only sent to the base URL it was given for): set teacher to "
                        "the final base URL"))
                elif r.status_code in RETRY_STATUSES:
                    last = f"HTTP {r.status_code}: {teacher_access.error_line(raw, r.reason_phrase)}"
                    retry_after = r.headers.get("retry-after")
                    if retry_after:
                        try:
                            wait = min(MAX_RETRY_AFTER_S, max(wait, float(retry_after)))
                        except ValueError:
                            pass
                else:
                    hint = {401: "the API key was refused: check the variable named by teacher_api_key_env "
                                 "(or teacher_api_key_file)",
                            403: "the API key may not use this model",
                            404: "unknown route or model: check teacher (the base URL, ending in /v1) and "
                                 "teacher_model"}.get(r.status_code, "the endpoint refused the request")
                    raise TeacherFatal(self.redact(f"teacher {self.base_url}: HTTP {r.status_code}: "
                                                   f"{teacher_access.error_line(raw, r.reason_phrase)} ({hint})"))
            last = self.redact(last)
            if attempt < self.max_retries:
                self.log(f"teacher: {last}; retry {attempt + 1}/{self.max_retries} in {wait:.1f} s")
                self._sleep(wait)
        raise TeacherError(f"{last} (after {self.max_retries + 1} attempts)")

    @staticmethod
    def _parse(raw: bytes, attempts: int) -> Answer:
        data = json.loads(raw)  # ValueError on a truncated or non-JSON body
        if not isinstance(data, dict):
            raise ValueError("the body is not a JSON object")
        if "error" in data and "choices" not in data:
            raise ValueError(f"an error in the body: {data['error']}")
        choice = data["choices"][0]
        content = choice["message"].get("content")
        usage = data.get("usage") or {}
        return Answer(text=content if isinstance(content, str) else "", finish_reason=str(choice.get("finish_reason")),
                      prompt_tokens=int(usage.get("prompt_tokens") or 0),
                      completion_tokens=int(usage.get("completion_tokens") or 0), attempts=attempts,
                      reply_bytes=len(raw))


def _read_capped(r, limit: int) -> tuple[bytes, int, bool]:
    """(body, size, cut) of a streamed httpx response, reading at most `limit` (+ one network chunk) bytes:
    a declared Content-Length over the limit stops it after HEAD_BYTES. `size`: the declared length when
    known, else the bytes read. Leaving the `with client.stream()` block early drops the connection."""
    declared = r.headers.get("content-length", "")
    declared = int(declared) if declared.isdigit() else None
    stop_at = HEAD_BYTES if declared is not None and declared > limit else limit
    buf = bytearray()
    for piece in r.iter_bytes():  # decoded (gzip included): the budget holds for what we keep in memory
        buf += piece
        if len(buf) > stop_at:
            break
    cut = len(buf) > limit or (declared is not None and declared > limit)
    return bytes(buf), (declared if declared is not None else len(buf)), cut


def _guarded_backend():
    import httpcore  # heavy: loaded on use, so importing this module stays light

    class GuardedBackend(httpcore.SyncBackend):
        """Resolves the host itself, refuses it when any address is internal, and connects to the address it
        checked (so a name cannot answer differently between the check and the connection). TLS still checks
        the certificate against the host name (httpcore passes the origin's name as server_hostname)."""

        def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            try:
                addresses = teacher_access.resolve(host, port)
            except (OSError, UnicodeError) as exc:
                raise httpcore.ConnectError(f"{host}: {exc}") from None
            inner = [a for a in addresses if not teacher_access.is_public(a)]
            if inner:
                raise TeacherFatal(f"teacher: {host} resolves to {inner[0]}, an internal address: not connecting "
                                   "(the server's operator can allow this base URL with "
                                   "`tuneboard webui --allow-teacher-url URL`)")
            return super().connect_tcp(addresses[0], port, timeout, local_address, socket_options)

    return GuardedBackend()


# ------------------------------------------------------------------------------------------ prompts
def teacher_messages(task: str, chunk: str, schema: dict | None, examples: list[dict], answer_format: str) -> list[dict]:
    """System prompt (task, schema, output rules), the examples as earlier turns, then the chunk."""
    rules = [task.strip()]
    if answer_format == "json":
        if schema is not None:
            rules.append("Answer with one JSON value that validates against this JSON Schema:\n"
                         + json.dumps(schema, ensure_ascii=False, indent=1))
        rules.append("Reply with the JSON only: no prose, no code fence.")
    messages = [{"role": "system", "content": "\n\n".join(rules)}]
    for ex in examples:
        output = ex["output"] if isinstance(ex["output"], str) else json.dumps(ex["output"], ensure_ascii=False)
        messages += [{"role": "user", "content": str(ex["input"])}, {"role": "assistant", "content": output}]
    messages.append({"role": "user", "content": chunk})
    return messages


# ------------------------------------------------------------------------------------ local teacher
class LocalTeacher:
    """`tuneboard api` on a free loopback port for the duration of the run, guarded by a one-off random API
    key (kept in memory only; the child gets it through its environment). The child dies with us
    (PR_SET_PDEATHSIG on Linux) even after a kill -9."""

    def __init__(self, model: str, adapter: str | None, template: str, log_path: Path, log=print):
        self.model, self.adapter, self.template, self.log_path, self.log = model, adapter, template, log_path, log
        self.key = "tb-" + secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self, timeout: float = 600.0) -> str:
        argv = paths.tuneboard_argv("api", f"model_name_or_path={self.model}",
                f"template={self.template}", "do_sample=false", "--port", "0",
                # the run's private teacher: answer_tokens bounds each request, request_timeout its time
                "--max-tokens-per-request", "0", "--max-request-seconds", "0")
        if self.adapter:
            argv += ["--adapter", self.adapter]
        env = {**os.environ, "TUNEBOARD_API_KEY": self.key}
        self.log(f"starting the local teacher: tuneboard api model_name_or_path={self.model}"
                 + (f" --adapter {self.adapter}" if self.adapter else ""))
        # it dies with this run (off Linux, the run's finally stops it)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
                                     cwd=str(Path(__file__).resolve().parents[2]))
        ready = threading.Event()
        log_file = open(self.log_path, "a", encoding="utf-8")

        def pump():
            for line in self.proc.stdout:
                log_file.write(line)
                log_file.flush()
                if line.startswith("serving on "):
                    self.url = line.split()[-1].strip() + "/v1"
                    ready.set()
            log_file.close()
            ready.set()

        threading.Thread(target=pump, daemon=True, name="teacher-log").start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.5):
            if time.monotonic() > deadline:
                self.stop()
                raise TeacherFatal(f"the local teacher did not start within {timeout:.0f} s (see {self.log_path})")
        if not self.url:
            tail = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
            raise TeacherFatal("the local teacher failed to start: " + (" | ".join(tail) or "no output"))
        return self.url

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
