"""The chat server crashing under the Chat tab (issue 9, "Faults"): the tab's `tuneboard api` child is killed
with SIGKILL (what the kernel's OOM killer does) in the middle of a streamed answer. The tab's handler says
the server is gone, with its exit code, keeps the partial answer, answers the next message with the same
clear line instead of hanging or raising, Unload still works, and Load starts a working server again: the UI
process (this one, which runs the handlers as Gradio does) is untouched.

The kill lands mid-answer by construction: the server is frozen (SIGSTOP) right after the first streamed
token arrives, so it cannot finish the answer before the SIGKILL."""
from __future__ import annotations

import os
import signal

import psutil
import pytest

from webui.tabs import chat

pytestmark = pytest.mark.slow
SAMPLING = (400, 0.0, 0.9, 50, 1.0, None)  # max_new_tokens far above what is streamed before the freeze


def _last(gen):
    value = None
    for value in gen:
        pass
    return value


def test_a_chat_server_killed_mid_answer_is_reported_and_the_tab_recovers(tiny_qwen2):
    st = chat.empty_state()
    st, status, _, _ = _last(chat.load(str(tiny_qwen2), "", "auto", False, "", st))
    assert status.startswith("✓"), status
    server = st["server"]
    pgid = server.proc.pid
    try:
        answering = chat.respond("Tell me a long story", "user", st, "", "", *SAMPLING)
        next(answering)  # the question and an empty answer are shown
        chat_a = next(answering)[0]  # the first streamed token
        assert chat_a[-1]["role"] == "assistant" and chat_a[-1]["content"]
        os.killpg(pgid, signal.SIGSTOP)  # frozen: no more tokens
        os.killpg(pgid, signal.SIGKILL)
        outs = _last(answering)
        chat_a, _, message, speed, st = outs
        assert speed.startswith("✖ ") and "the chat server exited (code -9)" in speed, speed
        assert "Traceback" not in speed
        assert st["hist_a"][-1]["role"] == "assistant" and st["hist_a"][-1]["content"]  # the partial answer stays

        # the next message gets the same clear line at once, the history is left as it was
        before = list(st["hist_a"])
        outs = _last(chat.respond("Are you there?", "user", st, "", "", *SAMPLING))
        assert outs[3].startswith("✖ ") and "the chat server exited (code -9)" in outs[3]
        assert st["hist_a"] == before
        assert not [p for p in psutil.process_iter() if _in_group(p, pgid)]  # nothing of the server left

        st, status = chat.unload(st)
        assert st["server"] is None
        # and Load brings a working server back
        st, status, _, _ = _last(chat.load(str(tiny_qwen2), "", "auto", False, "", st))
        assert status.startswith("✓"), status
        outs = _last(chat.respond("Hello again", "user", st, "", "", 6, 0.0, 0.9, 50, 1.0, None))
        assert "tok/s" in outs[3] and outs[0][-1]["content"], outs[3]
    finally:
        st, _ = chat.unload(st)


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False
