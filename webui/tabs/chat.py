"""Chat tab: talk to the top bar's model (+ adapter) through `tuneboard api`, side by side with the base.

Load starts `tuneboard api` as a subprocess (its own process group) on a free loopback port with a fresh
random API key; this tab is only its HTTP client (plain httpx, SSE), so the UI process never holds a
model and a crash or OOM of the server shows up here as an error. Unload (or the browser session
ending) stops it and frees the memory. Stop cancels the streaming request; closing the connection makes
the server stop generating at the next token.

Per-browser state (gr.State): {"server": ChatServer | None, "a": name, "b": name | None,
"hist_a": [...], "hist_b": [...]} where hist_* are OpenAI messages (what Export writes).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
import httpx

from backend import allowed, paths
from webui import live
from webui.i18n import refusal, tr


MAX_NEW_TOKENS = 4096  # the slider's top, and the cap its server is started with


# ----------------------------------------------------------------------------------------- server
class ChatServer:
    """One `tuneboard api` subprocess. `lines` collects its output (load progress, errors)."""

    def __init__(self, spec_args: list[str], adapters: list[str] = ()):
        self.key = secrets.token_urlsafe(24)
        self.cmd = [sys.executable, "-m", "backend.cli", "api", *spec_args]
        for a in adapters:
            self.cmd += ["--adapter", a]
        # the page's own server (one per browser session, a random key): its slider bounds max_tokens, Stop
        # bounds the time; the operator caps of a shared `tuneboard api` (SECURITY.md) are not needed here
        self.cmd += ["--host", "127.0.0.1", "--port", "0", "--max-tokens-per-request", str(MAX_NEW_TOKENS),
                     "--max-request-seconds", "0"]
        self.lines: list[str] = []
        self.models: list[str] = []
        self.url: str | None = None
        self.ready = threading.Event()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ChatServer":
        env = {**os.environ, "TUNEBOARD_API_KEY": self.key, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.cmd, cwd=paths.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if "\r" in line:  # progress bars: keep the last state
                line = line.rsplit("\r", 1)[-1]
            self.lines.append(line)
            if line.startswith("model: "):
                self.models.append(line[len("model: "):])
            elif line.startswith("serving on "):
                self.url = line.split()[-1]
                self.ready.set()
        self.ready.set()  # exited: wake waiters

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ended(self, wait_s: float) -> bool:
        """Whether the server process has exited, waiting up to `wait_s` for it: the connection a crash cuts
        reaches the client a moment before the exit can be seen, so a broken stream asked at once still
        looks like a live server (the user then got only 'peer closed connection ... incomplete chunked
        read')."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def failure(self, lang: str = "en") -> str:
        """Why the server is gone, with its last output lines."""
        code = self.proc.poll() if self.proc else None
        tail = "\n".join(line for line in self.lines[-12:] if line.strip())
        return tr(lang, "chat.exited", code=code) + f"\n{tail}"

    def stop(self, grace: float = 10.0) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}


