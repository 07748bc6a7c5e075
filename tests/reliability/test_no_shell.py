"""No shell anywhere in backend/ and webui/ (issue 9): every process is started from an argv list, so a
path, a dataset name or a model name can never become a shell command. Walks the syntax tree of every
source file: a `shell=` keyword that is not the constant False, os.system, os.popen, the os.exec*/spawn*
family through a shell, and commands.getoutput are refused."""
from __future__ import annotations

import ast
from pathlib import Path

from backend.core.paths import REPO_ROOT

SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
               ("os", "spawnlp"), ("os", "spawnvp"), ("pty", "spawn")}


def sources():
    for package in ("backend", "webui"):
        yield from sorted((REPO_ROOT / package).rglob("*.py"))


def shell_uses(path: Path, root: Path = REPO_ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{path.relative_to(root)}:{node.lineno}: shell={ast.unparse(kw.value)}")
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and (func.value.id, func.attr) in SHELL_CALLS:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {func.value.id}.{func.attr}()")
        if isinstance(func, ast.Name) and func.id in {"system", "popen", "getoutput"}:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {func.id}() (imported bare)")
    return found


def test_no_shell_in_backend_or_webui():
    files = list(sources())
    assert len(files) > 30  # the walk really covers the packages
    found = [use for path in files for use in shell_uses(path)]
    assert not found, "\n".join(found)


def test_the_walk_finds_each_kind(tmp_path):
    """The check itself: each way of reaching a shell is found in a made-up module."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os, subprocess\nfrom os import system\nsubprocess.run('ls', shell=True)\n"
                   "subprocess.Popen(['ls'], shell=flag)\nos.system('ls')\nos.popen('ls')\nsystem('ls')\n"
                   "subprocess.run(['ls'], shell=False)\n")
    found = shell_uses(bad, root=tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == ["shell=True", "shell=flag", "os.system()", "os.popen()",
                                                     "system() (imported bare)"]
