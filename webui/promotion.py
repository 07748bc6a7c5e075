"""A run's checkpoints for a tab (the Runs tab; the Evaluate tab may show the same): the table (step, loss,
the task metric, which one is the adapter now) and Promote / Undo promote with a message in the page's
language. The promote itself is backend/core/promote.py; this module only words it. Light: no torch."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from backend.core import paths, promote
from webui.i18n import headers, tr

CHECKPOINT_COLUMNS = ["step", "checkpoint", "loss", "adapter"]


def _name(run_dir: str) -> str:
    """The run as the Runs table names it: its path under the saves folder (else the path)."""
    try:
        return str(Path(run_dir).relative_to(paths.saves_dir()))
    except ValueError:
        return str(run_dir)


def checkpoint_frame(run_dir: str | None, lang: str = "en") -> pd.DataFrame:
    """The picked run's checkpoints: step, checkpoint, the training loss at that step, the task metric (a
    column named by the metric, when the run scored its saves; ★ marks the best), and ✓ on the one that is
    the run's adapter now (promoted)."""
    rows, metric = promote.checkpoint_rows(run_dir)
    columns = CHECKPOINT_COLUMNS[:3] + ([metric] if metric else []) + CHECKPOINT_COLUMNS[3:]
    data = []
    for r in rows:
        line = [r["step"], r["checkpoint"] + ("" if r["complete"] else " (incomplete)"),
                "" if r["loss"] is None else f"{r['loss']:.4f}"]
        if metric:
            line.append("" if r["metric"] is None else f"{r['metric']:.4f}" + (" ★" if r["best"] else ""))
        data.append(line + ["✓" if r["adapter"] else ""])
    return headers(lang, pd.DataFrame(data, columns=columns))


def checkpoint_names(run_dir: str | None) -> list[str]:
    return [r["checkpoint"] for r in promote.checkpoint_rows(run_dir)[0]]


def promote_checkpoint(run_dir: str | None, checkpoint: str | None, undo: bool = False,
                       lang: str = "en") -> tuple[bool, str]:
    """Promote a checkpoint of a run to its adapter, or undo the promotion. Returns (done, message)."""
    if not run_dir:
        return False, tr(lang, "runs.pick")
    if not undo and not checkpoint:
        return False, tr(lang, "runs.pick_checkpoint")
    name = _name(run_dir)
    try:
        if undo:
            promote.undo(run_dir)
            return True, tr(lang, "runs.promote_undone", name=name)
        record = promote.promote(run_dir, checkpoint)
    except (promote.PromoteError, OSError) as exc:
        return False, tr(lang, "runs.cannot_promote", error=exc)
    return True, tr(lang, "runs.promoted", checkpoint=record["checkpoint"], name=name)
