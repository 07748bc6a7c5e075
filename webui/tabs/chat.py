"""Chat tab: talk to the top bar's model (+ adapter) through `tuneboard api`, side by side with the base.

Load starts `tuneboard api` as a subprocess (its own process group) on a free loopback port with a fresh
random API key; this tab is only its HTTP client (plain httpx, SSE), so the UI process never holds a
model and a crash or OOM of the server shows up here as an error. Unload (or the last page of the browser
going away, after a grace period) stops it and frees the memory. Stop asks the streaming handler to end at
the next token: it closes the request (the server stops generating) and renders both panes itself, each
answer marked as stopped. Stop does not cancel the handler through Gradio's `cancels=`: a cancelled
generator's outputs still in flight reached the page after Stop's and put back an older (or an empty) pane,
so the question and the partial answers vanished while the status said "cut short" (issue 24).

A page reload keeps the server (webui/chat_servers.py has the policy): each server is recorded in the UI process
under its browser's key (the login user and an id the browser keeps in localStorage); a page that opens
re-attaches to its key's server (reattach: the status says what is loaded, Send and Unload act on it); Load and
Unload act on the key's server, whichever page of the browser loaded it, so a browser has one server at most; a
server no page holds any more (closed, reloaded) is stopped after a grace period, and all of them when the UI
process ends. The conversation itself stays with its page.

Per-page state (gr.State): {"server": ChatServer | None, "a": name, "b": name | None, "hist_a": [...],
"hist_b": [...], "key": owner key | None, "page": session hash | None} where hist_* are OpenAI messages (what
Export writes; an answer cut by Stop also carries "stopped": True, shown as a mark and never sent to the server);
key and page are set when the page opens (reattach) and kept by Load and Unload.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
import httpx

from backend.core import allowed, chat_rows, paths
from backend.core.promote import promoted_checkpoint
from backend.core.dataset_info import DatasetError, probe_question, read_dataset_info
from backend.core.rundir import CHECKPOINT_PREFIX, SPEC_FILE
from webui import chat_servers, choices, live
from webui.jobs import read_spec_dict
from webui.i18n import refusal, tr


MAX_NEW_TOKENS = 4096  # the slider's top, and the cap its server is started with


# ----------------------------------------------------------------------------------------- server
class ChatServer:
    """One `tuneboard api` subprocess. `lines` collects its output (load progress, errors)."""

    def __init__(self, spec_args: list[str], adapters: list[str] = ()):
        self.key = secrets.token_urlsafe(24)
        self.cmd = paths.tuneboard_argv("api", *spec_args)
        for a in adapters:
            self.cmd += ["--adapter", a]
        # the page's own server (one per browser, a random key): its slider bounds max_tokens, Stop
        # bounds the time; the operator caps of a shared `tuneboard api` (SECURITY.md) are not needed here
        self.cmd += ["--host", "127.0.0.1", "--port", "0", "--max-tokens-per-request", str(MAX_NEW_TOKENS),
                     "--max-request-seconds", "0", "--exit-with-stdin"]
        self.lines: list[str] = []
        self.models: list[str] = []
        self.url: str | None = None
        self.ready = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}  # what load() serves (model, adapter, compare, ...): a page that re-attaches shows it
        self.unloaded = False  # stop() was called: the UI ended it (Unload, a Load replacing it, no page holding it)

    def start(self) -> "ChatServer":
        env = {**os.environ, "TUNEBOARD_API_KEY": self.key, "PYTHONUNBUFFERED": "1"}
        # stdin: a pipe this process never writes to; it closes when the UI process ends (even killed), and
        # the server then ends too (--exit-with-stdin), so no chat server outlives the page's UI
        self.proc = subprocess.Popen(self.cmd, cwd=paths.REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
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
        """Why the server is gone, with its last output lines (or that the UI stopped it)."""
        if self.unloaded:
            return tr(lang, "chat.stopped_elsewhere")
        code = self.proc.poll() if self.proc else None
        tail = "\n".join(line for line in self.lines[-12:] if line.strip())
        return tr(lang, "chat.exited", code=code) + f"\n{tail}"

    def stop(self, grace: float = 10.0) -> None:
        self.unloaded = True
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


def display(history: list[dict], lang: str = "en") -> list[dict]:
    """OpenAI messages -> Chatbot messages (tool calls as JSON blocks; the Chatbot escapes HTML); an answer
    cut by Stop ends with the localized stopped mark."""
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
        if m.get("stopped"):
            content = (content + " " if content else "") + tr(lang, "chat.stopped_mark")
        out.append({"role": "assistant" if m["role"] == "assistant" else "user", "content": content})
    return out


def empty_state(st: dict | None = None) -> dict:
    """A page with no server and no conversation; `st`: the page's state, whose key and page it keeps."""
    return {"server": None, "a": None, "b": None, "hist_a": [], "hist_b": [],
            "key": (st or {}).get("key"), "page": (st or {}).get("page")}


