"""Training jobs as operating-system processes, with all their state on disk.

A job is a run directory plus a `tuneboard train <run_dir>/run_spec.yaml` process. Nothing about a job
lives in the UI's memory: the run directory (status.json written by the backend, launch.json and
process_output.log written here at launch) and the queue folder are enough to rebuild the picture after
a page reload or a UI restart. That is what lets a run outlive the browser tab that started it.

Processes: argv lists (never a shell string), a new session (so the whole process group can be stopped),
stdout/stderr to `process_output.log` in the run dir. Abort asks politely first (a STOP file, which the
backend turns into a stop at the next step with a save), then SIGTERM, then SIGKILL of the group.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
import yaml

from backend.core import paths, rundir
from backend.core.atomic import read_json_dict, write_text_atomic
from backend.core.rundir import (CHECKPOINT_PREFIX, LAUNCH_FILE, PROCESS_LOG, SPEC_FILE, STATUS_FILE, STOP_FILE,  # noqa: F401
                            mark_ended)

QUEUE_DIRNAME = ".queue"

ACTIVE_STATES = ("starting", "pending", "running")
DIED = "failed (process died)"


# ---------------------------------------------------------------- command line

def tuneboard_argv() -> list[str]:
    """How to call the CLI: the `tuneboard` script next to this Python (the venv's), else on PATH, else
    `python -m backend.cli`."""
    here = Path(sys.executable).parent / "tuneboard"
    if here.is_file():
        return [str(here)]
    found = shutil.which("tuneboard")
    if found:
        return [found]
    return paths.tuneboard_argv()


def train_argv(spec_path: str | Path, overrides: dict | None = None) -> list[str]:
    """The exact command a run executes (also shown in the UI's Preview)."""
    argv = tuneboard_argv() + ["train", str(spec_path)]
    for key, value in (overrides or {}).items():
        argv.append(f"{key}={_cli_value(value)}")
    return argv


def _cli_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---------------------------------------------------------------- run directories

def model_slug(model: str) -> str:
    """A folder name for a model id or path: the last path component, without a .gguf suffix."""
    return rundir.model_slug(model)


def default_output_dir(model: str, finetuning_type: str, root: Path | None = None,
                       now: datetime | None = None) -> Path:
    """saves/<model>/<finetuning_type>/<timestamp>, unique (a suffix is added if the folder exists)."""
    return rundir.unique_dir(rundir.default_output_dir(model, finetuning_type, root, now, fmt="%Y-%m-%d-%H-%M-%S"))


def write_spec_yaml(run_dir: Path, spec_yaml: str) -> Path:
    """Writes run_spec.yaml (atomically) into a new run dir and returns its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / SPEC_FILE
    write_text_atomic(target, spec_yaml)
    return target


read_json = read_json_dict  # the tabs' name for it


def read_spec_dict(run_dir: Path) -> dict:
    try:
        value = yaml.safe_load((Path(run_dir) / SPEC_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, yaml.YAMLError, OSError):
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------- processes

def launch(run_dir: str | Path, argv: list[str], env: dict | None = None) -> int:
    """Starts `argv` in its own session with output to run_dir/process_output.log; records the pid in
    run_dir/launch.json so any later UI process can find, watch and stop it. Returns the pid."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_FILE).unlink(missing_ok=True)  # a resumed run must not stop at once
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env.update(env or {})
    with open(run_dir / PROCESS_LOG, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=str(paths.REPO_ROOT), env=full_env, close_fds=True)
    launched_at = time.time()
    write_text_atomic(run_dir / LAUNCH_FILE, json.dumps(
        {"pid": proc.pid, "argv": argv, "launched_at": launched_at}, indent=1))
    # Reap the child when it exits so it never lingers as a zombie (which would look alive), and write the
    # final status it could not write itself (killed by a signal, out of memory, crashed).
    threading.Thread(target=_watch, args=(run_dir, proc, launched_at), name=f"reap-{proc.pid}", daemon=True).start()
    return proc.pid


def _watch(run_dir: Path, proc: subprocess.Popen, launched_at: float) -> None:
    returncode = proc.wait()
    status = read_json(run_dir / STATUS_FILE)
    worker = status.get("pid")
    if isinstance(worker, int) and worker != proc.pid and pid_alive(worker):
        return  # the launched process was a launcher (torchrun); its worker still writes the status
    written = mark_ended(run_dir, returncode, launched_at=launched_at, detail=_last_error_line(run_dir))
    if written:
        print(f"[tuneboard] run {run_dir}: {written['state']}: {written['error']}", file=sys.stderr, flush=True)


def _last_error_line(run_dir: Path) -> str | None:
    """The last 'error: ...' line of the process output (a spec the backend refused, say), if any."""
    try:
        with open(run_dir / PROCESS_LOG, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    lines = [line.strip() for line in tail if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("error:"):
            return " ".join(lines[i:i + 4])[:500]
    return None


def pid_alive(pid, not_after: float | None = None) -> bool:
    """True if `pid` is a live (non-zombie) process. `not_after`: launch time; a process created well
    after it is a reused pid, not ours."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if not_after is not None and proc.create_time() > not_after + 5:
            return False
        return True
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


@dataclass
class RunState:
    """The effective state of a run directory: the backend's status.json corrected by what the
    operating system says about the process."""

    state: str
    pid: int | None = None
    alive: bool = False
    status: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def run_state(run_dir: str | Path) -> RunState:
    run_dir = Path(run_dir)
    status = read_json(run_dir / STATUS_FILE)
    launch_rec = read_json(run_dir / LAUNCH_FILE)
    launched_at = launch_rec.get("launched_at")
    launch_pid = launch_rec.get("pid")
    state = status.get("state")
    status_pid = status.get("pid")
    stop_requested = (run_dir / STOP_FILE).exists()

    # A launch newer than the status file is a new process (first start or a resume) still loading.
    status_mtime = _mtime(run_dir / STATUS_FILE)
    launch_is_newer = launch_pid and (status_mtime is None or _mtime(run_dir / LAUNCH_FILE) > status_mtime)
    if launch_is_newer:
        alive = pid_alive(launch_pid, launched_at)
        if alive:
            return RunState("starting", launch_pid, True, status)
        return _ended(run_dir, launch_pid, status, stop_requested, launched_at)

    if state in ("pending", "running"):
        pid = status_pid or launch_pid
        alive = pid_alive(pid, launched_at if pid == launch_pid else None)
        if alive:
            return RunState(state, pid, True, status)
        return _ended(run_dir, pid, status, stop_requested)
    if state:
        return RunState(state, status_pid or launch_pid, False, status)
    if (run_dir / PROCESS_LOG).exists():
        return RunState("failed (launch error)", None, False, status)
    return RunState("unknown", None, False, status)


def _ended(run_dir: Path, pid, status: dict, stop_requested: bool, launched_at=None) -> RunState:
    """A run whose process is gone without a final status (its launcher's watcher is not there to say
    how: a UI restart, a run started from the command line): status.json is made final here, so it never
    stays "running". The exit code is unknown; a watcher that knows it may still replace this."""
    if _zombie(pid):  # ended, not reaped yet: its parent (our watcher, with the exit code) writes the status
        return RunState("aborted" if stop_requested else DIED, pid, False, status)
    written = mark_ended(run_dir, launched_at=launched_at)
    if written:
        return RunState(written["state"], pid, False, written)
    status = read_json(run_dir / STATUS_FILE)  # it wrote its own final status after all
    return RunState(status.get("state") or ("aborted" if stop_requested else DIED), pid, False, status)


def _zombie(pid) -> bool:
    try:
        return isinstance(pid, int) and pid > 0 and psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def request_stop(run_dir: str | Path) -> None:
    """Asks the backend to stop at the next step and save (it polls for this file)."""
    (Path(run_dir) / STOP_FILE).write_text(f"stop requested at {datetime.now().isoformat()}\n")


def abort(run_dir: str | Path, term_after_s: float = 30.0, kill_after_s: float = 15.0,
          wait: bool = False) -> bool:
    """Stops a run: STOP file now; SIGTERM to its process group if it is still alive after
    `term_after_s`; SIGKILL after `kill_after_s` more. Escalation runs in a background thread unless
    `wait`. Returns False if nothing was running."""
    run_dir = Path(run_dir)
    st = run_state(run_dir)
    if not st.alive:
        return False
    request_stop(run_dir)
    launched_at = read_json(run_dir / LAUNCH_FILE).get("launched_at")
    args = (st.pid, launched_at, term_after_s, kill_after_s)
    if wait:
        _escalate(*args)
    else:
        threading.Thread(target=_escalate, args=args, name=f"abort-{st.pid}", daemon=True).start()
    return True


def _escalate(pid: int, launched_at, term_after_s: float, kill_after_s: float) -> None:
    for sig, wait_s in ((None, term_after_s), (signal.SIGTERM, kill_after_s), (signal.SIGKILL, 5.0)):
        if sig is not None:
            if not pid_alive(pid, launched_at):
                return
            try:
                os.killpg(pid, sig)  # start_new_session: pid == pgid
            except (ProcessLookupError, PermissionError):
                return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not pid_alive(pid, launched_at):
                return
            time.sleep(0.2)


# ---------------------------------------------------------------- listing runs

@dataclass
class RunInfo:
    run_dir: str
    name: str
    spec: dict
    state: RunState
    started: float | None


def iter_run_dirs(root: Path | None = None):
    """Run directories (folders holding run_spec.yaml) below `root`, newest first, without descending
    into a run dir (its checkpoints) or hidden folders."""
    root = Path(root or paths.saves_dir())
    found = []
    if not root.is_dir():
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        if SPEC_FILE in filenames:
            found.append(Path(dirpath))
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not d.startswith(CHECKPOINT_PREFIX)]
    found.sort(key=lambda p: _mtime(p / SPEC_FILE) or 0, reverse=True)
    return found


def list_runs(root: Path | None = None) -> list[RunInfo]:
    root = Path(root or paths.saves_dir())
    out = []
    for d in iter_run_dirs(root):
        try:
            name = str(d.relative_to(root))
        except ValueError:
            name = d.name
        out.append(RunInfo(str(d), name, read_spec_dict(d), run_state(d), _mtime(d / SPEC_FILE)))
    return out


def find_active_run(root: Path | None = None) -> str | None:
    """The newest run dir whose process is alive (for re-attaching after a reload or a UI restart)."""
    for d in iter_run_dirs(root):
        if run_state(d).active:
            return str(d)
    return None


# ---------------------------------------------------------------- queue

@dataclass
class QueueEntry:
    id: str
    path: str
    run_dir: str
    spec: dict
    overrides: dict = field(default_factory=dict)  # a resume / continue of an existing run dir

    @property
    def is_resume(self) -> bool:
        return bool(self.overrides)


class JobQueue:
    """A FIFO of specs waiting to run, one YAML file each in saves/.queue/ (named by enqueue time so the
    directory listing is the order). On disk, so it survives a UI restart; claimed by an atomic rename so
    two UI processes never launch the same entry. `settings.json` holds the concurrency limit."""

    def __init__(self, root: Path | None = None, command=train_argv):
        self.root = Path(root or paths.saves_dir())
        self.dir = self.root / QUEUE_DIRNAME
        self.command = command  # spec path -> argv; the real `tuneboard train` unless a test says otherwise

    # settings
    def max_concurrent(self) -> int:
        value = read_json(self.dir / "settings.json").get("max_concurrent", 1)
        return value if isinstance(value, int) and value >= 1 else 1

    def set_max_concurrent(self, n: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.dir / "settings.json", json.dumps({"max_concurrent": max(1, int(n))}))

    # entries
    def enqueue(self, spec_yaml: str, run_dir: str | Path, overrides: dict | None = None,
                env: dict | None = None) -> QueueEntry:
        """`overrides`: key=value arguments for the command (a resume: the run dir's run_spec.yaml is
        kept as it is, never rewritten). `env`: this run's own environment variables (CUDA_VISIBLE_DEVICES
        from the device picker), kept with the entry so whichever process launches it sets them."""
        self.dir.mkdir(parents=True, exist_ok=True)
        entry_id = f"{time.time_ns():020d}"
        path = self.dir / f"{entry_id}.yaml"
        payload = {"run_dir": str(run_dir), "spec_yaml": spec_yaml}
        if overrides:
            payload["overrides"] = dict(overrides)
        if env:
            payload["env"] = {str(k): str(v) for k, v in env.items()}
        write_text_atomic(path, yaml.safe_dump(payload, sort_keys=False, allow_unicode=True))
        return self._entry(path)

    def _entry(self, path: Path) -> QueueEntry:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        spec = yaml.safe_load(data.get("spec_yaml") or "") or {}
        overrides = data.get("overrides") if isinstance(data.get("overrides"), dict) else {}
        return QueueEntry(path.stem, str(path), data.get("run_dir", ""), spec if isinstance(spec, dict) else {},
                          overrides)

    def entries(self) -> list[QueueEntry]:
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.glob("*.yaml")):
            try:
                out.append(self._entry(path))
            except (OSError, yaml.YAMLError):
                continue
        return out

    def holds(self, run_dir: str | Path) -> bool:
        """Whether `run_dir` waits in the queue or is being launched from it (its entry claimed, its folder
        maybe not made yet). An entry that vanishes while it is read counts as held: the caller asks again."""
        try:
            names = [n for n in os.listdir(self.dir) if n.endswith((".yaml", ".claimed"))]
        except FileNotFoundError:
            return False
        for name in names:
            try:
                data = yaml.safe_load((self.dir / name).read_text(encoding="utf-8")) or {}
            except FileNotFoundError:
                return True
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(data, dict) and data.get("run_dir") == str(run_dir):
                return True
        return False

    def remove(self, entry_id: str) -> bool:
        try:
            (self.dir / f"{entry_id}.yaml").unlink()
            return True
        except FileNotFoundError:
            return False

    def running_count(self) -> int:
        return sum(1 for d in iter_run_dirs(self.root) if run_state(d).active)

    def pump(self, env: dict | None = None) -> list[str]:
        """Launches queued entries while fewer than max_concurrent runs are active. Returns the run dirs
        launched. Safe to call from several sessions/processes at once."""
        launched = []
        limit = self.max_concurrent()
        while self.running_count() < limit:
            entries = self.entries()
            if not entries:
                break
            head = Path(entries[0].path)
            claimed = head.with_suffix(".claimed")
            try:
                os.rename(head, claimed)
            except FileNotFoundError:
                continue  # another process took it
            run_dir = None
            try:
                data = yaml.safe_load(claimed.read_text(encoding="utf-8")) or {}
                run_dir = Path(data["run_dir"])
                overrides = data.get("overrides") or {}
                if overrides and (run_dir / SPEC_FILE).exists():  # resume: run_spec.yaml is never changed
                    spec_path = run_dir / SPEC_FILE
                else:
                    spec_path = write_spec_yaml(run_dir, data["spec_yaml"])
                argv = self.command(spec_path, overrides) if overrides else self.command(spec_path)
                launch(run_dir, argv, env={**(env or {}), **(data.get("env") or {})})
                launched.append(str(run_dir))
            except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
                # The entry is consumed either way; the reason goes where the Runs tab shows it.
                if run_dir is not None:
                    run_dir.mkdir(parents=True, exist_ok=True)
                    with open(run_dir / PROCESS_LOG, "a", encoding="utf-8") as fh:
                        fh.write(f"could not launch: {exc}\n")
                print(f"[tuneboard] queue entry {head.name}: could not launch: {exc}", file=sys.stderr)
            finally:
                claimed.unlink(missing_ok=True)
        return launched


def start_or_queue(spec_yaml: str, run_dir: str | Path, root: Path | None = None,
                   env: dict | None = None, command=train_argv, overrides: dict | None = None) -> tuple[str, str]:
    """Starts the run now if a slot is free, else queues it. Returns ("started"|"queued", run_dir).
    The queue goes first so an earlier queued spec is never overtaken. `overrides`: a resume of an
    existing run dir (see JobQueue.enqueue)."""
    q = JobQueue(root, command=command)
    entry = q.enqueue(spec_yaml, run_dir, overrides, env=env)  # the entry's own: not for the others pumped here
    launched = q.pump()
    # The UI's QueueWorker may pump between the enqueue and our pump and launch this very entry: then it
    # is gone from the queue and our pump launches nothing, but the run has started all the same.
    taken = not Path(entry.path).exists()
    return ("started" if str(run_dir) in launched or taken else "queued", str(run_dir))


class QueueWorker:
    """Background thread of the UI process that launches queued runs when slots free up, even with no
    browser open. Started by the app's main(); holds no job state of its own."""

    def __init__(self, root: Path | None = None, interval_s: float = 2.0, command=train_argv):
        self.queue = JobQueue(root, command=command)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tuneboard-queue", daemon=True)

    def start(self) -> "QueueWorker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.queue.pump()
            except Exception as exc:  # never let the worker die silently on one bad entry
                print(f"[tuneboard] queue: {exc}", file=sys.stderr)
