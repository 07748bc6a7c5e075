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
never logged: every message built here goes through `redact()`.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RETRY_STATUSES = {408, 409, 425, 429, 500, 502, 503, 504}
MAX_RETRY_AFTER_S = 60.0


class TeacherError(Exception):
    """One chunk could not be answered (after its retries)."""


class TeacherFatal(Exception):
    """The teacher cannot answer any chunk: stop the run."""


class BudgetExhausted(Exception):
    pass


@dataclass
class Answer:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    attempts: int


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
                 log=print):
        import httpx

        self.base_url, self.model, self.temperature, self.max_tokens = base_url.rstrip("/"), model, temperature, max_tokens
        self.max_retries, self.backoff, self.budget, self.stop, self.log = max_retries, backoff, budget, stop, log
        self._secret = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

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
            r = self.client.get("/models")
            return [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []
        except Exception:  # noqa: BLE001 - optional convenience
            return []

    def ask(self, messages: list[dict]) -> Answer:
        """One chat completion, with retries on 429/5xx/timeouts/malformed replies, each attempt taken from
        the budget. Raises TeacherError, TeacherFatal or BudgetExhausted."""
        import httpx

        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            if self.stop():
                raise TeacherError("stopped")
            self.budget.take()
            wait = self.backoff * (2 ** attempt)
            try:
                r = self.client.post("/chat/completions", json=body)
            except httpx.TimeoutException:
                last = f"timed out after {self.client.timeout.read:g} s (request_timeout)"
            except httpx.ConnectError as exc:
                last = f"cannot connect to {self.base_url}: {exc}"
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                last = f"the connection broke mid-reply ({type(exc).__name__}: {exc})"
            else:
                if r.status_code == 200:
                    try:
                        return self._parse(r, attempt + 1)
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        last = f"malformed reply (HTTP 200 but {exc})"
                elif r.status_code in RETRY_STATUSES:
                    last = f"HTTP {r.status_code}: {self._message(r)}"
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
                                                   f"{self._message(r)} ({hint})"))
            last = self.redact(last)
            if attempt < self.max_retries:
                self.log(f"teacher: {last}; retry {attempt + 1}/{self.max_retries} in {wait:.1f} s")
                self._sleep(wait)
        raise TeacherError(f"{last} (after {self.max_retries + 1} attempts)")

    @staticmethod
    def _message(r) -> str:
        try:
            err = r.json().get("error")
            text = err.get("message") if isinstance(err, dict) else str(err or r.text)
        except ValueError:
            text = r.text
        text = " ".join(str(text).split())
        return text[:300] or r.reason_phrase

    @staticmethod
    def _parse(r, attempts: int) -> Answer:
        data = json.loads(r.content)  # ValueError on a truncated or non-JSON body
        if not isinstance(data, dict):
            raise ValueError("the body is not a JSON object")
        if "error" in data and "choices" not in data:
            raise ValueError(f"an error in the body: {data['error']}")
        choice = data["choices"][0]
        content = choice["message"].get("content")
        usage = data.get("usage") or {}
        return Answer(text=content if isinstance(content, str) else "", finish_reason=str(choice.get("finish_reason")),
                      prompt_tokens=int(usage.get("prompt_tokens") or 0),
                      completion_tokens=int(usage.get("completion_tokens") or 0), attempts=attempts)


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
        argv = [sys.executable, "-m", "backend.cli", "api", f"model_name_or_path={self.model}",
                f"template={self.template}", "do_sample=false", "--port", "0"]
        if self.adapter:
            argv += ["--adapter", self.adapter]
        env = {**os.environ, "TUNEBOARD_API_KEY": self.key}
        self.log(f"starting the local teacher: tuneboard api model_name_or_path={self.model}"
                 + (f" --adapter {self.adapter}" if self.adapter else ""))
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=_die_with_parent, cwd=str(Path(__file__).resolve().parents[2]))
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


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the run's finally still stops it
        pass
