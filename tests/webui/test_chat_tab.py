"""Chat tab: layout builds light, and its handlers drive a real `tuneboard api` subprocess (tiny model)."""
import json
import subprocess
import sys

import gradio as gr

from webui.tabs import chat


def test_tab_builds_and_imports_no_ml_stack():
    code = ("import sys, gradio as gr\nfrom webui.ui import Registry\nfrom webui.tabs import chat\n"
            "reg = Registry('en')\n"
            "with gr.Blocks():\n"
            "    top = {k: gr.Textbox() for k in ('model_name_or_path', 'adapter_name_or_path', 'template', 'lang')}\n"
            "    ui = chat.build(reg, top)\n    chat.wire(ui)\n"
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
        outs = _last(chat.respond("Third", "user", st, "", "", *sampling))
        assert outs[3].count("tok/s") == 2, outs[3]

        path = chat.export(st, "Be brief.")["value"]
        data = json.loads(open(path, encoding="utf-8").read())
        assert data[0]["messages"][0] == {"role": "system", "content": "Be brief."}
        assert [m["role"] for m in data[0]["messages"][1:]] == ["user", "assistant"] * 3

        st, text, chat_a, _ = chat.edit_last(st)
        assert text == "Third" and len(chat_a) == 4
    finally:
        st, status = chat.unload(st)
    assert not server.alive() and st["server"] is None


def test_a_server_that_fails_to_load_shows_its_error(tmp_path):
    st, status, _, _ = _last(chat.load(str(tmp_path / "no-model"), "", "auto", False, "", chat.empty_state()))
    assert status.startswith("⛔") and "does not exist" in status
    outs = _last(chat.respond("hi", "user", st, "", "", 4, 0.0, 0.9, 50, 1.0, None))
    assert outs[3].startswith("⛔")


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
