"""`tuneboard chat`: a terminal REPL (or one `--query`) on backend.serving.engine, with streamed output.

It serves exactly one model: the spec's adapter stack on its base when adapter_name_or_path is set,
else the base model. Prompts go through the same template code as training (see backend.serving.engine).
Ctrl-C during an answer stops that answer; Ctrl-C or Ctrl-D at the prompt quits.
"""
from __future__ import annotations

import sys

from backend.serving.engine import load_engines


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Printer:
    """Writes streamed pieces with the answer's leading and trailing whitespace trimmed, so a one-shot
    answer is one clean line block (what `make demo` shows)."""

    def __init__(self, out):
        self.out, self.started, self.pending = out, False, ""

    def write(self, piece: str) -> None:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return
            self.started = True
        body = piece.rstrip()
        if body:
            self.out.write(self.pending + body)
            self.pending = piece[len(body):]
        else:
            self.pending += piece
        self.out.flush()

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def answer(engine, messages: list[dict], out=None) -> str:
    """Stream one answer to `out` (sys.stdout as it is at call time); return its text (partial if
    interrupted with Ctrl-C)."""
    out = out if out is not None else sys.stdout
    stream = engine.stream(messages)
    printer, text = _Printer(out), []
    try:
        for piece in stream:
            text.append(piece)
            printer.write(piece)
    except KeyboardInterrupt:
        stream.close()  # stops the generation thread
        out.write(" [stopped]")
    printer.end()
    return "".join(text).strip()


def main(spec, query: str | None = None) -> int:
    try:
        engines = load_engines(spec, include_base=not spec.adapter_name_or_path,
                               warn=lambda m: _stderr(f"warning: {m}"), log=_stderr)
    except (ValueError, FileNotFoundError, NotImplementedError, OSError) as exc:
        _stderr(f"error: {exc}")
        return 1
    engine = list(engines.values())[-1]
    if query is not None:
        try:
            answer(engine, [{"role": "user", "content": query}])
        except ValueError as exc:
            _stderr(f"error: {exc}")
            return 1
        return 0
    history: list[dict] = []
    print(f"TuneBoard chat with {engine.name}. Type 'clear' to start over, 'exit' to quit; Ctrl-C stops an answer.")
    while True:
        try:
            text = input("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text == "exit":
            return 0
        if text == "clear":
            history = []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        print("Assistant: ", end="", flush=True)
        try:
            reply = answer(engine, history)
        except ValueError as exc:
            history.pop()
            _stderr(f"error: {exc}")
            continue
        history.append({"role": "assistant", "content": reply})
