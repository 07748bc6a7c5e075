"""The Chat tab's server survives a page reload (webui/chat_servers.py): a page of the same browser re-attaches to
it, Load and Unload act on the browser's one server, and a server no page holds is stopped after the grace period.
Pages are real gr.Request objects (as Gradio passes them); the servers are real `tuneboard api` processes."""
import gradio as gr
import pytest

from webui import chat_servers
from webui.i18n import tr
from webui.tabs import chat

SAMPLING = (4, 0.0, 0.9, 50, 1.0, None)


def _last(gen):
    value = None
    for value in gen:
        pass
    return value


def _open(session: str, browser: str = "", user: str | None = None):
    """A page opening (chat.reattach): (browser id, state, status, compare, compare_with, llama.cpp, pane A, pane B)."""
    return _last(chat.reattach(gr.Request(session_hash=session, username=user), browser, chat.empty_state()))


@pytest.fixture
def servers():
    """The servers a test starts, stopped at its end whatever happened."""
    started = []
    yield started
    for server in started:
        server.stop()


def test_a_reloaded_page_re_attaches_and_load_and_unload_act_on_the_browsers_one_server(tiny_qwen2, servers):
    browser, st, *rest = _open("reload-1")  # the browser's first page: it gets an id, there is nothing to attach
    assert browser and st["server"] is None and all(v == gr.skip() for v in rest)
    loading = chat.load(str(tiny_qwen2), "", "auto", False, "", st)
    next(loading)  # the server has started, its model is loading
    first = st["server"]
    servers.append(first)

    # the page is reloaded while the model loads: the new page waits for it and shows it, with how it was loaded
    chat.page_closed(gr.Request(session_hash="reload-1"))
    loading.close()
    _, st2, status, compare, compare_with, llamacpp, pane_a, pane_b = _open("reload-2", browser)
    assert st2["server"] is first and first.alive()
    assert status.startswith("✓") and str(tiny_qwen2) in status and "kept from this browser's earlier page" in status
    assert (compare, compare_with, llamacpp) == (False, "", False) and pane_a["label"].startswith("model: ")
    assert pane_b["visible"] is False
    chat_a, _, _, speed, st2 = _last(chat.respond("Hello", "user", st2, "", "", *SAMPLING))  # Send works
    assert chat_a[-1]["role"] == "assistant" and chat_a[-1]["content"] and "tok/s" in speed

    # another browser (or another user of this one) sees nothing of it
    assert _open("other-1", "another-browser")[1]["server"] is None
    assert _open("other-2", browser, user="bob")[1]["server"] is None

    # a second page of the browser (a new tab) attaches too; its Load replaces the server (no second one)
    st3 = _open("reload-3", browser)[1]
    assert st3["server"] is first
    st3, status, _, _ = _last(chat.load(str(tiny_qwen2), "", "auto", False, "", st3))
    second = st3["server"]
    servers.append(second)
    assert status.startswith("✓") and second is not first and second.alive()
    assert first.ended(30.0), "the browser's earlier server outlived the Load that replaced it"
    # the page that showed the first one says it is gone, in one line, and nothing is added to its conversation
    before = list(st2["hist_a"])
    outs = _last(chat.respond("Still there?", "user", st2, "", "", *SAMPLING))
    assert outs[3] == "✖ " + tr("en", "chat.stopped_elsewhere") and st2["hist_a"] == before
    # Unload on that page stops the browser's server (the one the other page loaded)
    st2, status = chat.unload(st2)
    assert status == "unloaded" and second.ended(30.0) and not chat_servers.holds(second)
    assert st2["server"] is None and st2["key"] == st3["key"]  # the page still knows its browser: a Load records
    assert _open("reload-4", browser)[1]["server"] is None


def test_a_server_no_page_holds_is_stopped_after_the_grace_period(tiny_qwen2, servers, monkeypatch):
    monkeypatch.setattr(chat_servers, "GRACE_S", 0.0)
    browser, st = _open("grace-1")[:2]
    st, status, _, _ = _last(chat.load(str(tiny_qwen2), "", "auto", False, "", st))
    server = st["server"]
    servers.append(server)
    assert status.startswith("✓")
    st2 = _open("grace-2", browser)[1]
    assert st2["server"] is server

    chat.page_closed(gr.Request(session_hash="grace-1"))  # one page goes: the other still holds the server
    assert _last(chat.respond("Hello", "user", st2, "", "", *SAMPLING))[0][-1]["content"]
    assert server.alive() and chat_servers.holds(server)
    # the last page goes (here: Gradio deletes its state, the fallback when no unload event came): stopped
    chat._state_deleted(st2)
    assert server.ended(30.0), "a server no page holds was left running"
    assert not chat_servers.holds(server) and _open("grace-3", browser)[1]["server"] is None
