"""training_loss.png at the end of a run, drawn from trainer_log.jsonl (the same file the UI plots)."""
from __future__ import annotations

import json
from pathlib import Path

from backend.core.rundir import LOG_FILE, PLOT_FILE


def read_log(run_dir: Path) -> list[dict]:
    rows = []
    path = Path(run_dir) / LOG_FILE
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def smooth(values: list[float], weight: float = 0.6) -> list[float]:
    """Exponential moving average with bias correction (the first point is not pulled to zero)."""
    out, avg = [], 0.0
    for i, value in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * value
        out.append(avg / (1 - weight**i))
    return out


def plot_loss(run_dir: Path) -> Path | None:
    import matplotlib  # heavy: loaded on use, so importing this module stays light

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: loaded on use, so importing this module stays light

    rows = read_log(run_dir)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="#9ab8e6", alpha=0.8, label="loss")
        ax.plot(steps, smooth(list(losses)), color="#1f5fbf", label="loss (smoothed)")
    if evals:
        steps, losses = zip(*evals)
        ax.plot(steps, losses, "o-", color="#d9534f", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"training loss: {Path(run_dir).name}")
    ax.grid(alpha=0.3)
    # the legend under the axes, not over the curves (where the loss ends, upper right, it hid them)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    fig.tight_layout()
    path = Path(run_dir) / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path
