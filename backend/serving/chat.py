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


def not_text(text: str) -> str | None:
    """Why `text` cannot be a message (bytes that were not UTF-8 arrive as lone surrogates), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"the input is not UTF-8 text (byte {text[exc.start].encode('utf-8', 'surrogateescape')!r} at "
                f"character {exc.start}): set the terminal to UTF-8 or fix the text")
    return None


def say(engine, messages: list[dict]) -> str | None:
    """answer(), with the problems a user can act on as one line (None then): a conversation the template
    refuses, or an adapter whose weights are not numbers (sampling stops on inf / nan probabilities)."""
    try:
        return answer(engine, messages)
    except ValueError as exc:
        _stderr(f"error: {exc}")
    except RuntimeError as exc:
        if not ("inf" in str(exc) and "nan" in str(exc)):  # torch: "probability tensor contains either inf, nan ..."
            raise
        _stderr(f"\nerror: the model's next-token probabilities are not numbers (inf / nan): its weights (or the "
                f"adapter's) hold non-finite values, e.g. from a run whose loss diverged ({exc})")
    return None


def main(spec, query: str | None = None) -> int:
    try:
        engines = load_engines(spec, include_base=not spec.adapter_name_or_path,
                               warn=lambda m: _stderr(f"warning: {m}"), log=_stderr)
    except (ValueError, FileNotFoundError, NotImplementedError, OSError) as exc:
        _stderr(f"error: {exc}")
        return 1
    engine = list(engines.values())[-1]
    if query is not None:
        problem = not_text(query)
        if problem:
            _stderr(f"error: --query: {problem}")
            return 1
        return 0 if say(engine, [{"role": "user", "content": query}]) is not None else 1
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
        problem = not_text(text)
        if problem:
            _stderr(f"error: {problem}; the conversation so far is kept")
            continue
        history.append({"role": "user", "content": text})
        print("Assistant: ", end="", flush=True)
        reply = say(engine, history)
        if reply is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
