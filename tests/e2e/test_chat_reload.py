"""The Chat tab's server survives a page reload, in headless Chromium (webui/chat_servers.py): the reloaded page
re-attaches to it (the status says what is loaded, Send answers) instead of leaving it running unseen, and once no
page holds it any more it is stopped after the grace period."""
import time

from playwright.sync_api import expect

from test_chat import api_servers, default_serving_threads, gone, load  # noqa: F401 (an autouse fixture)
from ui_actions import open_chat_settings, open_tab, set_dropdown, set_number
from webui import chat_servers


def test_a_reloaded_page_keeps_its_chat_server(app_page, tiny_qwen2, monkeypatch, shot):
    page = app_page
    assert api_servers() == [], "a chat server was already running before the test"
    set_dropdown(page, "top-model_name_or_path", tiny_qwen2)
    open_tab(page, "Chat")
    load(page)
    [pid] = api_servers()

    page.reload()
    open_tab(page, "Chat")
    open_chat_settings(page)  # before anything is typed (ui_actions.open_chat_settings says why)
    status = page.locator("#chat-status")
    expect(status).to_contain_text("kept from this browser's earlier page", timeout=60_000)
    expect(status).to_contain_text(str(tiny_qwen2))
    assert api_servers() == [pid], "the reload started or lost a chat server"
    set_number(page, "chat-max_new_tokens", 4)
    page.locator("#chat-message textarea").fill("Hello")
    page.locator("#chat-send").click()
    expect(page.locator("#chat-speed")).to_contain_text("tok/s", timeout=60_000)
    expect(page.locator("#chat-chatbot [data-testid='bot']").last).not_to_have_text("")
    shot("chat-reattached")

    # the page goes and none of this browser's pages holds the server: it is stopped (here without a grace period)
    monkeypatch.setattr(chat_servers, "GRACE_S", 0.0)
    page.goto("about:blank")
    deadline = time.monotonic() + 60
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert gone(pid), "the chat server outlived the last page that held it"
    assert api_servers() == []
