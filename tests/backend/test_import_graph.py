"""No import circles in backend/ and webui/, counting every import: those at the top of a file and those
inside functions (which hide a circle from Python but not from the design). Each module is parsed with
`ast`; relative imports are resolved; `from pkg import name` counts as importing `pkg.name` when that is a
module, else `pkg`. Any strongly connected component of more than one module fails, named."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("backend", "webui")


def _modules():
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def _resolve(name, mods):
    """The longest known module that `name` is or lies in (None for a module outside the packages)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in mods:
            return cand
        parts.pop()
    return None


def import_graph():
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                dep = _resolve(t, mods)
                if dep and dep != mod:
                    graph[mod].add(dep)
    return graph


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_finds_a_circle():
    """The checker itself: a two-module circle is found (a test that cannot fail is a defect)."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "backend.core.spec" in graph and "webui.app" in graph
    assert any(deps for deps in graph.values())


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles (modules that import each other, counting imports inside " \
                      "functions): " + "; ".join(" <-> ".join(c) for c in found)


def test_spec_evaluate_and_rundir_name_no_stage():
    """Stage rules live beside the stage declarations (backend/stages): these modules read the stages' declared
    rules and flags, never compare with a stage id (`spec.stage == "kto"`, `in ("rm", "kto")`)."""
    from backend.stages import STAGE_IDS

    found = []
    for rel in ("backend/core/spec.py", "backend/evaluation/evaluate.py", "backend/core/rundir.py"):
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [f"{rel}:{node.lineno} {v.value!r}" for v in values
                          if isinstance(v, ast.Constant) and v.value in STAGE_IDS]
    assert not found, "a stage named outside backend/stages: " + ", ".join(found)
