"""The tab contract (webui/tab_context.py): every tab in webui/app.py's TABS has build(ctx) and wire(ctx, c),
and no tab imports another tab (what tabs share lives in webui/: form.py, plots.py, tailer.py)."""
import ast
import inspect
from pathlib import Path

from webui.app import TABS

TABS_DIR = Path(__file__).resolve().parents[2] / "webui" / "tabs"


def tab_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a webui.tabs module in `source`, at any depth (inside functions
    too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("webui.tabs")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "webui.tabs" or node.module.startswith("webui.tabs."):
                found += [(node.lineno, f"{node.module}.{a.name}" if node.module == "webui.tabs" else node.module)
                          for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # `from . import train` inside webui/tabs
            found += [(node.lineno, "." * node.level + (node.module or "") + ":" + a.name) for a in node.names]
    return found


def test_the_check_finds_a_tab_import():
    src = "import os\nfrom webui.tabs import train as t\ndef f():\n    import webui.tabs.runs\n    from . import data\n"
    assert [m for _, m in tab_imports(src)] == ["webui.tabs.train", "webui.tabs.runs", ".:data"]
    assert tab_imports("from webui import form\nfrom webui.tailer import job_log\n") == []


def test_no_tab_imports_another_tab():
    offenders = [f"{path.name}:{line} imports {mod}" for path in sorted(TABS_DIR.glob("*.py"))
                 for line, mod in tab_imports(path.read_text(encoding="utf-8"))]
    assert not offenders, "a tab imports a tab (move the shared code to webui/):\n" + "\n".join(offenders)


def test_every_tab_keeps_the_contract():
    modules = {m.__name__.rsplit(".", 1)[-1] for _, m in TABS}
    on_disk = {p.stem for p in TABS_DIR.glob("*.py") if p.stem != "__init__"}
    assert modules == on_disk, f"tab modules not in TABS: {on_disk - modules}; in TABS, not on disk: {modules - on_disk}"
    ids = [tab_id for tab_id, _ in TABS]
    assert len(set(ids)) == len(ids), ids
    for tab_id, module in TABS:
        for name, params in (("build", ["ctx"]), ("wire", ["ctx", "c"])):
            fn = getattr(module, name, None)
            assert callable(fn), f"{module.__name__} has no {name}()"
            got = list(inspect.signature(fn).parameters)
            assert len(got) == len(params) and got[0] == "ctx", \
                f"{module.__name__}.{name}{tuple(got)}: the contract is {name}({', '.join(params)})"
