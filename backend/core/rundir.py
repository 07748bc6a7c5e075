"""The run directory is the durable state of a run (ARCHITECTURE.md, "run files": this module owns every run-file name).

Only the backend writes here; the web UI rebuilds everything it shows from these files.
status.json is replaced atomically so a reader never sees half a file; trainer_log.jsonl and
running_log.txt are appended and flushed line by line so a tailer sees each step as it lands.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from backend.core import paths
from backend.core.atomic import read_json_dict, write_json_atomic  # noqa: F401  (write_json_atomic: public here too)
from backend.stages import stages_where
import yaml
import signal
import psutil

STATUS_FILE = "status.json"
LOG_FILE = "trainer_log.jsonl"
RUNNING_LOG = "running_log.txt"
SPEC_FILE = "run_spec.yaml"
STOP_FILE = "STOP"
COMPLETIONS_FILE = "completions.jsonl"  # stage grpo: a sample of the completions with their rewards, per logging step
LAUNCH_FILE = "launch.json"  # written by the web UI's job launcher: the launched pid, its argv and launch time
PROCESS_LOG = "process_output.log"  # the launched process's stdout and stderr (the UI's launcher writes it)
DEBUG_LOG = "debug_log.txt"  # third-party warnings (warnings module, library loggers below ERROR): not the user's log
DISTILL_REPORT_FILE = "distill_report.json"  # a distill run folder's scorecard (`tuneboard distill`, step score)
PROBE_RESULT_FILE = "probe.json"  # `tuneboard probe --out`: the measured peak memory, s/step, fits, suggestions
PROBE_MEASURE_FILE = "probe_measures.json"  # a probe's child writes what its parent cannot see (rows, CUDA peak)
PLOT_FILE = "training_loss.png"  # plot_loss: the loss curve drawn at the end of a run
PREDICTIONS_FILE = "generated_predictions.jsonl"  # do_predict / tuneboard eval / rm scoring: one line per row
EVAL_RESULTS_FILE = "eval_results.json"  # tuneboard eval: the metrics
EXPORT_REPORT_FILE = "export_report.json"  # tuneboard export: what was written and how the reload compared
CHECKPOINT_SCORES_FILE = "checkpoint_scores.json"  # eval_metric: the task metric of each save and the best one
PROMOTION_FILE = "promotion.json"  # tuneboard promote: which checkpoint is the run's adapter, the earlier one kept
PROMOTION_KEEP_DIR = "final_before_promote"  # tuneboard promote: the run's own final weights, kept until undo
LM_EVAL_FILE = "lm_eval_results.json"  # tuneboard eval tasks=...: lm-evaluation-harness results, base and tuned
JUDGE_FILE = "judge_results.json"  # tuneboard eval judge: win / tie / loss, the interval and each row's reasons
JUDGE_CACHE_DIRNAME = "judge_cache"  # the judge's answered requests (backend/evaluation/judge.py), one JSON file each
CHECKPOINT_EVAL_FILE = "checkpoint_eval.json"  # tuneboard eval checkpoints=...: each checkpoint's metrics and the best per metric
CHECKPOINT_PREFIX = "checkpoint-"
# What the HF Trainer writes last into checkpoint-N (after weights, optimizer, scheduler and RNG state):
# a checkpoint folder without it was cut short (killed, disk full) and cannot be resumed from.
CHECKPOINT_COMPLETE_MARKER = "trainer_state.json"
# `tuneboard train` runs its training process as the child of a small supervising parent (backend/core/supervise.py).
# The child finds the parent's pid here (status.json records it: the launched process, the group the UI stops) and
# the pipe it tells the parent its run directory through.
SUPERVISOR_PID_ENV = "TUNEBOARD_SUPERVISOR_PID"
SUPERVISOR_FD_ENV = "TUNEBOARD_SUPERVISOR_FD"

# status.json "state": a run in ACTIVE_STATES has a process behind it; FINAL_STATES are written once, at the end.
ACTIVE_STATES = ("pending", "running")
FINAL_STATES = ("completed", "aborted", "failed")
# status.json "phase" of a training process, written at each transition so the UI shows what the process is
# doing instead of guessing it: LOADING from start until the Trainer begins (tokenizer, dataset, model: its log
# lines say which), TRAINING from the Trainer's first step (with "step": the steps done), SAVING after the last
# step (final save, plot). "phase_started" keeps when each began (RunDir.set_phase); the final status keeps the
# phase the run ended in. A distill run folder writes its own step names ("generate", "train", "score").
PHASE_LOADING, PHASE_TRAINING, PHASE_SAVING = "loading", "training", "saving"
TOKENIZING_EVERY = 0.5  # seconds between two writes of status.json's "tokenizing" progress (RunDir.tokenizing_progress)
# an eval process's phases after LOADING (status "step" counts the phase's rows): PREDICTING the tuned answers
# with their scores, ANSWERING for the judge ("answering": whose answers, base or tuned), JUDGING the pairs
PHASE_PREDICTING, PHASE_ANSWERING, PHASE_JUDGING = "predicting", "answering", "judging"

TRAINER_LOG_KEYS = (
    "step", "total_steps", "epoch", "loss", "eval_loss", "lr", "grad_norm",
    "tokens_per_s", "elapsed_s", "eta_s", "memory_mb",
)


# ---------------------------------------------------------------- naming run folders (the one home: CLI and UI)
STAMP_FORMAT = "%Y%m%d-%H%M%S"  # a run folder's time stamp (tuneboard train/eval, the UI's tool jobs, uploads)


def stamp(now: datetime | None = None, fmt: str = STAMP_FORMAT) -> str:
    return (now or datetime.now()).strftime(fmt)


def model_slug(model: str) -> str:
    """A folder name for a model id or path: the last path component, without a .gguf suffix."""
    name = str(model or "").rstrip("/\\").replace("\\", "/").split("/")[-1] or "model"
    name = re.sub(r"\.gguf$", "", name, flags=re.I)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def default_output_dir(model: str, finetuning_type: str, root: Path | None = None, now: datetime | None = None,
                       fmt: str = STAMP_FORMAT) -> Path:
    """<root, default paths.saves_dir()>/<model slug>/<finetuning_type>/<time stamp> (not made unique:
    unique_dir does that where two runs may start in one second)."""
    return Path(root or paths.saves_dir()) / model_slug(model) / (finetuning_type or "run") / stamp(now, fmt)


def unique_dir(base: Path, taken=()) -> Path:
    """`base`, or base-2, base-3, ... : the first that does not exist and is not in `taken` (paths as str)."""
    base = Path(base)
    taken = {str(t) for t in taken}
    candidate, n = base, 1
    while candidate.exists() or str(candidate) in taken:
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _time(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(value).timestamp() if isinstance(value, str) else None
    except ValueError:
        return None


def earlier_time(status: dict) -> tuple[float, str | None]:
    """(seconds the processes of a run ran before this one, when the first of them started), from the status the
    last of them left: its own start to its end (or its last update, when it died without one) plus its
    "earlier_s". What status.json's earlier_s and run_started_at hold once a resumed run starts."""
    started, ended = _time(status.get("started_at")), _time(status.get("finished_at") or status.get("updated_at"))
    ran = max(ended - started, 0.0) if started is not None and ended is not None else 0.0
    return _earlier_s(status) + ran, status.get("run_started_at") or status.get("started_at")


