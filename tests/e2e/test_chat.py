"""The Chat tab in headless Chromium against a real `tuneboard api` subprocess: load a tiny model, a
streamed reply, Stop mid-reply, compare mode (base vs a trained LoRA adapter) with two replies, Unload
leaves no server process behind."""
import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from ui_actions import open_chat_settings, open_tab, set_dropdown, set_number


@pytest.fixture(autouse=True)
def default_serving_threads(monkeypatch):
    """The chat servers of these tests (started by the in-process app, inheriting its environment) compute on
    torch's default threads, as a user's do. Under `make test` every process has one thread (tests/conftest.py),
    and on one thread the tiny models answered 700-900 tokens (48-67 tok/s) before the page could see the reply
    grow or a Stop could land."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)


def api_servers() -> list[int]:
    """Pids of `tuneboard api` processes started by this (test + in-process app) process."""
    me, pids = os.getpid(), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"backend.cli" in cmd and b"api" in cmd:
            pids.append(int(proc.name))
    return pids


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def load(page, shown="loaded"):
    page.locator("#chat-load").click()
    expect(page.locator("#chat-status")).to_contain_text(shown, timeout=120_000)


def bot_text(page, chatbot="#chat-chatbot"):
    return page.locator(f"{chatbot} [data-testid='bot']").last.inner_text()


def test_chat_stream_stop_compare_unload(app_page, tiny_qwen2, tiny_llama, finished_runs, shot):
    page = app_page
    assert api_servers() == [], "a chat server was already running before the test"
    set_dropdown(page, "top-model_name_or_path", tiny_qwen2)  # has its own ChatML template ("auto")
    open_tab(page, "Chat")
    open_chat_settings(page)
    load(page)
    expect(page.locator("#chat-status")).to_contain_text(str(tiny_qwen2))
    servers = api_servers()
    assert len(servers) == 1, servers

    # a long sampled reply (random weights: it practically never hits <|im_end|>) streams in pieces
    set_number(page, "chat-max_new_tokens", 900)  # within the tiny model's 1024-token context (the API refuses more)
    seed = page.locator("#chat-seed textarea, #chat-seed input").first
    expect(seed).to_have_value("")  # empty = a random seed, as its label says (gr.Number showed and sent 0)
    seed.fill("1")
    page.locator("#chat-message textarea").fill("Tell me a long story.")
    page.locator("#chat-send").click()
    expect(page.locator("#chat-chatbot [data-testid='user']")).to_contain_text("Tell me a long story.")
    bot = page.locator("#chat-chatbot [data-testid='bot']").last
    expect(bot).not_to_have_text("", timeout=60_000)
    first = len(bot_text(page))
    page.wait_for_function(
        f"() => {{ const b = [...document.querySelectorAll('#chat-chatbot [data-testid=\"bot\"]')].pop();"
        f" return b && b.innerText.length > {first} + 20; }}", timeout=30_000)  # it grows while we watch
    assert page.locator("#chat-speed").inner_text().strip() == ""  # no final stats yet: still streaming

    page.locator("#chat-stop").click()
    expect(page.locator("#chat-speed")).to_contain_text("Stopped")  # the page says what happened
    page.wait_for_timeout(1500)  # the cancel reaches the server; nothing may arrive after that
    stopped = bot_text(page)
    page.wait_for_timeout(2000)
    assert bot_text(page) == stopped, "the reply kept growing after Stop"
    assert stopped.strip()  # the partial answer stays in the conversation
    shot("chat")

    # compare: the tiny Llama with a LoRA adapter trained on it vs the same base, one prompt, two replies
    adapter = finished_runs[1]
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-adapter_name_or_path", adapter)
    page.locator("#chat-compare input").check()
    expect(page.locator("#chat-chatbot_b")).to_be_visible()
    load(page, " vs ")  # Load replaces the running server
    assert all(gone(pid) for pid in servers), "the first chat server outlived the reload"
    servers = api_servers()
    assert len(servers) == 1, servers
    # the panes say which side answers: the adapter, and the base model alone
    expect(page.locator("#chat-chatbot")).to_contain_text("tuned:")
    expect(page.locator("#chat-chatbot_b")).to_contain_text("base:")
    set_number(page, "chat-max_new_tokens", 12)
    page.locator("#chat-message textarea").fill("Who are you?")
    page.locator("#chat-send").click()
    for side in ("#chat-chatbot", "#chat-chatbot_b"):
        expect(page.locator(f"{side} [data-testid='user']").last).to_contain_text("Who are you?")
        expect(page.locator(f"{side} [data-testid='bot']").last).not_to_have_text("", timeout=60_000)
    # one stats entry per side once both replies are complete: the adapter's first, then the base's
    expect(page.locator("#chat-speed")).to_have_text(re.compile(r"run-b: .*tok/s · .*tok/s"), timeout=60_000)
    shot("chat-compare")

    page.locator("#chat-unload").click()
    expect(page.locator("#chat-status")).to_contain_text("unloaded", timeout=30_000)
    page.wait_for_timeout(500)
    assert all(gone(pid) for pid in servers), f"chat server still running after Unload: {servers}"
    assert api_servers() == []


def test_stop_keeps_the_exchange_in_both_panes_and_the_chat_goes_on(app_page, tiny_llama, finished_runs, shot):
    """Issue 24 item 3: Stop while the base pane streams (the tuned one has answered) keeps the question and
    both answers, the cut one marked as stopped, and stays so; the next question continues both
    conversations. Item 6: the adapter (trained on identity) offers its probe question, one click away."""
    page = app_page
    set_dropdown(page, "top-model_name_or_path", tiny_llama)
    set_dropdown(page, "top-adapter_name_or_path", finished_runs[1])
    open_tab(page, "Chat")
    probe = page.locator("#chat-probe")
    expect(probe).to_contain_text("“Who are you?”")
    page.locator("#chat-compare input").check()
    open_chat_settings(page)
    load(page, " vs ")
    # random weights: each side runs to the cap, the base pane long enough for Stop to land while it streams (300
    # tokens, 20 s at the serving speed of 2026-12-03, ended before the browser showed them and the Stop landed)
    set_number(page, "chat-max_new_tokens", 700)
    page.locator("#chat-seed textarea, #chat-seed input").first.fill("1")
    question = "Write a long story about a dragon."
    page.locator("#chat-message textarea").fill(question)
    page.locator("#chat-send").click()
    base = page.locator("#chat-chatbot_b [data-testid='bot']").last
    expect(base).not_to_contain_text("waiting", timeout=240_000)  # the tuned answer is done, the base one streams
    expect(base).not_to_have_text("")
    page.locator("#chat-stop").click()
    expect(page.locator("#chat-speed")).to_contain_text("Stopped (base: cut short)", timeout=30_000)
    expect(page.locator("#chat-speed")).to_contain_text("tok/s")  # the tuned answer's own stats stay
    for side in ("#chat-chatbot", "#chat-chatbot_b"):
        expect(page.locator(f"{side} [data-testid='user']")).to_have_count(1)
        expect(page.locator(f"{side} [data-testid='user']").last).to_contain_text(question)
    expect(base).to_have_text(re.compile(r"\S.* \(stopped\)\s*$", re.S))  # what it had said, marked
    tuned = bot_text(page)
    assert tuned.strip() and "(stopped)" not in tuned  # complete before Stop: not marked
    shown = bot_text(page, "#chat-chatbot_b")
    page.wait_for_timeout(2000)  # nothing (a late stream output) may change the panes after that
    assert bot_text(page, "#chat-chatbot_b") == shown and bot_text(page) == tuned
    shot("chat-stopped")

    # the probe question, one click into the message box; both conversations go on from where they were
    set_number(page, "chat-max_new_tokens", 8)
    probe.click()
    expect(page.locator("#chat-message textarea")).to_have_value("Who are you?")
    page.locator("#chat-send").click()
    expect(page.locator("#chat-speed")).to_have_text(re.compile(r"run-b: .*tok/s · .*tok/s"), timeout=60_000)
    for side in ("#chat-chatbot", "#chat-chatbot_b"):
        users = page.locator(f"{side} [data-testid='user']")
        expect(users).to_have_count(2)
        expect(users.first).to_contain_text(question)
        expect(users.last).to_contain_text("Who are you?")
        expect(page.locator(f"{side} [data-testid='bot']")).to_have_count(2)
    assert bot_text(page, "#chat-chatbot_b").strip()
    expect(page.locator("#chat-chatbot_b [data-testid='bot']").first).to_have_text(shown)
    page.locator("#chat-unload").click()
    expect(page.locator("#chat-status")).to_contain_text("unloaded", timeout=30_000)