def _stop_server(st) -> None:
    """Stop the page's server and its browser's (the same one, unless another page of the browser loaded since)."""
    st = st or {}
    for server in (chat_servers.take(st.get("key")), st.get("server")):
        if server is not None:
            server.stop()


def _state_deleted(st) -> None:
    """gr.State's delete_callback (Gradio deletes a closed page's state an hour later): the page lets go of its
    browser's server (stopped when no page holds it, webui/chat_servers.py); a server recorded nowhere is
    stopped now."""
    server = (st or {}).get("server")
    if server is None:
        return
    if chat_servers.holds(server):
        chat_servers.release(st.get("page"))
    else:
        server.stop()


# ------------------------------------------------------------------------------------------ build
def build(ctx) -> dict:
    """Layout only (events in wire())."""
    reg, top = ctx.reg, ctx.top
    ui: dict = {"top": top}
    with gr.Row(equal_height=True, elem_id="chat-loadbar"):
        ui["compare"] = reg.comp(gr.Checkbox, "chat-compare", value=False, scale=1, min_width=220)
        # its placeholder: locale key chat-compare_with.placeholder
        ui["compare_with"] = reg.comp(gr.Textbox, "chat-compare_with", value="", scale=3)
        # a GGUF file or GGUF export folder run by llama.cpp (infer_backend llamacpp) instead of transformers
        ui["llamacpp"] = reg.comp(gr.Checkbox, "chat-llamacpp", value=False, scale=1, min_width=200)
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
    # the picked adapter's probe question, one click into the message box (its text: locale key chat.probe)
    ui["probe"] = gr.Button("", visible=False, size="sm", elem_id="chat-probe")
    ui["probe_question"] = gr.State("")
    with gr.Row():
        ui["send"] = reg.button("chat-send", variant="primary", scale=2)
        ui["stop"] = reg.button("chat-stop", variant="stop")
        ui["regenerate"] = reg.button("chat-regenerate")
        ui["edit"] = reg.button("chat-edit_last")
        ui["clear"] = reg.button("chat-clear")
        ui["export"] = reg.button("chat-export")
    ui["export_file"] = gr.File(visible=False, elem_id="chat-export_file")
    # "Save as a training row": the conversation (pane A) with its last answer as corrected here, into a dataset
    with reg.accordion("chat-save", open=False):
        with gr.Row(equal_height=True):
            ui["save_dataset"] = reg.dropdown("chat-save_dataset", choices.dataset_names(), value=None,
                                              allow_custom_value=True, scale=2)
            ui["save_answer"] = reg.comp(gr.Textbox, "chat-save_answer", lines=3, scale=5)
        with gr.Row():
            ui["save_fill"] = reg.button("chat-save_fill", size="sm")
            ui["save_row"] = reg.button("chat-save_row", variant="primary", size="sm")
        ui["save_message"] = gr.Markdown("", elem_id="chat-save_message")
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
            # a text box: gr.Number shows and sends 0 for an empty value, a fixed seed where the label promises random
            ui["seed"] = reg.comp(gr.Textbox, "chat-seed", value="", max_lines=1)
    ui["state"] = gr.State(empty_state(), delete_callback=_state_deleted)
    return ui