def run_seconds(status: dict, now: float | None = None) -> float | None:
    """How long a run's processes have run, all of them (a resumed run's earlier ones too): status.json's
    earlier_s plus this process's start to its end (`now`, else the last update, while it runs). None without a start."""
    started = _time(status.get("started_at"))
    ended = _time(status.get("finished_at")) or now or _time(status.get("updated_at"))
    if started is None or ended is None:
        return None
    return _earlier_s(status) + max(ended - started, 0.0)


def _earlier_s(status: dict) -> float:
    value = status.get("earlier_s")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0.0


def supervisor_pid() -> int | None:
    """The pid of the supervising `tuneboard train` parent when this process is its training child, else None."""
    value = os.environ.get(SUPERVISOR_PID_ENV, "")
    return int(value) if value.isdigit() and int(value) == os.getppid() else None


def _tell_supervisor(path: Path) -> None:
    """Hand the supervising parent this run's folder (once), so it can write the final status if this process dies."""
    fd = os.environ.pop(SUPERVISOR_FD_ENV, "")
    if not fd.isdigit() or supervisor_pid() is None:
        return
    try:
        os.write(int(fd), (str(path) + "\n").encode("utf-8", "surrogateescape"))
        os.close(int(fd))
    except OSError:
        pass


def last_value(path: str | Path, key: str, chunk: int = 64 * 1024) -> float | None:
    """The value of `key` in the last JSON line of a JSON-lines file that has it (trainer_log.jsonl: the
    last logged loss), read backwards from the end in chunks; None when no line has it."""
    try:
        fh = open(path, "rb")
    except OSError:
        return None
    with fh:
        end = fh.seek(0, os.SEEK_END)
        tail = b""
        while end > 0:
            start = max(0, end - chunk)
            fh.seek(start)
            data = fh.read(end - start) + tail
            lines = data.split(b"\n")
            tail = lines.pop(0) if start > 0 else b""  # maybe cut: finished by the next chunk
            for line in reversed(lines):
                if key.encode() not in line:
                    continue
                try:
                    value = json.loads(line).get(key)
                except (json.JSONDecodeError, AttributeError):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return float(value)
            end = start
    return None


