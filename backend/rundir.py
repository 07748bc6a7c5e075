"""The run directory is the durable state of a run (DESIGN.md section 3).

Only the backend writes here; the web UI rebuilds everything it shows from these files.
status.json is replaced atomically so a reader never sees half a file; trainer_log.jsonl and
running_log.txt are appended and flushed line by line so a tailer sees each step as it lands.
"""
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
LOG_FILE = "trainer_log.jsonl"
RUNNING_LOG = "running_log.txt"
SPEC_FILE = "run_spec.yaml"
STOP_FILE = "STOP"

TRAINER_LOG_KEYS = (
    "step", "total_steps", "epoch", "loss", "eval_loss", "lr", "grad_norm",
    "tokens_per_s", "elapsed_s", "eta_s", "memory_mb",
)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_status(run_dir: str | Path) -> dict:
    """status.json as a dict; {} when it does not exist yet or cannot be parsed."""
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


class RunDir:
    """Writer for one run directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.status: dict[str, Any] = read_status(self.path) or {}
        self._log = open(self.path / RUNNING_LOG, "a", encoding="utf-8")
        self._started = time.time()

    # -- status.json -------------------------------------------------------------------------
    def update_status(self, **fields: Any) -> None:
        self.status.update(fields)
        self.status["updated_at"] = now_iso()
        self.status.setdefault("output_dir", str(self.path))
        self.status.setdefault("warnings", [])
        write_json_atomic(self.path / STATUS_FILE, self.status)

    def start(self) -> None:
        self.update_status(
            state="running", pid=os.getpid(), exit_code=None, error=None, warnings=[],
            started_at=now_iso(), finished_at=None, step=0, total_steps=None,
        )

    def finish(self, state: str, exit_code: int, error: str | None = None, **extra: Any) -> None:
        self.update_status(state=state, exit_code=exit_code, error=error, finished_at=now_iso(), **extra)

    def warn(self, message: str) -> None:
        """One warning: a line in running_log.txt and an entry in status.json (deduplicated)."""
        self.log(f"WARNING: {message}")
        warnings = self.status.setdefault("warnings", [])
        if message not in warnings:
            warnings.append(message)
            self.update_status()

    # -- logs --------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        """A human-readable line, to running_log.txt and stdout (which the launcher also captures)."""
        line = f"[{datetime.now().strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def append_metrics(self, record: dict) -> None:
        row = {key: record.get(key) for key in TRAINER_LOG_KEYS}
        row.update({k: v for k, v in record.items() if k not in row})
        with open(self.path / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    @property
    def stop_requested(self) -> bool:
        return (self.path / STOP_FILE).exists()

    def close(self) -> None:
        self._log.close()
