"""A small OpenAI-compatible chat endpoint that misbehaves on purpose, for the distill tests (no network).

    server = FakeTeacher(mode="valid").start()   # server.url = http://127.0.0.1:PORT/v1
    server.mode = "429_then_ok"; server.requests  # every request seen (path, headers, body)

Modes: valid (a JSON answer that depends only on the chunk: {"first_word", "words", "topic"}), slow (valid,
after `delay` s), 429_then_ok (each chunk's first `fail_times` requests get 429 with Retry-After 0), 500,
bad_body (HTTP 200 whose body is not JSON), truncated (a body shorter than its Content-Length, then the
connection closes), answer_not_json (a well-formed reply whose content is prose), mixed (by the chunk's first
word: "empty" -> empty answer, "prose" -> not JSON, "wrong" -> a schema error, "long" -> finish_reason
length, else valid), huge (a valid reply whose answer is `huge_bytes` of prose, Content-Length declared),
huge_stream (the same without Content-Length: the body ends when the connection closes), gate (valid for the
first `gate_after` requests; later ones wait until `gate` is set), redirect (307 to `redirect_to` + the path).
A judge (backend/evaluation/judge.py) stand-in: judge_word (a reason, then `Verdict: A|B|tie`: the answer that contains
`judge_word`, tie when both or neither do), judge_first (always `Verdict: A`), judge_unparsed (prose, no verdict).
With `key`, a request without `Authorization: Bearer <key>` gets 401.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SCHEMA = {"type": "object", "required": ["first_word", "words", "topic"],
          "properties": {"first_word": {"type": "string"}, "words": {"type": "integer"},
                         "topic": {"type": "string"}}}


def answer_for(chunk: str) -> dict:
    words = re.findall(r"\w+", chunk)
    return {"first_word": words[0] if words else "", "words": len(words), "topic": "widgets" if "widget" in chunk.lower()
            else "other"}


class FakeTeacher:
    def __init__(self, mode: str = "valid", key: str | None = None, delay: float = 0.0, fail_times: int = 1):
        self.mode, self.key, self.delay, self.fail_times = mode, key, delay, fail_times
        self.huge_bytes, self.gate_after, self.gate, self.redirect_to = 10_000_000, 0, threading.Event(), ""
        self.judge_word = "good"
        self.requests: list[dict] = []
        self.failures: dict[str, int] = {}
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def start(self) -> "FakeTeacher":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: bytes, headers: dict | None = None, length: int | None = None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body) if length is None else length))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()

            def _send_huge(self, body: dict, declared: bool):
                """A reply of fake.huge_bytes of prose, written in pieces until the reader hangs up."""
                head = json.dumps({"id": "x", "object": "chat.completion", "model": body.get("model"),
                                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "@"},
                                                "finish_reason": "stop"}]}).encode()
                before, after = head.split(b"@")
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if declared:
                    self.send_header("Content-Length", str(len(before) + fake.huge_bytes + len(after)))
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                piece = b"All work and no play makes a dull teacher. " * 1000
                try:
                    self.wfile.write(before)
                    left = fake.huge_bytes
                    while left > 0:
                        self.wfile.write(piece[:left])
                        left -= len(piece)
                    self.wfile.write(after)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading: what it should do

            def do_GET(self):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-teacher"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with fake.lock:
                    fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if fake.key and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    return self._send(401, json.dumps({"error": {"message": "Incorrect API key provided"}}).encode())
                chunk = body["messages"][-1]["content"]
                mode = fake.mode
                if mode == "redirect":
                    return self._send(307, b"", {"Location": fake.redirect_to + self.path})
                if mode == "gate":
                    with fake.lock:
                        n = len(fake.requests)
                    if n > fake.gate_after:
                        fake.gate.wait()
                if mode.startswith("judge_"):
                    return self._send(200, json.dumps(judge_reply(fake, body, chunk)).encode())
                if mode in ("huge", "huge_stream"):
                    return self._send_huge(body, declared=mode == "huge")
                if mode == "slow":
                    time.sleep(fake.delay)
                if mode == "429_then_ok":
                    with fake.lock:
                        n = fake.failures.get(chunk, 0)
                        fake.failures[chunk] = n + 1
                    if n < fake.fail_times:
                        return self._send(429, b'{"error": {"message": "rate limited"}}', {"Retry-After": "0"})
                if mode == "500":
                    return self._send(500, b'{"error": {"message": "boom"}}')
                if mode == "bad_body":
                    return self._send(200, b"<html>gateway says hi")
                if mode == "truncated":
                    self._send(200, b'{"choices": [{"message": {"content": "{\\"a\\"', length=400)
                    self.close_connection = True
                    return
                finish, content = "stop", json.dumps(answer_for(chunk))
                if mode == "answer_not_json":
                    content = "Sure! Here is what I found."
                if mode == "mixed":
                    first = (re.findall(r"\w+", chunk) or [""])[0].lower()
                    content, finish = {"empty": ("", "stop"), "prose": ("Certainly, a widget.", "stop"),
                                       "wrong": (json.dumps({"first_word": 3}), "stop"),
                                       "long": ('{"first_word": "lo', "length")}.get(first, (content, finish))
                reply = {"id": "x", "object": "chat.completion", "model": body.get("model"),
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                      "finish_reason": finish}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
                self._send(200, json.dumps(reply).encode())

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)  # a client that hung up is no error here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def judge_reply(fake: "FakeTeacher", body: dict, content: str) -> dict:
    """A judge's reply to backend.evaluation.judge's message (<answer_a>...</answer_a>, <answer_b>...</answer_b>)."""
    if fake.mode == "judge_first":
        text = "The first one reads better.\nVerdict: A"
    elif fake.mode == "judge_unparsed":
        text = "Both answers have merits; I cannot decide."
    else:
        a = re.search(r"<answer_a>\n(.*?)\n</answer_a>", content, re.S).group(1)
        b = re.search(r"<answer_b>\n(.*?)\n</answer_b>", content, re.S).group(1)
        has_a, has_b = fake.judge_word in a, fake.judge_word in b
        verdict = "A" if has_a and not has_b else "B" if has_b and not has_a else "tie"
        text = f"Only one answer says {fake.judge_word}." if verdict != "tie" else "Equally good."
        text += f"\nVerdict: {verdict}"
    return {"id": "x", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


# ------------------------------------------------------------------------ documents and checks the tests share
KEY = "sk-distill-secret-0123456789"
TASK = "Extract the first word, the word count and the topic as JSON."
LONG = " ".join(f"Widget fact number {i} says the widget is blue and costs {i} dollars." for i in range(30))


def make_pdf(path: Path, text: str) -> None:
    """A one-page PDF with `text` in Helvetica (enough for pypdf's text extraction)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    path.write_bytes(bytes(out))


def make_docs(folder: Path, extra_jsonl: list[str] = ()) -> Path:
    """Documents of every kind: .txt, .md, .html, .pdf, .jsonl (and a near-copy of the .txt)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("Widget report. The Acme widget costs twelve dollars and ships in blue. "
                                  "It was launched in 2021 by a small team in Oslo.", encoding="utf-8")
    (folder / "a_copy.txt").write_text("Widget report. The Acme widget costs twelve dollars and ships in blue. "
                                       "It was launched in 2021 by a small team in Oslo!", encoding="utf-8")
    (folder / "b.md").write_text("# Gadget notes\n\nThe Zeta gadget weighs 120 grams and runs two days.",
                                 encoding="utf-8")
    (folder / "c.html").write_text("<html><head><script>var hidden = 1;</script><style>p{}</style></head><body>"
                                   "<article><h1>Sprocket</h1><p>Sprockets are toothed wheels; the Beta sprocket "
                                   "has 42 teeth.</p></article></body></html>", encoding="utf-8")
    make_pdf(folder / "d.pdf", "Pdfdoc about the Gamma gear with 17 teeth")
    lines = ["Gizmo line one about gizmos in Paris.", "Doohickey line two about a red doohickey.", *extra_jsonl]
    (folder / "e.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in lines), encoding="utf-8")
    return folder


def no_key_under(*folders: Path, key: str = KEY) -> None:
    for folder in folders:
        for f in Path(folder).rglob("*"):
            if f.is_file():
                assert key.encode() not in f.read_bytes(), f"the API key is written in {f}"


def distill_flat(tmp_path: Path, teacher: "FakeTeacher", model: Path, **keys) -> dict:
    """A distill spec on the fake teacher (its key only in $FAKE_TEACHER_KEY, which the caller sets), documents,
    data and run folder under tmp_path; `keys` on top."""
    teacher.mode, teacher.requests, teacher.failures = "valid", [], {}
    return {"documents": str(make_docs(tmp_path / "docs")), "text_column": "body", "task": TASK,
            "json_schema": SCHEMA, "teacher": teacher.url, "teacher_model": "fake",
            "teacher_api_key_env": "FAKE_TEACHER_KEY", "model_name_or_path": str(model), "template": "auto",
            "cutoff_len": 128, "answer_tokens": 40, "chunk_overlap": 8, "concurrency": 2, "retry_backoff": 0.0,
            "max_retries": 2, "request_timeout": 20, "eval_ratio": 0.3, "dataset_dir": str(tmp_path / "data"),
            "output_dir": str(tmp_path / "run"), "dataset_name": "facts", **keys}
