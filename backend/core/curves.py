"""A loss curve in three honest numbers (issue 24, item 7), and how long a step takes. Light: the web UI reads it
too.

The last logged loss is one noisy batch (1.63 on a run whose curve zig-zags between 1.6 and 3.7, mean 2.56), so
a run is summarised by its last loss, the smoothed curve's last point (the live plot's own smoothing) and the
lowest logged loss, each named for what it is: `tuneboard train` writes them into status.json's final_metrics,
and the Train tab's summary, its end message and the Runs table show them.
"""
from __future__ import annotations

import json
from pathlib import Path

from backend.core.rundir import LOG_FILE

SMOOTHING = 0.6  # the live plot's "smoothed" series


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average (TensorBoard's), so the first points are not pulled to 0."""
    out, last, n = [], 0.0, 0
    for v in values:
        n += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** n))
    return out


def loss_summary(losses: list[float]) -> dict[str, float]:
    """{final_loss, smoothed_loss, min_loss} of the logged training losses in step order ({} when none)."""
    if not losses:
        return {}
    return {"final_loss": losses[-1], "smoothed_loss": smooth(losses)[-1], "min_loss": min(losses)}


def step_seconds(run_dir: Path) -> tuple[float | None, int]:
    """(duration of the last logged step, steps logged) from the child's trainer_log.jsonl: the last step
    minus the one before (the first step alone when only one ran, its warm-up included)."""
    elapsed = {}
    try:
        for line in (run_dir / LOG_FILE).read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row.get("step"), int) and isinstance(row.get("elapsed_s"), (int, float)) and row.get("loss") is not None:
                elapsed[row["step"]] = float(row["elapsed_s"])
    except OSError:
        return None, 0
    if not elapsed:
        return None, 0
    steps = sorted(elapsed)
    last = steps[-1]
    if len(steps) >= 2:
        before = steps[-2]
        return (elapsed[last] - elapsed[before]) / (last - before), len(steps)
    return elapsed[last] / max(1, last), 1
