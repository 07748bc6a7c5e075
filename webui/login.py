"""The login's back-off and lockout, and the API kept behind the login (`tuneboard webui --auth`).

Gradio's own `/login` answers every wrong password at once, for ever, and its page embeds the API's
endpoint names (`window.gradio_api_info`) before anyone has logged in (its `/config` and `/info` already
need the login). `LoginGuard` is an ASGI middleware given to Gradio's FastAPI app (`launch(app_kwargs=
{"middleware": [...]})`), inside Gradio's own CORS and compression layers, that:

- counts wrong logins per client address and per user name: after each failure the next answer waits
  `base_delay_s * 2**(failures - 1)` (at most `max_delay_s`); after `max_failures` failures from one address
  (or `max_user_failures` for one user name, from any address) that address (user) is locked out for
  `lockout_s`: /login answers 429 with the reason and the wait, without checking the password. A right
  login clears the counts of its address and user.
- blanks `window.gradio_api_info` in the HTML pages served to a browser that is not logged in (the login
  page), so the endpoint names stay behind the login like /config and /info.

No module-level mutable state: the counts live in the middleware instance, one per app.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

from webui.i18n import tr

API_INFO_RE = re.compile(rb"(window\.gradio_api_info\s*=\s*)(.*?)(;\s*</script>)", re.S)
EMPTY_API_INFO = b'{"named_endpoints": {}, "unnamed_endpoints": {}}'


class LoginGuard:
    def __init__(self, app, max_failures: int = 5, max_user_failures: int = 20, lockout_s: float = 300.0,
                 base_delay_s: float = 0.5, max_delay_s: float = 8.0, clock=time.monotonic):
        self.app = app
        self.max_failures, self.max_user_failures = max_failures, max_user_failures
        self.lockout_s, self.base_delay_s, self.max_delay_s = lockout_s, base_delay_s, max_delay_s
        self.clock = clock
        self.failures: dict[tuple[str, str], int] = {}
        self.locked_until: dict[tuple[str, str], float] = {}

    # ------------------------------------------------------------------ bookkeeping (tested directly)

    def _limit(self, key: tuple[str, str]) -> int:
        return self.max_user_failures if key[0] == "user" else self.max_failures

    def locked_for(self, keys: list[tuple[str, str]]) -> float:
        """Seconds left of the longest lockout among `keys` (0 when none is locked). An ended lockout
        clears its count."""
        now, left = self.clock(), 0.0
        for key in keys:
            until = self.locked_until.get(key)
            if until is None:
                continue
            if until <= now:
                self.locked_until.pop(key, None)
                self.failures.pop(key, None)
            else:
                left = max(left, until - now)
        return left

    def delay_for(self, keys: list[tuple[str, str]]) -> float:
        n = max((self.failures.get(k, 0) for k in keys), default=0)
        return 0.0 if n == 0 else min(self.max_delay_s, self.base_delay_s * 2 ** (n - 1))

    def record(self, keys: list[tuple[str, str]], ok: bool) -> None:
        for key in keys:
            if ok:
                self.failures.pop(key, None)
                self.locked_until.pop(key, None)
                continue
            self.failures[key] = self.failures.get(key, 0) + 1
            if self.failures[key] >= self._limit(key):
                self.locked_until[key] = self.clock() + self.lockout_s

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope, receive, send):
        app = scope.get("app")
        if scope["type"] != "http" or getattr(app, "auth", None) is None:
            return await self.app(scope, receive, send)
        path = scope.get("path", "").rstrip("/")
        if scope["method"] == "POST" and path.endswith("/login"):
            return await self._login(scope, receive, send)
        if scope["method"] == "GET" and not _logged_in(scope, app):
            return await self._without_api_info(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _login(self, scope, receive, send):
        body, more = b"", True
        while more:  # the form is small; read it to learn the user name, then hand it on unchanged
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        user = (parse_qs(body.decode("latin-1")).get("username") or [""])[0].strip()
        client = (scope.get("client") or ("?", 0))[0]
        keys = [("ip", client)] + ([("user", user)] if user else [])
        left = self.locked_for(keys)
        if left > 0:
            return await _json(send, 429, {"detail": tr("en", "msg.login_locked", seconds=int(left + 0.999))},
                               [(b"retry-after", str(int(left + 0.999)).encode())])
        delay = self.delay_for(keys)
        if delay:
            await asyncio.sleep(delay)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        status = {}

        async def watch(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, replay, watch)
        code = status.get("code", 500)
        if code < 300:
            self.record(keys, ok=True)
        elif code in (400, 401, 403):
            self.record(keys, ok=False)

    async def _without_api_info(self, scope, receive, send):
        start: dict = {}
        chunks: list[bytes] = []

        async def hold(message):
            if message["type"] == "http.response.start":
                start.update(message)
                if not _is_html(message):
                    start["passed"] = True
                    await send(message)
                return
            if start.get("passed"):
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = API_INFO_RE.sub(lambda m: m.group(1) + EMPTY_API_INFO + m.group(3), b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": start["status"], "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, hold)


def _is_html(start_message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/html") for k, v in start_message.get("headers", []))


def _logged_in(scope, app) -> bool:
    """The request carries one of the app's login tokens (Gradio's access-token cookies)."""
    raw = b"; ".join(v for k, v in scope.get("headers", []) if k.lower() == b"cookie").decode("latin-1")
    cookie = SimpleCookie()
    try:
        cookie.load(raw)
    except Exception:  # a malformed cookie header: not logged in
        return False
    tokens = getattr(app, "tokens", {}) or {}
    cookie_id = getattr(app, "cookie_id", "")
    for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
        if name in cookie and cookie[name].value in tokens:
            return True
    return False


async def _json(send, status: int, payload: dict, extra_headers=()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