def last_logged_step(run_dir: str | Path) -> int | None:
    """The step of the last line of trainer_log.jsonl that has one, or None."""
    step = last_value(Path(run_dir) / LOG_FILE, "step")
    return None if step is None else int(step)


def read_status(run_dir: str | Path) -> dict:
    """status.json as a dict; {} when it does not exist yet or cannot be parsed."""
    return read_json_dict(Path(run_dir) / STATUS_FILE)


def checkpoint_step(path: str | Path) -> int | None:
    """N of a checkpoint-N folder name, else None."""
    name = Path(path).name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    tail = name[len(CHECKPOINT_PREFIX):]
    return int(tail) if tail.isdigit() else None


def is_complete_checkpoint(path: str | Path) -> bool:
    """Whether checkpoint-N was written to the end: its trainer_state.json (written last) exists and parses."""
    try:
        json.loads((Path(path) / CHECKPOINT_COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The checkpoint-N folders of a run dir, oldest (smallest N) first, complete or not."""
    found = [p for p in Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


class ResumeError(ValueError):
    """resume_from_checkpoint names nothing to resume; str() is the one line (field first)."""


def resume_choice(value, out: str | Path | None) -> tuple[Path | None, list[str]]:
    """The checkpoint `resume_from_checkpoint: value` continues: true = the newest complete checkpoint-N in `out` (the
    run's output_dir), a path = that checkpoint folder; and the names of newer incomplete ones skipped (a save cut
    short by a kill or a full disk has no trainer_state.json). (None, []) when value is unset. ResumeError when it
    names nothing to resume: `validate` says it before launch, the stage at launch."""
    if not value:
        return None, []
    if value is True or str(value).lower() == "true":
        if not out:
            raise ResumeError("resume_from_checkpoint: true continues the run in output_dir: set output_dir to that "
                              "run's folder (or give the checkpoint folder itself)")
        found = checkpoints(out)
        complete = [c for c in found if is_complete_checkpoint(c)]
        skipped = [c.name for c in found if not is_complete_checkpoint(c)
                   and (not complete or checkpoint_step(c) > checkpoint_step(complete[-1]))]
        if not complete:
            raise ResumeError(f"resume_from_checkpoint: no complete checkpoint-N folder in {out}"
                              + (f" ({', '.join(skipped)} incomplete)" if skipped else ""))
        return complete[-1], skipped
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        raise ResumeError(f"resume_from_checkpoint: {path} is not a checkpoint folder")
    if checkpoint_step(path) is not None and not is_complete_checkpoint(path):
        raise ResumeError(f"resume_from_checkpoint: {path} is incomplete (no {CHECKPOINT_COMPLETE_MARKER}: the save "
                          "was cut short); give an earlier checkpoint or true for the newest complete one")
    return path, []


REWARD_TASK_TYPE = "SEQ_CLS"  # peft's task type of a reward adapter (the score head rides in modules_to_save)


def is_reward_model_dir(path: str | Path | None) -> bool:
    """Whether a folder holds a reward model (what stage rm saves: a one-output score head), judged from its
    small JSON / YAML files only, so that the web UI (no torch) and the backend (eval, export, PPO's
    reward_model) give the same answer:
    - adapter_config.json decides for an adapter folder: task_type SEQ_CLS (a causal LM adapter is not one);
    - else config.json: architectures ...ForSequenceClassification with one label (a full / freeze rm run);
    - else run_spec.yaml with stage: rm (an rm run that has not saved its model yet)."""
    if not path:
        return False
    path = Path(path).expanduser()
    try:
        if (path / "adapter_config.json").is_file():
            config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
            return isinstance(config, dict) and config.get("task_type") == REWARD_TASK_TYPE
        if (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                return False
            return (any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])
                    and len(config.get("id2label") or {0: ""}) == 1)
        if (path / SPEC_FILE).is_file():
            try:
                spec = yaml.safe_load((path / SPEC_FILE).read_text(encoding="utf-8"))
            except yaml.YAMLError:
                return False
            return isinstance(spec, dict) and spec.get("stage") in stages_where("is_reward_model")
    except (OSError, ValueError):
        return False
    return False


def reward_model_folder(model_name_or_path: str | Path | None, adapter_name_or_path: str | None = None) -> str | None:
    """The folder that makes `model (+ adapters)` a reward model, or None when it is a causal LM: the last
    adapter when there are adapters (it holds the trained score head), else the model folder."""
    adapters = [a.strip() for a in str(adapter_name_or_path or "").split(",") if a.strip()]
    holder = adapters[-1] if adapters else model_name_or_path
    return str(holder) if is_reward_model_dir(holder) else None


def end_reason(returncode: int | None, step: Any = None, total: Any = None, stop_requested: bool = False) -> str:
    """Why a process ended without writing its final status, in words, with where it was. A SIGKILL out of
    the blue is most often the kernel's out-of-memory killer; after a stop request it is the escalation."""

    if returncode is None:
        why = "the process ended without a final status (exit code unknown)"
    elif returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = f"killed by signal {-returncode} ({name}"
        why += ", out of memory?)" if -returncode == signal.SIGKILL and not stop_requested else ")"
    else:
        why = f"the process exited with code {returncode} without a final status"
    if isinstance(step, int) and step > 0:
        where = f" at step {step}" + (f" of {total}" if isinstance(total, int) and total > 0 else "")
    else:
        where = " before the first training step"
    return why + where


def mark_ended(run_dir: str | Path, returncode: int | None = None, *, launched_at: float | None = None,
               detail: str | None = None, by: str = "watcher") -> dict | None:
    """For the launcher / job watcher, once the run's process has ended: if status.json still says the
    run is active, or there is none, or it is older than the launch (`launched_at`, a time.time()) and so
    an earlier process's, write the final state the process could not write itself (killed, out of
    memory, crashed before it started): `aborted` when a stop was requested, else `failed`, with the
    reason (and `detail`, e.g. the last line of the process output). A status an earlier look wrote
    without the exit code is replaced once the code is known. Returns the status written, or None when
    the run already had its final status."""
    path = Path(run_dir)
    status = read_status(path)
    state = status.get("state")
    try:
        stale = launched_at is not None and (path / STATUS_FILE).stat().st_mtime < launched_at
    except OSError:
        stale = False
    guessed = status.get("ended_by") == "watcher" and status.get("exit_code") is None
    if state in FINAL_STATES and not stale and not (guessed and returncode is not None):
        return None
    if returncode == 0 and not status:
        return None  # a clean exit of a command that keeps no status (an export job)
    if stale:  # the step and total of an earlier process say nothing about this one
        status = {k: v for k, v in status.items() if k not in ("step", "total_steps")}
    logged = None if stale else last_logged_step(path)
    if isinstance(logged, int) and logged > (status.get("step") if isinstance(status.get("step"), int) else -1):
        status["step"] = logged
    stop_requested = (path / STOP_FILE).exists()
    reason = end_reason(returncode, status.get("step"), status.get("total_steps"), stop_requested)
    if stop_requested:
        reason += " (after a stop request)"
    if detail:
        reason += f": {detail}"
    status.update(state="aborted" if stop_requested else "failed", exit_code=returncode, error=reason,
                  finished_at=now_iso(), updated_at=now_iso(), ended_by=by)
    status.setdefault("output_dir", str(path))
    try:
        write_json_atomic(path / STATUS_FILE, status, mkdir=False)
    except OSError:
        return None
    try:
        with open(path / RUNNING_LOG, "a", encoding="utf-8") as log:
            log.write(f"[{datetime.now().strftime('%H:%M:%S')}] {status['state'].upper()}: {reason}\n")
    except OSError:
        pass
    return status


class RunDir:
    """Writer for one run directory. In a run of several processes only global rank 0 writes: the other
    ranks get a RunDir with writer=False, which keeps the status in memory, writes no file, prints nothing
    and never reads the STOP file (rank 0 reads it and tells the others: backend.training.callbacks)."""

    def __init__(self, path: str | Path, writer: bool = True):
        self.path = Path(path)
        self.writer = writer
        self.path.mkdir(parents=True, exist_ok=True)
        self.status: dict[str, Any] = read_status(self.path) or {}
        self._log = open(self.path / RUNNING_LOG, "a", encoding="utf-8") if writer else None
        self._started = time.time()
        self._tokenizing_since, self._tokenizing_written = 0.0, 0.0

    # -- status.json -------------------------------------------------------------------------
    def update_status(self, **fields: Any) -> None:
        self.status.update(fields)
        self.status["updated_at"] = now_iso()
        self.status.setdefault("output_dir", str(self.path))
        self.status.setdefault("warnings", [])
        if self.writer:
            write_json_atomic(self.path / STATUS_FILE, self.status, mkdir=False)

    def start(self, continues: bool = False) -> None:
        """This process's run begins: status "running". `continues`: it resumes the run in this folder
        (resume_from_checkpoint), so the run's time covers its earlier processes too (earlier_s, run_started_at)."""
        self.clear_stale_stop()
        earlier_s, run_started_at = earlier_time(self.status) if continues else (0.0, None)
        for key in ("ended_by", "tokenizing", "final_metrics"):  # an earlier process's: the watcher's status,
            self.status.pop(key, None)                            # its tokenizing progress, its summary
        now = now_iso()
        # pid: the process the UI launched and stops (its group), the supervising parent when there is one;
        # train_pid: this process, which trains
        self.update_status(
            state="running", pid=supervisor_pid() or os.getpid(), train_pid=os.getpid(), exit_code=None, error=None,
            warnings=[], started_at=now, finished_at=None, step=0, total_steps=None,
            phase=PHASE_LOADING, phase_started={PHASE_LOADING: now},
            earlier_s=earlier_s, run_started_at=run_started_at or now,
        )
        _tell_supervisor(self.path)

    def set_phase(self, phase: str, **fields: Any) -> None:
        """The process entered `phase` (PHASE_*): status.json says so, and keeps when each phase began."""
        started = dict(self.status.get("phase_started") or {}, **{phase: now_iso()})
        self.update_status(phase=phase, phase_started=started, **fields)

    def tokenizing_progress(self, done: int, total: int) -> None:
        """Rows tokenized so far (backend.dataprep.preprocess.tokenizing reports them): status.json "tokenizing" =
        {done, total, rows_per_s, eta_s}, for the Train tab's tokenizing bar. Written at the start, at the end and
        at most every TOKENIZING_EVERY seconds between; rows_per_s and eta_s from the rows done since the start."""
        now = time.time()
        if done == 0 or not self._tokenizing_since:
            self._tokenizing_since, self._tokenizing_written = now, 0.0
        if 0 < done < total and now - self._tokenizing_written < TOKENIZING_EVERY:
            return
        self._tokenizing_written = now
        elapsed = now - self._tokenizing_since
        rate = done / elapsed if done and elapsed > 0 else None
        self.update_status(tokenizing={"done": done, "total": total, "rows_per_s": rate,
                                       "eta_s": (total - done) / rate if rate else None})

    def clear_stale_stop(self) -> None:
        """Remove a STOP file left by an earlier abort, so a resumed run does not stop again at once. A STOP
        written after this process started is a stop request for this run and stays."""
        stop = self.path / STOP_FILE
        try:
            written = stop.stat().st_mtime
        except OSError:
            return
        try:
            started = psutil.Process().create_time()
        except Exception:  # no psutil: the RunDir's own creation time, slightly later
            started = self._started
        if written < started:
            stop.unlink(missing_ok=True)
            self.log(f"removed the {STOP_FILE} file left by an earlier stop "
                     f"({datetime.fromtimestamp(written).strftime('%Y-%m-%d %H:%M:%S')})")

    def finish(self, state: str, exit_code: int, error: str | None = None, **extra: Any) -> None:
        """The final status. If it cannot be written whole (a full disk, a huge error message), a small
        one without the big fields is written instead, so the run never stays "running"."""
        try:
            self.update_status(state=state, exit_code=exit_code, error=error, finished_at=now_iso(), **extra)
        except OSError as exc:
            small = {"state": state, "exit_code": exit_code, "pid": self.status.get("pid"),
                     "error": (error or "")[:500] or None, "finished_at": now_iso(), "updated_at": now_iso(),
                     "step": self.status.get("step"), "total_steps": self.status.get("total_steps"),
                     "output_dir": str(self.path), "note": f"the full status could not be written: {exc}"}
            self.status = small
            try:
                write_json_atomic(self.path / STATUS_FILE, small, mkdir=False)
            except OSError as again:  # nothing fits: the launcher marks the run ended from its exit code
                print(f"error: cannot write {STATUS_FILE}: {again}", file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        """One warning: a line in running_log.txt and an entry in status.json (deduplicated)."""
        self.log(f"WARNING: {message}")
        warnings = self.status.setdefault("warnings", [])
        if message not in warnings:
            warnings.append(message)
            self.update_status()

    # -- logs --------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        """A human-readable line, to running_log.txt and stdout (which the launcher also captures). A line
        that cannot be written to the file (disk full) still goes to stdout."""
        if not self.writer:
            return
        line = f"[{datetime.now().strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        try:
            self._log.write(line + "\n")
            self._log.flush()
        except OSError:
            pass

    def log_traceback(self) -> None:
        """The exception being handled, with its traceback, to running_log.txt only: the terminal (and the
        UI's process log) get the one-line reason the caller logs next. Printed only when the file cannot
        take it (a full disk), so it is never lost."""
        if not self.writer:
            return
        text = "".join(f"[{datetime.now().strftime('%H:%M:%S')}] {line}\n"
                       for line in traceback.format_exc().rstrip().splitlines())
        try:
            self._log.write(text)
            self._log.flush()
        except (OSError, AttributeError):
            print(text, end="", file=sys.stderr, flush=True)

    def fail(self, exc: BaseException) -> int:
        """A command ends on `exc`: its one-line reason (the type named unless it is bad input, a ValueError, or a
        missing file) in the log and the status, the traceback in the log unless it is a ValueError; exit code 1."""
        message = str(exc) if isinstance(exc, (ValueError, FileNotFoundError)) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ValueError):
            self.log_traceback()
        self.log(f"FAILED: {message}")
        self.finish("failed", 1, error=message)
        self.close()
        return 1

    def end(self, stop_reason: str | None = None, **extra: Any) -> int:
        """A command's normal end, the status final and the log closed: "aborted" (exit code 130) when a stop
        (`stop_reason`) cut it short, else "completed" (0)."""
        if stop_reason:
            self.finish("aborted", 130, stop_reason=stop_reason, **extra)
            self.close()
            return 130
        self.finish("completed", 0, **extra)
        self.close()
        return 0

    def append_metrics(self, record: dict) -> None:
        if not self.writer:
            return
        row = {key: record.get(key) for key in TRAINER_LOG_KEYS}
        row.update({k: v for k, v in record.items() if k not in row})
        with open(self.path / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    @property
    def stop_requested(self) -> bool:
        return self.writer and (self.path / STOP_FILE).exists()

    def close(self) -> None:
        if self._log is None:
            return
        try:
            self._log.close()
        except OSError:  # the last buffered line could not be written (disk full)
            pass
