"""The folders show the architecture (ARCHITECTURE.md): backend/core holds the light modules and is closed
(it imports nothing from the heavier folders), the web UI imports from backend only core, the stage
declarations and the distill package's light front, and no module sits loose in backend/ but the CLI's
dispatcher. Imports are read with the import-graph test's parser: inside functions too."""
import ast
from pathlib import Path

from tests.backend.test_import_graph import import_graph

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"core", "dataprep", "training", "serving", "evaluation", "exporting", "stages", "distill"}
STAGE_DECLARATIONS = {"backend.stages", "backend.stages.rules"}
DISTILL_FRONT = {"backend.distill", "backend.distill.spec", "backend.distill.documents", "backend.distill.pipeline"}


def _core(module: str) -> bool:
    return module == "backend.core" or module.startswith("backend.core.")


def test_backend_has_no_loose_modules():
    loose = sorted(p.name for p in (ROOT / "backend").glob("*.py") if p.name not in ("__init__.py", "cli.py"))
    assert not loose, f"put these into one of backend/{sorted(FOLDERS)}: {loose}"
    assert {p.name for p in (ROOT / "backend").iterdir() if p.is_dir() and p.name != "__pycache__"} == FOLDERS


def test_core_is_closed():
    graph = import_graph()
    leaks = {m: sorted(d for d in deps if d.startswith("backend") and not _core(d)
                        and d not in STAGE_DECLARATIONS | {"backend"})
             for m, deps in graph.items() if _core(m)}
    assert not {m: d for m, d in leaks.items() if d}, "backend/core imports a heavier folder"
    stage_deps = {d for m in STAGE_DECLARATIONS for d in graph[m] if d.startswith("backend")}
    assert all(_core(d) or d in STAGE_DECLARATIONS for d in stage_deps), stage_deps


def test_the_web_ui_imports_only_light_backend_modules():
    graph = import_graph()
    allowed = STAGE_DECLARATIONS | DISTILL_FRONT | {"backend"}
    leaks = {m: sorted(d for d in deps if d.startswith("backend") and not _core(d) and d not in allowed)
             for m, deps in graph.items() if m.startswith("webui")}
    assert not {m: d for m, d in leaks.items() if d}, leaks


def test_an_import_inside_a_function_says_why():
    """Imports go at the top; one inside a function keeps a light module light or loads an optional
    dependency, and its comment (same line or the line above) says which (ARCHITECTURE.md, the import rule)."""
    silent = []
    for top in ("backend", "webui"):
        for path in sorted((ROOT / top).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            tree = ast.parse("\n".join(lines))
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        said = "#" in "".join(lines[node.lineno - 1:node.end_lineno])
                        above = node.lineno > 1 and lines[node.lineno - 2].strip().startswith("#")
                        if not (said or above):
                            silent.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not silent, f"imports inside functions without a why-comment (move them to the top?): {sorted(set(silent))}"
