"""Incremental readers for the files a run directory grows while training.

The UI polls a run every second or two. Re-reading whole files on each tick is what made the anchors'
boards slow on long runs, so each tailer remembers (inode, offset, partial line) and reads only the bytes
appended since the last poll. A file that shrinks (truncated), is replaced (new inode: rotation or a
rewrite) or whose first bytes changed (rewritten in place) is read again from the start. A missing file is
not an error: the run may not have written it yet.

All tailers are plain picklable objects so they can live in a `gr.State` (one per browser session).
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from backend.core.rundir import LOG_FILE, PROCESS_LOG, RUNNING_LOG, STATUS_FILE
from webui.tools import clean_line

# Bytes of the file head remembered to notice an in-place rewrite that is not shorter than before.
_HEAD_BYTES = 64


@dataclass
class FileTail:
    """Reads complete new lines of one text file, remembering where it stopped.

    `start_tail_bytes`: on the first read (and after a reset) start this many bytes before the end instead
    of at the start, dropping the first (cut) line. Used for human-readable logs where only the last lines
    matter; the metrics log is always read from the start.
    """

    path: str
    start_tail_bytes: int | None = None
    inode: int | None = None
    offset: int = 0
    partial: bytes = b""
    head: bytes = b""
    resets: int = 0

    def _reset(self) -> None:
        self.inode, self.offset, self.partial, self.head = None, 0, b"", b""
        self.resets += 1

    def read_lines(self) -> list[str]:
        """Complete lines appended since the last call (without their newline). A trailing line with no
        newline yet is kept back until it is finished."""
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            if self.inode is not None:
                self._reset()
            return []
        with fh:
            st = os.fstat(fh.fileno())
            if self.inode is not None:
                rotated = st.st_ino != self.inode
                truncated = st.st_size < self.offset
                rewritten = bool(self.head) and not rotated and not truncated and (
                    _read_at(fh, 0, len(self.head)) != self.head)
                if rotated or truncated or rewritten:
                    self._reset()
            skip_first = False
            if self.inode is None:
                self.inode = st.st_ino
                if self.start_tail_bytes is not None and st.st_size > self.start_tail_bytes:
                    self.offset = st.st_size - self.start_tail_bytes
                    skip_first = True
                else:
                    self.offset = 0
            if len(self.head) < _HEAD_BYTES:
                self.head = _read_at(fh, 0, _HEAD_BYTES)
            fh.seek(self.offset)
            data = fh.read()
        if not data:
            return []
        self.offset += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        if skip_first and complete:
            complete = complete[1:]
        return [line.rstrip(b"\r").decode("utf-8", errors="replace") for line in complete]


def _read_at(fh, pos: int, n: int) -> bytes:
    here = fh.tell()
    fh.seek(pos)
    data = fh.read(n)
    fh.seek(here)
    return data


@dataclass
class JsonlTail:
    """New JSON objects of a JSON-lines file. Malformed lines (and non-object values) are skipped and
    counted, never fatal: one bad line must not blank the live plot. `reset_seen` tells the caller the
    file started over so it can drop the records it had."""

    path: str
    lines: FileTail = None  # type: ignore[assignment]
    malformed: int = 0
    last_error: str = ""

    def __post_init__(self) -> None:
        if self.lines is None:
            self.lines = FileTail(self.path)

    def read(self) -> tuple[list[dict], bool]:
        """Returns (new records, whether the file was reset since the last call)."""
        resets_before = self.lines.resets
        out: list[dict] = []
        for n, line in enumerate(self.lines.read_lines()):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                self.malformed += 1
                self.last_error = f"{self.path}: bad JSON line ({exc.msg}): {line[:80]!r}"
                continue
            if not isinstance(obj, dict):
                self.malformed += 1
                self.last_error = f"{self.path}: line is not a JSON object: {line[:80]!r}"
                continue
            out.append(obj)
        return out, self.lines.resets != resets_before


@dataclass
class StatusFile:
    """status.json is small and replaced atomically, so it is re-read whole, but only when its
    (inode, mtime, size) changed since the last poll."""

    path: str
    stamp: tuple | None = None
    value: dict = field(default_factory=dict)

    def read(self) -> dict:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.stamp, self.value = None, {}
            return self.value
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self.stamp:
            try:
                value = json.loads(Path(self.path).read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError, OSError):
                return self.value  # caught mid-write by a non-atomic writer: keep the last good one
            if isinstance(value, dict):
                self.stamp, self.value = stamp, value
        return self.value


@dataclass
class RunTail:
    """Everything the live view needs from one run directory, updated incrementally by `poll()`:
    all metric records so far, the last `log_lines` lines of the human-readable log and the status."""

    run_dir: str
    log_lines: int = 200
    metrics: JsonlTail = None  # type: ignore[assignment]
    log: FileTail = None  # type: ignore[assignment]
    status_file: StatusFile = None  # type: ignore[assignment]
    records: list = field(default_factory=list)
    log_tail: deque = None  # type: ignore[assignment]
    log_path: str = ""

    def __post_init__(self) -> None:
        d = Path(self.run_dir)
        if self.metrics is None:
            self.metrics = JsonlTail(str(d / LOG_FILE))
        if self.status_file is None:
            self.status_file = StatusFile(str(d / STATUS_FILE))
        if self.log_tail is None:
            self.log_tail = deque(maxlen=self.log_lines)

    def _log_source(self) -> str:
        """The process output file (everything the subprocess printed, tracebacks included) when the UI
        launched the run, else the backend's running_log.txt (a run started from the CLI)."""
        d = Path(self.run_dir)
        proc = d / PROCESS_LOG
        return str(proc if proc.exists() else d / RUNNING_LOG)

    def poll(self) -> dict:
        """Read what is new. Returns the status dict (may be empty)."""
        new, reset = self.metrics.read()
        if reset:
            self.records = []
        self.records.extend(new)
        src = self._log_source()
        if self.log is None or src != self.log_path:
            self.log_path = src
            self.log = FileTail(src, start_tail_bytes=64 * 1024)
            self.log_tail.clear()
        resets = self.log.resets
        lines = self.log.read_lines()
        if self.log.resets != resets:
            self.log_tail.clear()
        self.log_tail.extend(lines)
        return self.status_file.read()

    @property
    def malformed(self) -> int:
        return self.metrics.malformed

    def log_text(self) -> str:
        return "\n".join(self.log_tail)


