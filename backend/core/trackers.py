"""Experiment trackers (`report_to`, LLaMA-Factory's key): which ones TuneBoard sets up, the refusal when a
tracker's package is missing, where each one writes inside the run folder, and how to open what it wrote.

Light (importlib only): `validate` and the web UI check a tracker without importing it. transformers' own callbacks
do the reporting; this module only gives them local defaults when no server is configured, so a run reports
somewhere the user can open without an account: TensorBoard event files in <run>/runs, W&B in offline mode
(<run>/wandb), MLflow's file store (<run>/mlruns), SwanLab in local mode (<run>/swanlog). Credentials stay in the
environment (WANDB_API_KEY, SWANLAB_API_KEY, MLFLOW_TRACKING_* ...): nothing here writes or logs their values."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

TENSORBOARD_DIR = "runs"   # TensorBoard event files (transformers' and LLaMA-Factory's folder name)
WANDB_DIR = "wandb"        # W&B's own folder under WANDB_DIR (offline-run-* in offline mode)
MLFLOW_DIR = "mlruns"      # MLflow's local file store
SWANLAB_DIR = "swanlog"    # SwanLab's local-mode logs

# tracker -> (the module it needs, the pip package that gives it)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "swanlab": ("swanlab", "swanlab"),
}
NONE = ("none", "")


def tracker_names(report_to) -> list[str]:
    """report_to (a name, comma-separated names, a list, or none) -> the trackers' names, in order, lowercase."""
    items = report_to if isinstance(report_to, (list, tuple)) else [report_to]
    names = []
    for item in items:
        for name in str(item if item is not None else "").split(","):
            name = name.strip().lower()
            if name not in NONE and name not in names:
                names.append(name)
    return names


def missing_package(name: str) -> str | None:
    """Why tracker `name` cannot report here (its package is not installed), or None."""
    module, package = TRACKERS[name]
    if importlib.util.find_spec(module) is not None:
        return None
    extra = "(or pip install -e '.[swanlab]')" if name == "swanlab" else \
        "(or pip install -e '.[trackers]' for tensorboard, wandb and mlflow)"
    return f"report_to {name} needs the {package} package, which is not installed: pip install {package} {extra}"


def tracker_problems(report_to) -> list[str]:
    """Each reason report_to cannot work here (unknown tracker, missing package); empty when it can."""
    problems = []
    for name in tracker_names(report_to):
        if name == "all":
            problems.append("report_to all would report to whatever happens to be installed: name the trackers "
                            f"({', '.join(TRACKERS)}), comma-separated")
        elif name not in TRACKERS:
            problems.append(f"report_to {name} is not a tracker TuneBoard sets up: use {', '.join(TRACKERS)} or none")
        else:
            missing = missing_package(name)
            if missing:
                problems.append(missing)
    return problems


_set_by_us: dict[str, str] = {}  # the values this process set, so a later run in the same process replaces them


def _user_set(key: str) -> bool:
    """The user (not an earlier run in this process) set environment variable `key`."""
    return bool(os.environ.get(key)) and _set_by_us.get(key) != os.environ[key]


def _wandb_env(out: Path) -> dict[str, str]:
    env = {"WANDB_DIR": str(out)}
    if not any(_user_set(k) for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL")):
        env["WANDB_MODE"] = "offline"  # no account or server configured: the run is kept for `wandb sync`
    return env


def _mlflow_env(out: Path) -> dict[str, str]:
    # MLflow 3 keeps the file store for existing users behind MLFLOW_ALLOW_FILE_STORE (a database store needs
    # SQLAlchemy, which mlflow-skinny does not bring): a folder of plain files is what a run folder wants
    return {"MLFLOW_TRACKING_URI": f"file:{out / MLFLOW_DIR}", "MLFLOW_ALLOW_FILE_STORE": "true"}


def _swanlab_env(out: Path) -> dict[str, str]:
    env = {"SWANLAB_LOG_DIR": str(out / SWANLAB_DIR)}
    if not any(_user_set(k) for k in ("SWANLAB_MODE", "SWANLAB_API_KEY")):
        env["SWANLAB_MODE"] = "local"
    return env


def _tensorboard_env(out: Path) -> dict[str, str]:
    return {"TENSORBOARD_LOGGING_DIR": str(out / TENSORBOARD_DIR)}


_DEFAULTS = {"tensorboard": _tensorboard_env, "wandb": _wandb_env, "mlflow": _mlflow_env, "swanlab": _swanlab_env}


def tracker_environment(report_to, out: Path) -> dict[str, str]:
    """The environment variables that point each tracker at the run folder `out`, for those the user has not set
    (a variable the user set, e.g. MLFLOW_TRACKING_URI to a server, is theirs and stays)."""
    env: dict[str, str] = {}
    for name in tracker_names(report_to):
        for key, value in _DEFAULTS.get(name, lambda _: {})(Path(out)).items():
            if not _user_set(key):
                env[key] = value
    return env


def point_trackers_at(report_to, out: Path) -> list[str]:
    """Set tracker_environment() in this process (the trainer's callbacks read it) and return one log line per
    tracker saying where it reports: the command that opens its folder, or the configured server (never a value)."""
    for key, value in list(_set_by_us.items()):  # an earlier run of this process pointed them elsewhere
        if os.environ.get(key) == value:
            del os.environ[key]
    _set_by_us.clear()
    env = tracker_environment(report_to, out)
    os.environ.update(env)
    _set_by_us.update(env)
    lines = []
    for name in tracker_names(report_to):
        remote = ((name == "wandb" and os.environ.get("WANDB_MODE") != "offline")
                  or (name == "swanlab" and os.environ.get("SWANLAB_MODE") != "local")
                  or (name == "mlflow" and "MLFLOW_TRACKING_URI" not in env))
        where = "to the server the environment configures" if remote else open_command(name, Path(out))
        if name == "tensorboard" and "TENSORBOARD_LOGGING_DIR" not in env:
            where = "into the folder TENSORBOARD_LOGGING_DIR names"
        lines.append(f"report_to {name}: {where}")
    return lines


def open_command(name: str, run_dir: Path) -> str | None:
    """The command that opens tracker `name`'s local logs of a run folder."""
    return {
        "tensorboard": f"tensorboard --logdir {run_dir / TENSORBOARD_DIR}",
        "mlflow": f"mlflow ui --backend-store-uri file:{run_dir / MLFLOW_DIR}",
        "wandb": f"wandb sync {run_dir / WANDB_DIR}/offline-run-*",
        "swanlab": f"swanlab watch {run_dir / SWANLAB_DIR}",
    }.get(name)


_FOLDERS = {"tensorboard": TENSORBOARD_DIR, "mlflow": MLFLOW_DIR, "wandb": WANDB_DIR, "swanlab": SWANLAB_DIR}


def local_logs(run_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """(tracker, command that opens it) for each tracker folder a run folder holds (the Runs tab shows them)."""
    run_dir = Path(run_dir)
    return [(name, open_command(name, run_dir)) for name, folder in _FOLDERS.items() if (run_dir / folder).is_dir()]