# ------------------------------------------------------------------------------------------ probe
def adapter_probe(adapter: str | None, lang: str = "en") -> str | None:
    """The probe question of the data the picked adapter was trained on: its run's run_spec.yaml (in the
    adapter folder, or above a checkpoint-N folder) names the datasets and dataset_dir, and the first of
    those datasets that declares a `probe_question` in dataset_info.json gives it (in `lang` when declared).
    None for no adapter, a folder the UI may not read, or data without a probe question."""
    for part in str(adapter or "").split(","):
        part = part.strip()
        if not part or allowed.spec_refusals({"adapter_name_or_path": part}):
            continue
        folder = Path(part).expanduser()
        if not (folder / SPEC_FILE).is_file() and folder.name.startswith(CHECKPOINT_PREFIX):
            folder = folder.parent
        spec = read_spec_dict(folder)
        names = spec.get("dataset") or []
        names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if isinstance(n, str)]
        dataset_dir = spec.get("dataset_dir")
        if not names or (dataset_dir and allowed.spec_refusals({"dataset_dir": str(dataset_dir)})):
            continue
        try:
            entries = read_dataset_info(dataset_dir).entries
        except DatasetError:
            continue
        for name in names:
            question = probe_question(entries.get(name) or {}, lang)
            if question:
                return question
    return None


def suggest(adapter, lang: str = "en"):
    """Offer the picked adapter's probe question (a button that puts it in the message box), or nothing.
    Inputs: adapter, language. Outputs: probe button, probe question."""
    question = adapter_probe(adapter, lang)
    if not question:
        return gr.update(visible=False), ""
    return gr.update(value=tr(lang, "chat.probe", question=question), visible=True), question


def use_probe(question):
    """Inputs: probe question. Outputs: message."""
    return question


# ------------------------------------------------------------------------------------------- wire
def _sampling(max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed) -> dict:
    # the slider is a ceiling: past what the model's context leaves after the prompt, the answer runs to the end of
    # the context (fit_context) instead of the server refusing the request
    return {"max_tokens": int(max_new_tokens), "fit_context": True, "temperature": float(temperature),
            "top_p": float(top_p), "top_k": int(top_k), "repetition_penalty": float(repetition_penalty),
            "seed": _seed(seed)}


