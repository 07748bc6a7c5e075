"""The Chat tab's model servers this UI process started, so that a reloaded page finds its own again.

The Chat tab's Load starts a `tuneboard api` process (about 1.1 GB for the default model). Kept only in the page's
gr.State, it outlived a page reload unseen: the new page had a fresh state, could neither use nor unload it, and
its Load started a second one. So each server is also recorded here, under its owner's key:

- Key: the login user name (`tuneboard webui --auth`; none without a login) and a random id the browser keeps in
  its localStorage (a gr.BrowserState, given on its first page load): a reloaded page, or a second page of the
  same browser, has the same key; another browser, or another user on this browser, has another.
- One server per key: a Load stops the key's server (whichever page loaded it) before it starts its own, which is
  recorded at once (a reload while it loads finds it too); Unload stops the key's server and forgets it.
- Holders: the pages (Gradio session hashes) showing the server: the one that loaded it and each that re-attached
  to it when it opened. A page that goes away (Gradio's unload event on close or reload; its gr.State deleted, an
  hour later, as a fallback) lets go of it; a server no page holds is stopped GRACE_S later, unless a page of its
  key re-attaches first (a reload does within seconds).
- The UI process ending ends them all: each server's stdin is a pipe from this process (--exit-with-stdin).

Module-level state, as in webui/page_jobs.py: the servers are processes of this UI process, and what a reloaded
page must find cannot live in the page. A server here is a webui.tabs.chat.ChatServer (stop(), alive()).
"""
from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

GRACE_S = 120.0  # how long a server no page holds waits for a page of its key to re-attach
STORAGE_KEY = "tuneboard-browser"  # the browser id's localStorage key

_servers: dict[str, "Entry"] = {}
_lock = threading.Lock()


@dataclass
class Entry:
    server: Any
    holders: set[str] = field(default_factory=set)
    timer: threading.Timer | None = None


def new_browser_id() -> str:
    return secrets.token_urlsafe(16)


def key_of(request, browser) -> str | None:
    """The owner key of a page: its login user name and its browser's id; None without a browser id (nothing is
    recorded then: the page's server lives and ends with its gr.State, as before)."""
    if not browser or not isinstance(browser, str):
        return None
    return f"{getattr(request, 'username', None) or ''}\n{browser}"


def record(key: str | None, page: str | None, server) -> None:
    """A Load: `server` is the key's server now, held by `page`. A different server the key still had (a Load on
    another page that raced this one) is stopped."""
    if key is None:
        return
    with _lock:
        old = _servers.get(key)
        _servers[key] = entry = Entry(server)
        if old is not None:
            _cancel(old)
        _hold(key, entry, page)
    if old is not None and old.server is not server:
        old.server.stop()


def attach(key: str | None, page: str | None):
    """A page opened: the key's server (None when there is none), now held by `page` too."""
    if key is None:
        return None
    with _lock:
        entry = _servers.get(key)
        if entry is None:
            return None
        _hold(key, entry, page)
        return entry.server


def take(key: str | None, server=None):
    """Forget the key's server (a Load or Unload is about to stop it) and return it; with `server`, only when that
    is the key's server."""
    if key is None:
        return None
    with _lock:
        entry = _servers.get(key)
        if entry is None or (server is not None and entry.server is not server):
            return None
        del _servers[key]
        _cancel(entry)
    return entry.server


def holds(server) -> bool:
    """Whether `server` is recorded here (some key's server)."""
    with _lock:
        return any(entry.server is server for entry in _servers.values())


def release(page: str | None) -> None:
    """A page went away: it holds nothing now. A server no page holds is stopped after GRACE_S."""
    if not page:
        return
    with _lock:
        for key, entry in _servers.items():
            if page in entry.holders:
                entry.holders.discard(page)
                _hold(key, entry, None)


def _hold(key: str, entry: Entry, page: str | None) -> None:
    """Under the lock: `page` holds the entry (none: only look); the grace timer runs exactly while no page does."""
    if page:
        entry.holders.add(page)
    if entry.holders:
        _cancel(entry)
    elif entry.timer is None:
        entry.timer = threading.Timer(GRACE_S, _expire, (key, entry))
        entry.timer.daemon = True
        entry.timer.start()


def _cancel(entry: Entry) -> None:
    if entry.timer is not None:
        entry.timer.cancel()
        entry.timer = None


def _expire(key: str, entry: Entry) -> None:
    with _lock:
        if _servers.get(key) is not entry or entry.timer is not threading.current_thread():
            return  # replaced, forgotten, or re-attached meanwhile (its timer cancelled or another one running)
        del _servers[key]
        entry.timer = None
    entry.server.stop()