def run_state(run_dir: str | None) -> dict:
    """The Train tab's per-browser state for a run (None: no run): the run folder and its RunTail. Any tab
    that opens a run in the Train tab (Runs: Open, Relaunch) puts this in the shared state."""
    return {"run_dir": run_dir, "tail": RunTail(run_dir) if run_dir else None}


def job_log(st: dict, job_dir: str, max_lines: int) -> str:
    """One poll of a tool job's process output (Export, Evaluate, Distill): the new lines of
    `job_dir`/PROCESS_LOG, progress-bar rewrites cleaned (tools.clean_line), the last `max_lines` kept in
    st["lines"]; returns them as one text. st["log"] holds the FileTail (None: start one, e.g. after a
    reload); st["log_dir"] the folder it reads: another folder (Evaluate's next part) starts afresh."""
    if st.get("log_dir") not in (None, str(job_dir)):
        st["log"], st["lines"] = None, []
    st["log_dir"] = str(job_dir)
    if st.get("log") is None:
        st["log"] = FileTail(str(Path(job_dir) / PROCESS_LOG))
    lines = deque(st.get("lines") or [], maxlen=max_lines)
    lines.extend(clean_line(x) for x in st["log"].read_lines())
    st["lines"] = list(lines)
    return "\n".join(st["lines"])