def stream_reply(server: ChatServer, model: str, messages: list[dict], sampling: dict):
    """Yield (text so far, tool_calls, stats) while the server streams; stats is set at the end:
    {"completion_tokens", "seconds", "tokens_per_s", "finish_reason"}."""
    body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            **{k: v for k, v in sampling.items() if v is not None}}
    text, calls, finish, usage, start = "", [], None, None, time.time()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=httpx.Timeout(600, connect=10)) as r:
        if r.status_code != 200:
            r.read()
            try:
                message = r.json()["error"]["message"]
            except Exception:
                message = r.text[:500]
            raise RuntimeError(f"{r.status_code}: {message}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text += delta["content"]
                    yield text, calls, None
                if delta.get("tool_calls"):
                    calls += [{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]]
                finish = choice.get("finish_reason") or finish
    seconds = time.time() - start
    tokens = (usage or {}).get("completion_tokens", 0)
    yield text, calls, {"completion_tokens": tokens, "seconds": seconds, "finish_reason": finish,
                        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def display(history: list[dict]) -> list[dict]:
    """OpenAI messages -> Chatbot messages (tool calls as JSON blocks; the Chatbot escapes HTML)."""
    out = []
    for m in history:
        if m["role"] == "system":
            continue
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                     for c in m["tool_calls"]]
            content = (content + "\n\n" if content else "") + "```json\n" + json.dumps(calls, indent=2,
                                                                                          ensure_ascii=False) + "\n```"
        if m["role"] == "tool":
            content = "tool result:\n```json\n" + content + "\n```"
        out.append({"role": "assistant" if m["role"] == "assistant" else "user", "content": content})
    return out


def empty_state() -> dict:
    return {"server": None, "a": None, "b": None, "hist_a": [], "hist_b": []}


def _stop_server(st) -> None:
    if st and st.get("server") is not None:
        st["server"].stop()


# ------------------------------------------------------------------------------------------ build
def build(reg, top: dict) -> dict:
    """Layout only (events in wire())."""
    ui: dict = {"top": top}
    with gr.Row(equal_height=True, elem_id="chat-loadbar"):
        ui["compare"] = reg.comp(gr.Checkbox, "chat-compare", value=False, scale=1, min_width=220)
        # its placeholder: locale key chat-compare_with.placeholder
        ui["compare_with"] = reg.comp(gr.Textbox, "chat-compare_with", value="", scale=3)
        with gr.Column(scale=1, min_width=160, elem_classes=["tb-button-stack"]):
            ui["load"] = reg.button("chat-load", variant="primary", size="sm")
            ui["unload"] = reg.button("chat-unload", size="sm")
    ui["status"] = gr.Markdown("", elem_id="chat-status")
    with gr.Row():
        ui["chat_a"] = reg.comp(gr.Chatbot, "chat-chatbot", height=480, sanitize_html=True, render_markdown=True)
        ui["chat_b"] = reg.comp(gr.Chatbot, "chat-chatbot_b", height=480, visible=False, sanitize_html=True)
    ui["speed"] = gr.Markdown("", elem_id="chat-speed")
    with gr.Row(equal_height=True):
        ui["role"] = reg.dropdown("chat-role", ["user", "tool"], value="user", scale=1, min_width=100)
        ui["message"] = reg.comp(gr.Textbox, "chat-message", lines=2, scale=6)
    with gr.Row():
        ui["send"] = reg.button("chat-send", variant="primary", scale=2)
        ui["stop"] = reg.button("chat-stop", variant="stop")
        ui["regenerate"] = reg.button("chat-regenerate")
        ui["edit"] = reg.button("chat-edit_last")
        ui["clear"] = reg.button("chat-clear")
        ui["export"] = reg.button("chat-export")
    ui["export_file"] = gr.File(visible=False, elem_id="chat-export_file")
    with reg.accordion("chat-settings", open=False):
        ui["system"] = reg.comp(gr.Textbox, "chat-system", lines=2, value="")
        ui["tools"] = reg.comp(gr.Code, "chat-tools", language="json", value="")
        with gr.Row():
            ui["max_new_tokens"] = reg.comp(gr.Slider, "chat-max_new_tokens", minimum=1, maximum=MAX_NEW_TOKENS, step=1,
                                            value=512)
            ui["temperature"] = reg.comp(gr.Slider, "chat-temperature", minimum=0, maximum=2, step=0.01, value=0.7)
            ui["top_p"] = reg.comp(gr.Slider, "chat-top_p", minimum=0.01, maximum=1, step=0.01, value=0.9)
        with gr.Row():
            ui["top_k"] = reg.comp(gr.Slider, "chat-top_k", minimum=0, maximum=200, step=1, value=50)
            ui["repetition_penalty"] = reg.comp(gr.Slider, "chat-repetition_penalty", minimum=0.5, maximum=2,
                                                step=0.01, value=1.0)
            ui["seed"] = reg.comp(gr.Number, "chat-seed", value=None, precision=0)
    ui["state"] = gr.State(empty_state(), delete_callback=_stop_server)
    return ui


# ------------------------------------------------------------------------------------------- wire
def _sampling(max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed) -> dict:
    return {"max_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": float(top_p),
            "top_k": int(top_k), "repetition_penalty": float(repetition_penalty),
            "seed": int(seed) if seed not in (None, "") else None}


def _messages(st_hist: list[dict], system: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system and system.strip() else []) + st_hist


def load(model, adapter, template, compare, compare_with, st, lang="en"):
    """Start the server for the top bar's model/adapter/template (+ the comparison model); each path must be
    what backend.allowed lets the UI read (a model folder, or under the allowed roots).
    Inputs: model, adapter, template, compare, compare_with, state, language. Outputs: state, status, chat_b."""
    st = st or empty_state()
    refused = allowed.spec_refusals({"model_name_or_path": model, "adapter_name_or_path": adapter})
    if compare and compare_with and compare_with.strip():
        refused += allowed.spec_refusals({"adapter_name_or_path": compare_with.strip()})
    if refused:
        yield st, "  \n".join(refusal(lang, exc) for exc in refused), gr.skip(), gr.skip()
        return
    _stop_server(st)
    st.update(empty_state())
    spec_args = [f"model_name_or_path={model}", f"template={template or 'auto'}"]
    if adapter:
        spec_args.append(f"adapter_name_or_path={adapter}")
    extra = [compare_with.strip()] if compare and compare_with and compare_with.strip() else []
    server = ChatServer(spec_args, extra).start()
    st["server"] = server
    yield st, tr(lang, "chat.starting"), gr.update(visible=bool(compare)), gr.skip()
    while not server.ready.wait(1.0):
        last = live.status_line(server.lines)  # third-party noise (bitsandbytes, progress bars) left out
        yield (st, tr(lang, "chat.loading", line=last[-120:]) if last else tr(lang, "chat.loading_model"),
               gr.skip(), gr.skip())
    if not server.url:
        st["server"] = None
        yield st, "⛔ " + server.failure(lang).replace("\n", "  \n"), gr.skip(), gr.skip()
        return
    names = server.models
    st["a"] = names[1] if adapter and len(names) > 1 else names[0]
    st["b"] = (names[-1] if extra else names[0]) if compare else None
    shown = f"**{st['a']}**" + (f" vs **{st['b']}**" if st["b"] else "")
    label_a, label_b = pane_labels(model, adapter, compare, extra[0] if extra else None, lang)
    yield (st, tr(lang, "chat.loaded", shown=shown, url=server.url), gr.update(label=label_b) if compare else gr.skip(),
           gr.update(label=label_a))


def pane_labels(model, adapter, compare, other, lang: str = "en") -> tuple[str, str]:
    """The two panes' titles: what each side answers with (tuned = the adapter, base = the model alone)."""
    short = lambda path: Path(str(path)).name or str(path)  # noqa: E731
    a = (tr(lang, "chat.pane_tuned", model=short(model), adapter=short(adapter)) if adapter
         else tr(lang, "chat.pane_model", model=short(model)))
    b = (tr(lang, "chat.pane_compared", other=short(other)) if other
         else tr(lang, "chat.pane_base", model=short(model)))
    return a, b


def unload(st, lang: str = "en"):
    """Stop the server and free its memory. Inputs: state, language. Outputs: state, status."""
    _stop_server(st)
    return empty_state(), tr(lang, "chat.unloaded")


def respond(message, role, st, system, tools_json, *sampling_values):
    """Add the message to both conversations and stream the replies (A, then B in compare mode).
    Inputs: message, role, state, system, tools, sampling (N_SAMPLING values), then the language (optional).
    Outputs: chat_a, chat_b, message, speed, state."""
    lang = sampling_values[N_SAMPLING] if len(sampling_values) > N_SAMPLING else "en"
    sampling_values = sampling_values[:N_SAMPLING]
    st = st or empty_state()
    server = st.get("server")
    if server is None or not server.alive():
        why = server.failure(lang) if server is not None else tr(lang, "chat.load_first")
        yield gr.skip(), gr.skip(), gr.skip(), f"⛔ {why}", st
        return
    try:
        tools = json.loads(tools_json) if tools_json and tools_json.strip() else None
    except json.JSONDecodeError as exc:
        yield gr.skip(), gr.skip(), gr.skip(), "⛔ " + tr(lang, "chat.tools_json", error=exc), st
        return
    if message and message.strip():
        turn = {"role": role or "user", "content": message}
        if turn["role"] == "tool":
            last = next((m for m in reversed(st["hist_a"]) if m.get("tool_calls")), None)
            turn["tool_call_id"] = last["tool_calls"][0]["id"] if last else "call_0"
        st["hist_a"].append(dict(turn))
        if st["b"]:
            st["hist_b"].append(dict(turn))
    sampling = _sampling(*sampling_values)
    if tools:
        sampling["tools"] = tools
    speeds, sides = [], ("a", "b") if st["b"] else ("a",)
    requests, replies = {}, {}
    for side in sides:  # placeholders updated in place: a Stop keeps partial (or empty) answers on both sides
        requests[side] = _messages(st[f"hist_{side}"], system)
        replies[side] = {"role": "assistant", "content": ""}
        st[f"hist_{side}"].append(replies[side])
    # both panes get the question at once; the base one says it waits for its turn (one model answers at a time)
    st["stopped"] = False
    yield (display(st["hist_a"]), waiting(st["hist_b"], lang) if st["b"] else gr.skip(), "",
           tr(lang, "chat.answering") if st["b"] else "", st)
    shown_speed = None
    for side in sides:
        hist, request, reply = st[f"hist_{side}"], requests[side], replies[side]
        try:
            for text, calls, stats in stream_reply(server, st[side], request, sampling):
                if st.get("stopped"):  # Stop said so; nothing more may overwrite what it showed
                    return
                reply["content"] = text
                if calls:
                    reply["tool_calls"] = calls
                shown = display(hist)
                outputs = (shown, waiting(st["hist_b"], lang) if st["b"] else gr.skip()) if side == "a" \
                    else (gr.skip(), shown)
                # the speed line and the textbox only when they change (a question typed meanwhile stays)
                speed = " · ".join(speeds)
                yield *outputs, gr.skip(), speed if speed != shown_speed else gr.skip(), st
                shown_speed = speed
            speeds.append(tr(lang, "chat.speed", name=st[side], n=stats["completion_tokens"],
                             tps=f"{stats['tokens_per_s']:.1f}"))
        except (httpx.HTTPError, RuntimeError) as exc:
            for other in sides:
                if not replies[other]["content"] and st[f"hist_{other}"][-1] is replies[other]:
                    st[f"hist_{other}"].pop()
            cut = isinstance(exc, httpx.TransportError)  # the connection broke (not an error the server answered)
            why = server.failure(lang) if server.ended(3.0 if cut else 0.0) else str(exc)
            yield gr.skip(), gr.skip(), "", "⛔ " + why.replace("\n", "  \n"), st
            return
    yield display(st["hist_a"]), display(st["hist_b"]), "", " · ".join(speeds), st


WAITING = "⏳ waiting: the other pane answers first"  # locale key chat.waiting
N_SAMPLING = 6  # respond()'s sampling values: max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed


def waiting(history: list[dict], lang: str = "en") -> list[dict]:
    """display() of a pane whose reply has not started: its empty last answer reads as waiting."""
    shown = display(history)
    if history and history[-1]["role"] == "assistant" and not history[-1].get("content") \
            and not history[-1].get("tool_calls"):
        shown[-1] = {"role": "assistant", "content": tr(lang, "chat.waiting")}
    return shown


def stopped(st, lang: str = "en"):
    """After Stop: partial answers stay; an answer that had not started is taken out of its history (the
    question stays, so both panes still hold the same questions), and the speed line says what happened.
    Inputs: state, language. Outputs: chat_a, chat_b, speed, state."""
    st = st or empty_state()
    st["stopped"] = True  # the reply being streamed yields nothing more
    notes = []
    for side, name in (("a", tr(lang, "chat.tuned" if st.get("b") else "chat.the_reply")),
                       ("b", tr(lang, "chat.base"))):
        hist = st.get(f"hist_{side}") or []
        if side == "b" and not st.get("b"):
            continue
        if hist and hist[-1]["role"] == "assistant" and not hist[-1].get("content") and not hist[-1].get("tool_calls"):
            hist.pop()
            notes.append(tr(lang, "chat.not_answered", name=name))
        elif hist and hist[-1]["role"] == "assistant":
            notes.append(tr(lang, "chat.cut_short", name=name))
    return (display(st["hist_a"]), display(st["hist_b"]) if st.get("b") else gr.skip(),
            tr(lang, "chat.stopped") + (f" ({', '.join(notes)})" if notes else ""), st)


def drop_last_reply(st):
    """Remove the last assistant turn(s), keeping the user turn (for Regenerate). Inputs/Outputs: state."""
    for key in ("hist_a", "hist_b"):
        while st[key] and st[key][-1]["role"] == "assistant":
            st[key].pop()
    return st


def edit_last(st):
    """Take the last user turn (and its replies) back into the textbox.
    Inputs: state. Outputs: state, message, chat_a, chat_b."""
    text = ""
    for key in ("hist_a", "hist_b"):
        hist = st[key]
        while hist and hist[-1]["role"] == "assistant":
            hist.pop()
        if hist and hist[-1]["role"] in ("user", "tool"):
            text = hist.pop()["content"]
    return st, text, display(st["hist_a"]), display(st["hist_b"])


def export(st, system):
    """The conversation (A) as OpenAI messages JSON. Inputs: state, system. Outputs: export_file."""
    data = [{"messages": _messages(st["hist_a"], system)}]
    path = Path(tempfile.mkdtemp(prefix="tuneboard-chat-")) / "conversation.json"
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    return gr.update(value=str(path), visible=True)


def wire(ui: dict) -> None:
    top, st = ui["top"], ui["state"]
    load_evt = ui["load"].click(
        load, [top["model_name_or_path"], top["adapter_name_or_path"], top["template"], ui["compare"],
               ui["compare_with"], st, top["lang"]], [st, ui["status"], ui["chat_b"], ui["chat_a"]])
    ui["unload"].click(unload, [st, top["lang"]], [st, ui["status"]], cancels=[load_evt])
    sampling = [ui[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")]
    outputs = [ui["chat_a"], ui["chat_b"], ui["message"], ui["speed"], st]
    inputs = [ui["message"], ui["role"], st, ui["system"], ui["tools"], *sampling, top["lang"]]
    send = ui["send"].click(respond, inputs, outputs)
    submit = ui["message"].submit(respond, inputs, outputs)
    regen = ui["regenerate"].click(drop_last_reply, [st], [st]).then(
        respond, [gr.State(""), ui["role"], st, ui["system"], ui["tools"], *sampling, top["lang"]], outputs)
    ui["stop"].click(stopped, [st, top["lang"]], [ui["chat_a"], ui["chat_b"], ui["speed"], st],
                     cancels=[send, submit, regen])
    ui["edit"].click(edit_last, [st], [st, ui["message"], ui["chat_a"], ui["chat_b"]])

    def clear(s):
        """Inputs: state. Outputs: state, chat_a, chat_b, speed."""
        s["hist_a"], s["hist_b"] = [], []
        return s, [], [], ""

    ui["clear"].click(clear, [st], [st, ui["chat_a"], ui["chat_b"], ui["speed"]])
    ui["export"].click(export, [st, ui["system"]], [ui["export_file"]])
    ui["compare"].change(lambda on: gr.update(visible=bool(on)), [ui["compare"]], [ui["chat_b"]])
