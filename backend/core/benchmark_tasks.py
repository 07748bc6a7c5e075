"""What `tasks=` names, without lm-eval itself (light: the spec and the web UI import it).

A task is an lm-evaluation-harness task name (hellaswag, arc_easy, ...) or a path to a task YAML file in
lm-eval's own format (given to lm-eval alone, its includes and data files read from its folder). TuneBoard ships one such task that runs
offline: SHIPPED_TASK (30 multiple-choice questions over local JSONL files).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from backend.core.paths import REPO_ROOT

SHIPPED_TASK = REPO_ROOT / "data" / "lm_eval_tasks" / "tuneboard_mc.yaml"
INSTALL_HINT = "pip install -e '.[lm-eval]' (or make setup)"


def lm_eval_missing() -> str | None:
    """Why lm-eval cannot run here (one line saying how to get it), or None when it is installed."""
    try:
        found = importlib.util.find_spec("lm_eval") is not None
    except (ImportError, ValueError):  # a parent package broken, or sys.modules['lm_eval'] = None
        found = False
    if found:
        return None
    return f"tasks needs lm-evaluation-harness (the lm-eval package), which is not installed: {INSTALL_HINT}"


def split_tasks(value) -> list[str]:
    """'a, b,path.yaml' (or a list) -> ['a', 'b', 'path.yaml'], order kept, duplicates dropped."""
    items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
    return list(dict.fromkeys(str(x).strip() for x in items if str(x).strip()))


def is_task_file(task: str) -> bool:
    """A YAML path rather than a task name."""
    return task.lower().endswith((".yaml", ".yml"))


def task_file_errors(tasks: list[str]) -> list[str]:
    """One line per task YAML path that is not a file (names are checked by lm-eval's index when it runs)."""
    return [f"tasks: {t}: no such task file" for t in tasks if is_task_file(t) and not Path(t).expanduser().is_file()]
