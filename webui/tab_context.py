"""The tab contract (ARCHITECTURE.md, "A tab"): every tab module under webui/tabs/ has

    build(ctx: TabContext) -> dict      lays out its components (called inside its gr.Tab) and returns them
    wire(ctx: TabContext, c: dict)      binds its events; `c` is what its build() returned

and is listed once in webui/app.py's TABS. What a tab needs of the page comes from the context: the label
registry, the top bar's components, the shared Train state, the gr.Tabs, and the other tabs' components by
tab id (ctx.tab("train")): a tab never imports another tab (tests/webui/test_tab_contract.py); shared logic
lives in webui/ (form.py, plots.py, tailer.py, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from webui.ui import Registry


@dataclass
class TabContext:
    reg: Registry
    top: dict  # the top bar's components (webui/app.py build_topbar)
    state: Any = None  # gr.State: the Train tab's per-browser state (tailer.run_state), shared with Runs
    tabs: Any = None  # gr.Tabs: a handler that switches tab outputs gr.Tabs(selected=<tab id>)
    comps: dict[str, dict] = field(default_factory=dict)  # tab id -> what its build() returned
    items: dict[str, Any] = field(default_factory=dict)  # tab id -> its gr.Tab

    def tab(self, tab_id: str) -> dict:
        """Another tab's components (built before any tab is wired)."""
        return self.comps[tab_id]
