"""Chat tab: layout builds light, and its handlers drive a real `tuneboard api` subprocess (tiny model)."""
import json
import re
import subprocess
import sys

import gradio as gr
import pytest

from webui.tabs import chat


def test_tab_builds_and_imports_no_ml_stack():
    code = ("import sys, gradio as gr\nfrom webui.ui import Registry\nfrom webui.tabs import chat\n"
            "from webui.tab_context import TabContext\n"
            "with gr.Blocks():\n"
            "    top = {k: gr.Textbox() for k in ('model_name_or_path', 'adapter_name_or_path', 'template', 'lang')}\n"
            "    ctx = TabContext(reg=Registry('en'), top=top)\n"
            "    ui = chat.build(ctx)\n    chat.wire(ctx, ui)\n"
            "print(','.join(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1:] in ([""], []), out.stdout


def _last(gen):
    value = None
    for value in gen:
        pass
    return value


def test_load_chat_stop_compare_export_unload(tiny_qwen2):
    st = chat.empty_state()
    st, status, _, pane_a = _last(chat.load(str(tiny_qwen2), "", "auto", True, "", st))
    server = st["server"]
    try:
        assert status.startswith("✓"), status
        assert st["a"] == st["b"] == str(tiny_qwen2)  # no adapter: compare against the base itself
        assert pane_a["label"].startswith("model: ")  # the panes say what answers in them
        sampling = (6, 0.0, 0.9, 50, 1.0, None)

        outs = _last(chat.respond("Hello there", "user", st, "Be brief.", "", *sampling))
        chat_a, chat_b, message, speed, st = outs
        assert [m["role"] for m in chat_a] == ["user", "assistant"] and chat_a[1]["content"]
        assert chat_b == chat_a  # same model, greedy: same answer on both sides
        assert "tok/s" in speed and message == ""
        assert [m["role"] for m in st["hist_a"]] == ["user", "assistant"]

        # Stop = Gradio closing the generator mid-stream: the partial answer stays, the next turn works
        gen = chat.respond("And now?", "user", st, "", "", 300, 0.0, 0.9, 50, 1.0, None)
        next(gen)
        next(gen)
        gen.close()
        assert [m["role"] for m in st["hist_a"]] == ["user", "assistant", "user", "assistant"]

        # the Stop button: respond ends at the next token and renders both panes itself, as its last outputs:
        # the tuned answer cut short, the base one not started, both kept and marked (in the page's language)
        gen = chat.respond("Go on", "user", st, "", "", 300, 0.0, 0.9, 50, 1.0, None, "de")
        next(gen)
        next(gen)  # the first streamed token of pane A
        chat.request_stop(st)
        chat_a, chat_b, message, speed, st = _last(gen)
        assert chat_a[-2:][0] == chat_b[-2:][0] == {"role": "user", "content": "Go on"}
        assert chat_a[-1]["content"].endswith(" (gestoppt)") and len(chat_a[-1]["content"]) > len(" (gestoppt)")
        assert chat_b[-1] == {"role": "assistant", "content": "(gestoppt)"}
        assert speed == "■ Gestoppt (feinabgestimmt: abgebrochen, Basis: nicht beantwortet)", speed
        assert message == gr.skip()  # no value: a question typed meanwhile stays in the textbox
        assert st["hist_a"][-1]["stopped"] and st["hist_b"][-1] == {"role": "assistant", "content": "",
                                                                    "stopped": True}

        outs = _last(chat.respond("Third", "user", st, "", "", *sampling))
        assert outs[3].count("tok/s") == 2, outs[3]  # the next question continues both conversations
        assert [m["role"] for m in st["hist_b"]] == ["user", "assistant"] * 4

        # the Seed box: empty = random (no seed sent), a whole number = that seed, anything else one line, no turn
        assert chat._sampling(6, 0.7, 0.9, 50, 1.0, "")["seed"] is None
        assert chat._sampling(6, 0.7, 0.9, 50, 1.0, " 42 ")["seed"] == 42
        before = [list(st["hist_a"]), list(st["hist_b"])]
        outs = _last(chat.respond("Fourth", "user", st, "", "", 6, 0.7, 0.9, 50, 1.0, "1.5"))
        assert outs[3] == "✖ Seed: '1.5' is not a whole number (leave it empty for a random seed)", outs[3]
        assert outs[2] == gr.skip() and [st["hist_a"], st["hist_b"]] == before

        path = chat.export(st, "Be brief.")["value"]
        data = json.loads(open(path, encoding="utf-8").read())
        assert data[0]["messages"][0] == {"role": "system", "content": "Be brief."}
        assert [m["role"] for m in data[0]["messages"][1:]] == ["user", "assistant"] * 4
        assert not any("stopped" in m for m in data[0]["messages"])  # the UI's mark is not an OpenAI key

        st, text, chat_a, _ = chat.edit_last(st)
        assert text == "Third" and len(chat_a) == 6 and chat_a[-1]["content"].endswith(" (stopped)")
    finally:
        st, status = chat.unload(st)
    assert not server.alive() and st["server"] is None


def test_a_server_that_fails_to_load_shows_its_error(tmp_path):
    st, status, _, _ = _last(chat.load(str(tmp_path / "no-model"), "", "auto", False, "", chat.empty_state()))
    assert status.startswith("✖") and "does not exist" in status
    outs = _last(chat.respond("hi", "user", st, "", "", 4, 0.0, 0.9, 50, 1.0, None))
    assert outs[3].startswith("✖")


def test_display_escapes_nothing_itself_and_renders_tool_calls_as_json():
    shown = chat.display([
        {"role": "system", "content": "s"},
        {"role": "user", "content": "<b>hi</b>"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": '{"y": 2}'},
    ])
    assert shown[0] == {"role": "user", "content": "<b>hi</b>"}  # the Chatbot sanitizes HTML (sanitize_html)
    assert '"name": "f"' in shown[1]["content"] and shown[1]["content"].startswith("```json")
    assert shown[2]["role"] == "user" and '{"y": 2}' in shown[2]["content"]
    assert isinstance(gr.Chatbot, type)


def test_the_pages_own_server_allows_what_its_slider_offers():
    """`tuneboard api` caps max_tokens at 1024 by default (issue 25); the Chat tab's private server is started
    with its slider's top as the cap and no time limit (Stop bounds it), so no slider value is a 400."""
    from webui.tabs import chat

    cmd = chat.ChatServer(["model_name_or_path=m"]).cmd
    assert cmd[cmd.index("--max-tokens-per-request") + 1] == str(chat.MAX_NEW_TOKENS) == "4096"
    assert cmd[cmd.index("--max-request-seconds") + 1] == "0"


def _run(folder, dataset, **more):
    import yaml

    folder.mkdir(parents=True)
    (folder / "run_spec.yaml").write_text(yaml.safe_dump({"model_name_or_path": "m", "dataset": dataset, **more}))
    (folder / "adapter_config.json").write_text("{}")
    return folder


def test_the_adapter_of_a_run_on_identity_offers_its_probe_question(root, tmp_path):
    """Issue 24 item 6: an adapter trained on a dataset that declares a probe question (data/dataset_info.json:
    identity) gets a one-click suggestion in the Chat tab, in the page's language where the data has it."""
    run = _run(root / "tiny" / "lora" / "run-id", "alpaca_en_demo, identity")
    checkpoint = run / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "adapter_config.json").write_text("{}")
    for adapter in (str(run), str(checkpoint)):  # a checkpoint's spec is its run's
        button, question = chat.suggest(adapter, "en")
        assert button["visible"] and question == "Who are you?" and "“Who are you?”" in button["value"]
    assert chat.suggest(str(run), "zh")[1] == "你是谁？"  # identity has Chinese rows
    button, question = chat.suggest(str(run), "de")  # and no German ones: the English question, German label
    assert question == "Who are you?" and button["value"].startswith("Fragen")
    assert chat.use_probe(question) == "Who are you?"

    # no suggestion: no adapter, data without a probe question, a run folder the UI may not read
    other = _run(root / "tiny" / "lora" / "run-alpaca", ["alpaca_en_demo"])
    outside = _run(tmp_path / "elsewhere" / "run", "identity")
    (outside / "adapter_config.json").unlink()  # no model files: not a model folder, outside the roots
    for adapter in ("", None, str(other), str(outside), str(root / "missing")):
        button, question = chat.suggest(adapter, "en")
        assert button == {"__type__": "update", "visible": False} and question == "", adapter


def test_a_probe_question_is_checked_like_any_dataset_key(tmp_path):
    from backend.core.dataset_info import DatasetError, read_dataset_info

    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "good": {"file_name": "a.json", "probe_question": "Who are you?"},
        "bad": {"file_name": "a.json", "probe_question": {"en": ""}},
        "typo": {"file_name": "a.json", "probe_questoin": "x"}}))
    info = read_dataset_info(tmp_path)
    assert list(info.entries) == ["good"]
    with pytest.raises(DatasetError, match=re.escape(
            "'probe_question' must be a non-empty string or an object of language code -> question")):
        info.entry("bad")
    with pytest.raises(DatasetError, match=re.escape("unknown key 'probe_questoin' (did you mean 'probe_question'?)")):
        info.entry("typo")


def test_a_chat_server_ends_with_the_ui_process_even_when_it_is_killed(tiny_qwen2, tmp_path):
    """The page's `tuneboard api` runs in its own session (an Unload or a crash of it never touches the UI), so
    nothing else would stop it when the UI dies: it watches its stdin pipe (--exit-with-stdin) and ends when
    the UI's end closes. Here a stand-in UI process starts a real server, then is killed with SIGKILL."""
    import os
    import signal
    import time

    ui = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from webui.tabs.chat import ChatServer\n"
        f"s = ChatServer(['model_name_or_path={tiny_qwen2}']).start()\n"
        "s.ready.wait(300)\n"
        "print(s.proc.pid, s.url, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")],
        capture_output=True, text=True, timeout=400)
    assert ui.returncode == -signal.SIGKILL, ui.stderr[-2000:]
    pid, url = ui.stdout.split()
    assert url.startswith("http://127.0.0.1:")  # it was up and serving when its UI died

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.kill(int(pid), signal.SIGKILL)
    raise AssertionError(f"the chat server {pid} outlived its killed UI by 120 s")