def _seed(value) -> int | None:
    """The Seed box: empty = a random seed each time (None), else a whole number (ValueError: one line)."""
    text = str(value if value is not None else "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(text) from None


def _messages(st_hist: list[dict], system: str) -> list[dict]:
    """The conversation as the server takes it (OpenAI messages: the UI's own "stopped" mark left out)."""
    return ([{"role": "system", "content": system}] if system and system.strip() else []) + \
        [{k: v for k, v in m.items() if k != "stopped"} for m in st_hist]


def load(model, adapter, template, compare, compare_with, st, lang="en", llamacpp=False):
    """Start the server for the top bar's model/adapter/template (+ the comparison model); each path must be
    what backend.core.allowed lets the UI read (a model folder, or under the allowed roots). `llamacpp`: serve a
    GGUF file or GGUF export folder with llama.cpp (the server's validate refuses anything else in one line).
    The browser's server (this page's, or one another page of the browser loaded) is stopped first, and the new one
    is recorded as the browser's at once (webui/chat_servers.py).
    Inputs: model, adapter, template, compare, compare_with, state, language, llama.cpp. Outputs: state, status,
    chat_b, chat_a."""
    st = st or empty_state()
    refused = allowed.spec_refusals({"model_name_or_path": model, "adapter_name_or_path": adapter})
    if compare and compare_with and compare_with.strip():
        refused += allowed.spec_refusals({"adapter_name_or_path": compare_with.strip()})
    if refused:
        yield st, "  \n".join(refusal(lang, exc) for exc in refused), gr.skip(), gr.skip()
        return
    _stop_server(st)  # before the new one starts: the memory first
    st.update(empty_state(st))
    spec_args = [f"model_name_or_path={model}", f"template={template or 'auto'}"]
    if adapter:
        spec_args.append(f"adapter_name_or_path={adapter}")
    if llamacpp:
        spec_args.append("infer_backend=llamacpp")
    extra = [compare_with.strip()] if compare and compare_with and compare_with.strip() else []
    server = ChatServer(spec_args, extra)
    server.info = {"model": model, "adapter": adapter or "", "compare": bool(compare),
                   "compare_with": extra[0] if extra else "", "llamacpp": bool(llamacpp)}
    st["server"] = server.start()
    chat_servers.record(st.get("key"), st.get("page"), server)
    yield st, tr(lang, "chat.starting"), gr.update(visible=bool(compare)), gr.skip()
    for line in _loading(server, lang):
        yield st, line, gr.skip(), gr.skip()
    shown = _serving(st, lang)
    if shown is None:
        yield st, "✖ " + server.failure(lang).replace("\n", "  \n"), gr.skip(), gr.skip()
        return
    loaded, label_a, label_b = shown
    yield (st, loaded, gr.update(label=label_b) if compare else gr.skip(),
           gr.update(label=label_a))


def _loading(server: ChatServer, lang: str = "en"):
    """The status line, once a second, while `server` loads its model."""
    while not server.ready.wait(1.0):
        last = live.status_line(server.lines)  # third-party noise (bitsandbytes, progress bars) left out
        yield tr(lang, "chat.loading", line=last[-120:]) if last else tr(lang, "chat.loading_model")


def _serving(st: dict, lang: str = "en") -> tuple[str, str, str] | None:
    """Once the page's server has loaded: the names it serves into the state (a, b) and (status, pane A's title,
    pane B's title); None when it is gone (then the state holds no server and the browser no longer has it)."""
    server = st["server"]
    if not server.url or not server.alive():
        chat_servers.take(st.get("key"), server)
        st["server"] = None
        return None
    info, names = server.info, server.models
    model, adapter, compare, other = info["model"], info["adapter"], info["compare"], info["compare_with"] or None
    st["a"] = names[1] if adapter and len(names) > 1 else names[0]
    st["b"] = (names[-1] if other else names[0]) if compare else None
    shown = f"**{st['a']}**" + (f" vs **{st['b']}**" if st["b"] else "")
    label_a, label_b = pane_labels(model, adapter, compare, other, lang)
    loaded = tr(lang, "chat.loaded", shown=shown, url=server.url)
    promoted = promoted_checkpoint(adapter.split(",")[-1].strip() if adapter else model)
    if promoted:  # the run folder's adapter (or a full run's model) is one of its checkpoints (tuneboard promote)
        loaded += " · " + tr(lang, "chat.promoted", checkpoint=promoted)
    return loaded, label_a, label_b


def reattach(request: gr.Request, browser, st, lang="en"):
    """A page opens: its browser gets an id the first time (kept in its localStorage), and the page re-attaches to
    the browser's server (loaded before a reload, or by another page of the browser; webui/chat_servers.py): the
    status says what it serves, the Load options show how it was loaded, Send and Unload act on it. A Load that
    got here first keeps its server, which becomes the browser's.
    Inputs: browser id, state, language. Outputs: browser id, state, status, compare, compare_with, llama.cpp,
    chat_a, chat_b."""
    skips = (gr.skip(),) * 6
    browser = browser if isinstance(browser, str) and browser else chat_servers.new_browser_id()
    st = st or empty_state()
    st["key"], st["page"] = chat_servers.key_of(request, browser), getattr(request, "session_hash", None)
    if st.get("server") is not None:
        chat_servers.record(st["key"], st["page"], st["server"])
        yield browser, st, *skips
        return
    server = chat_servers.attach(st["key"], st["page"])
    if server is None:
        yield browser, st, *skips
        return
    st.update(empty_state(st))
    st["server"] = server
    for line in _loading(server, lang):
        yield browser, st, line, *skips[1:]
    shown = _serving(st, lang)
    if shown is None:
        yield browser, st, "✖ " + server.failure(lang).replace("\n", "  \n"), *skips[1:]
        return
    loaded, label_a, label_b = shown
    info = server.info
    yield (browser, st, loaded + " · " + tr(lang, "chat.reattached"), info["compare"], info["compare_with"],
           info["llamacpp"], gr.update(label=label_a), gr.update(label=label_b, visible=info["compare"]))


def page_closed(request: gr.Request) -> None:
    """Gradio's unload event (the page closed or reloaded): the page lets go of its browser's server, which is
    stopped when no page holds it after the grace period (webui/chat_servers.py)."""
    chat_servers.release(getattr(request, "session_hash", None))


def pane_labels(model, adapter, compare, other, lang: str = "en") -> tuple[str, str]:
    """The two panes' titles: what each side answers with (tuned = the adapter, base = the model alone)."""
    short = lambda path: Path(str(path)).name or str(path)  # noqa: E731
    a = (tr(lang, "chat.pane_tuned", model=short(model), adapter=short(adapter)) if adapter
         else tr(lang, "chat.pane_model", model=short(model)))
    b = (tr(lang, "chat.pane_compared", other=short(other)) if other
         else tr(lang, "chat.pane_base", model=short(model)))
    return a, b


def unload(st, lang: str = "en"):
    """Stop the browser's server (this page's, or one another page of the browser loaded since) and free its
    memory. Inputs: state, language. Outputs: state, status."""
    _stop_server(st)
    return empty_state(st), tr(lang, "chat.unloaded")


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
        yield gr.skip(), gr.skip(), gr.skip(), f"✖ {why}", st
        return
    try:
        tools = json.loads(tools_json) if tools_json and tools_json.strip() else None
    except json.JSONDecodeError as exc:
        yield gr.skip(), gr.skip(), gr.skip(), "✖ " + tr(lang, "chat.tools_json", error=exc), st
        return
    try:
        sampling = _sampling(*sampling_values)
    except ValueError as exc:  # the seed box: the message stays in the box, nothing is added to the chat
        yield gr.skip(), gr.skip(), gr.skip(), "✖ " + tr(lang, "chat.seed_bad", value=str(exc)), st
        return
    if message and message.strip():
        turn = {"role": role or "user", "content": message}
        if turn["role"] == "tool":
            last = next((m for m in reversed(st["hist_a"]) if m.get("tool_calls")), None)
            turn["tool_call_id"] = last["tool_calls"][0]["id"] if last else "call_0"
        st["hist_a"].append(dict(turn))
        if st["b"]:
            st["hist_b"].append(dict(turn))
    if tools:
        sampling["tools"] = tools
    speeds, sides = [], ("a", "b") if st["b"] else ("a",)
    requests, replies = {}, {}
    for side in sides:  # placeholders updated in place: a Stop keeps partial (or empty) answers on both sides
        requests[side] = _messages(st[f"hist_{side}"], system)
        replies[side] = {"role": "assistant", "content": ""}
        st[f"hist_{side}"].append(replies[side])
    # both panes get the question at once; the base one says it waits for its turn (one model answers at a time)
    st["stopped"] = False  # request_stop() sets it: this handler then ends at the next token
    st["pending"] = list(sides)  # the answers not complete yet (what Stop cuts)
    yield (display(st["hist_a"], lang), waiting(st["hist_b"], lang) if st["b"] else gr.skip(), "",
           tr(lang, "chat.answering") if st["b"] else "", st)
    shown_speed = None
    for side in sides:
        if st.get("stopped"):
            break
        hist, request, reply = st[f"hist_{side}"], requests[side], replies[side]
        stream = stream_reply(server, st[side], request, sampling)
        try:
            for text, calls, stats in stream:
                if st.get("stopped"):  # the token that arrived after Stop is not shown
                    break
                reply["content"] = text
                if calls:
                    reply["tool_calls"] = calls
                shown = display(hist, lang)
                outputs = (shown, waiting(st["hist_b"], lang) if st["b"] else gr.skip()) if side == "a" \
                    else (gr.skip(), shown)
                # the speed line and the textbox only when they change (a question typed meanwhile stays)
                speed = " · ".join(speeds)
                yield *outputs, gr.skip(), speed if speed != shown_speed else gr.skip(), st
                shown_speed = speed
            else:
                st["pending"].remove(side)
                speeds.append(tr(lang, "chat.speed", name=st[side], n=stats["completion_tokens"],
                                 tps=f"{stats['tokens_per_s']:.1f}"))
        except (httpx.HTTPError, RuntimeError) as exc:
            if st.get("stopped"):  # the stream broke after Stop (e.g. Unload): what Stop asked for wins
                break
            for other in sides:
                if not replies[other]["content"] and st[f"hist_{other}"][-1] is replies[other]:
                    st[f"hist_{other}"].pop()
            st["pending"] = []
            cut = isinstance(exc, httpx.TransportError)  # the connection broke (not an error the server answered)
            why = server.failure(lang) if server.ended(3.0 if cut else 0.0) else str(exc)
            yield gr.skip(), gr.skip(), "", "✖ " + why.replace("\n", "  \n"), st
            return
        finally:
            stream.close()  # closes the request: after Stop, the server stops generating at its next token
    if st.get("stopped"):
        # this handler renders the stopped panes itself, as its last outputs: nothing it sent earlier can
        # arrive after them (a question typed meanwhile stays in the textbox)
        shown_a, shown_b, said, st = stopped(st, lang, speeds)
        yield shown_a, shown_b, gr.skip(), said, st
        return
    yield display(st["hist_a"], lang), display(st["hist_b"], lang), "", " · ".join(speeds), st


WAITING = "waiting: the other pane answers first"  # locale key chat.waiting
N_SAMPLING = 6  # respond()'s sampling values: max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed


def waiting(history: list[dict], lang: str = "en") -> list[dict]:
    """display() of a pane whose reply has not started: its empty last answer reads as waiting."""
    shown = display(history, lang)
    if history and history[-1]["role"] == "assistant" and not history[-1].get("content") \
            and not history[-1].get("tool_calls"):
        shown[-1] = {"role": "assistant", "content": tr(lang, "chat.waiting")}
    return shown


def request_stop(st) -> None:
    """Stop: the streaming handler (respond) ends at its next token and renders the stopped panes itself.
    Inputs: state. Outputs: none."""
    if st:
        st["stopped"] = True


def stopped(st, lang: str = "en", speeds: list[str] = ()):
    """The panes after Stop, from the history: every answer not complete yet stays, partial or empty, marked
    as stopped (an empty one keeps the turns alternating, so the next question continues the conversation
    on both sides); the speed line says what happened (`speeds`: those of the answers that completed).
    Inputs: state, language. Outputs: chat_a, chat_b, speed, state."""
    st = st or empty_state()
    st["stopped"] = True
    pending = st.pop("pending", None)
    notes = []
    for side, name in (("a", tr(lang, "chat.tuned" if st.get("b") else "chat.the_reply")),
                       ("b", tr(lang, "chat.base"))):
        hist = st.get(f"hist_{side}") or []
        if side == "b" and not st.get("b"):
            continue
        if not hist or hist[-1]["role"] != "assistant" or (pending is not None and side not in pending):
            continue  # no answer here, or a complete one
        hist[-1]["stopped"] = True
        started = hist[-1].get("content") or hist[-1].get("tool_calls")
        notes.append(tr(lang, "chat.cut_short" if started else "chat.not_answered", name=name))
    said = tr(lang, "chat.stopped") + (f" ({', '.join(notes)})" if notes else "")
    return (display(st["hist_a"], lang), display(st["hist_b"], lang) if st.get("b") else gr.skip(),
            " · ".join([said, *speeds]), st)


def drop_last_reply(st):
    """Remove the last assistant turn(s), keeping the user turn (for Regenerate). Inputs/Outputs: state."""
    for key in ("hist_a", "hist_b"):
        while st[key] and st[key][-1]["role"] == "assistant":
            st[key].pop()
    return st


def edit_last(st, lang: str = "en"):
    """Take the last user turn (and its replies) back into the textbox.
    Inputs: state, language. Outputs: state, message, chat_a, chat_b."""
    text = ""
    for key in ("hist_a", "hist_b"):
        hist = st[key]
        while hist and hist[-1]["role"] == "assistant":
            hist.pop()
        if hist and hist[-1]["role"] in ("user", "tool"):
            text = hist.pop()["content"]
    return st, text, display(st["hist_a"], lang), display(st["hist_b"], lang)


def export(st, system):
    """The conversation (A) as OpenAI messages JSON. Inputs: state, system. Outputs: export_file."""
    data = [{"messages": _messages(st["hist_a"], system)}]
    path = Path(tempfile.mkdtemp(prefix="tuneboard-chat-")) / "conversation.json"
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    return gr.update(value=str(path), visible=True)


def last_answer(st) -> str:
    """The last answer of pane A, to correct before saving. Inputs: state. Outputs: save_answer."""
    hist = (st or {}).get("hist_a") or []
    return hist[-1]["content"] if hist and hist[-1]["role"] == "assistant" else ""


def save_training_row(st, dataset, answer, system, tools_json, lang: str = "en"):
    """The conversation so far (pane A) as one training row of `dataset` (created and registered when new), its
    last answer replaced by `answer` when one is typed. Inputs: state, dataset, answer, system, tools, language.
    Outputs: save_message, save_dataset."""
    messages = _messages((st or {}).get("hist_a") or [], system)
    if answer and answer.strip():
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": answer.strip()})  # the answer the model did not give
        else:
            messages[-1] = {"role": "assistant", "content": answer.strip()}
    try:
        saved = chat_rows.save_row(None, dataset or "", messages, tools_json or "")
    except DatasetError as exc:
        return f"✖ `{tr(lang, 'chat-save_dataset')}`: {exc}", gr.skip()
    key = "chat.saved_new" if saved.created else "chat.saved"
    return (tr(lang, key, dataset=dataset.strip(), row=saved.index, file=saved.path.name),
            gr.update(choices=choices.dataset_names(), value=dataset.strip()))


def wire(ctx, ui: dict) -> None:
    top, st = ui["top"], ui["state"]
    load_evt = ui["load"].click(
        load, [top["model_name_or_path"], top["adapter_name_or_path"], top["template"], ui["compare"],
               ui["compare_with"], st, top["lang"], ui["llamacpp"]], [st, ui["status"], ui["chat_b"], ui["chat_a"]])
    ui["unload"].click(unload, [st, top["lang"]], [st, ui["status"]], cancels=[load_evt])
    sampling = [ui[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")]
    outputs = [ui["chat_a"], ui["chat_b"], ui["message"], ui["speed"], st]
    inputs = [ui["message"], ui["role"], st, ui["system"], ui["tools"], *sampling, top["lang"]]
    ui["send"].click(respond, inputs, outputs)
    ui["message"].submit(respond, inputs, outputs)
    ui["regenerate"].click(drop_last_reply, [st], [st]).then(
        respond, [gr.State(""), ui["role"], st, ui["system"], ui["tools"], *sampling, top["lang"]], outputs)
    # no `cancels=`: respond() ends itself at the next token and renders the stopped panes (see the module doc)
    ui["stop"].click(request_stop, [st], None)
    ui["edit"].click(edit_last, [st, top["lang"]], [st, ui["message"], ui["chat_a"], ui["chat_b"]])

    def clear(s):
        """Inputs: state. Outputs: state, chat_a, chat_b, speed."""
        s["hist_a"], s["hist_b"] = [], []
        return s, [], [], ""

    ui["clear"].click(clear, [st], [st, ui["chat_a"], ui["chat_b"], ui["speed"]])
    for source in (top["adapter_name_or_path"], top["lang"]):
        source.change(suggest, [top["adapter_name_or_path"], top["lang"]], [ui["probe"], ui["probe_question"]])
    ui["probe"].click(use_probe, [ui["probe_question"]], [ui["message"]])
    ui["export"].click(export, [st, ui["system"]], [ui["export_file"]])
    ui["save_fill"].click(last_answer, [st], [ui["save_answer"]])
    ui["save_row"].click(save_training_row, [st, ui["save_dataset"], ui["save_answer"], ui["system"], ui["tools"],
                                             top["lang"]], [ui["save_message"], ui["save_dataset"]])
    ui["compare"].change(lambda on: gr.update(visible=bool(on)), [ui["compare"]], [ui["chat_b"]])
