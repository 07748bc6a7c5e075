"""Trainer callback that turns training into run-directory files, and the graceful-stop switch.

Stopping is flag-only: SIGINT/SIGTERM handlers and the STOP file only set a flag; the callback turns
it into `should_training_stop` + `should_save` at the next step, so the run ends with a checkpoint and
status `aborted` instead of dying mid-write.
"""
from __future__ import annotations

import math
import signal
import time
from pathlib import Path

from transformers import TrainerCallback

from backend.core.rundir import PHASE_SAVING, PHASE_TRAINING, RunDir
from backend.stages import matches
import os
import torch
import torch.distributed as dist
import psutil


class StopSwitch:
    """Set by SIGINT/SIGTERM or a STOP file in the run dir."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self.signalled: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.signalled = signal.Signals(signum).name

    @property
    def reason(self) -> str | None:
        if self.signalled:
            return f"received {self.signalled}"
        if self.run_dir.stop_requested:
            return "STOP file found"
        return None


def start_run(out: Path) -> tuple[RunDir, StopSwitch]:
    """A command's run folder (tuneboard eval, its benchmarks and checkpoints, distill) made and started (log,
    status), with SIGINT, SIGTERM and a STOP file wired to the returned switch."""
    out.mkdir(parents=True, exist_ok=True)
    run_dir = RunDir(out)
    run_dir.start()
    switch = StopSwitch(run_dir)
    switch.install()
    return run_dir, switch


def _clean(value):
    """JSON-safe float: NaN/inf become None, everything else is kept (zeros included)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDirCallback(TrainerCallback):
    """Writes trainer_log.jsonl (one line per logging step), status.json progress and log lines."""

    def __init__(self, run_dir: RunDir, stop: StopSwitch, metric_keys: tuple[str, ...] = ()):
        self.run_dir = run_dir
        self.metric_keys = metric_keys  # the stage's own metrics (rewards/*, kl, ...), from backend/stages
        self.stop = stop
        self.stop_reason: str | None = None
        self._t0 = None
        self._tokens0 = 0
        self._step0 = 0

    def _declared(self, key: str) -> bool:
        """A key the stage declares (a `rewards/*` pattern covers rewards/<name>/mean, ...)."""
        return any(matches(key, pattern) for pattern in self.metric_keys)

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.time()
        self._tokens0 = state.num_input_tokens_seen or 0
        self._step0 = state.global_step
        # the first step is in progress from here (the phase the UI shows until the first loss is logged)
        self.run_dir.set_phase(PHASE_TRAINING, total_steps=state.max_steps, step=state.global_step)
        world = getattr(args, "world_size", 1)
        # a stream (streaming: true) has no length: the Trainer passes over it as often as max_steps needs
        epochs = (f"{args.num_train_epochs:g} epochs max" if (state.num_train_epochs or 0) < 2 ** 31
                  else "passes over the stream as max_steps needs")
        self.run_dir.log(f"training: {state.max_steps} steps, {epochs}, world size {world}"
                         + (f" ({args.per_device_train_batch_size} rows per device x {world} processes x "
                            f"{args.gradient_accumulation_steps} accumulation = "
                            f"{args.per_device_train_batch_size * world * args.gradient_accumulation_steps} "
                            "rows per step; tokens/s counts every rank)" if world > 1 else ""))

    def on_step_end(self, args, state, control, **kwargs):
        self.run_dir.update_status(step=state.global_step, total_steps=state.max_steps)
        reason = agreed_stop(self.stop.reason) if not self.stop_reason else None
        if reason and not self.stop_reason:
            self.stop_reason = reason
            self.run_dir.log(f"stop requested ({reason}): saving and stopping after step {state.global_step}")
            if not self.run_dir.writer:  # the other ranks say it once on stdout (the launcher's process log)

                print(f"rank {os.environ.get('RANK')}: stopping after step {state.global_step} ({reason})", flush=True)
            control.should_save = True
            control.should_training_stop = True
        if control.should_training_stop or state.global_step >= state.max_steps:
            control.should_log = True  # the last step is always on the curve, whatever logging_steps says
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.run_dir.set_phase(PHASE_SAVING)  # the final save (and the loss plot) come next

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if not any(k in logs for k in ("loss", "eval_loss")):
            return  # the final train summary is reported by the stage, not as a step
        elapsed = time.time() - (self._t0 or time.time())
        steps_done = max(state.global_step - self._step0, 0)
        tokens = (state.num_input_tokens_seen or 0) - self._tokens0
        remaining = max(state.max_steps - state.global_step, 0)
        record = {
            "step": state.global_step,
            "total_steps": state.max_steps,
            "epoch": _clean(round(state.epoch or 0.0, 4)),
            "loss": _clean(logs.get("loss")),
            "eval_loss": _clean(logs.get("eval_loss")),
            "lr": _clean(logs.get("learning_rate")),
            "grad_norm": _clean(logs.get("grad_norm")),
            "tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 and tokens else None,
            "elapsed_s": round(elapsed, 2),
            "eta_s": round(elapsed / steps_done * remaining, 2) if steps_done else None,
            "memory_mb": _memory_mb(),
        }
        record.update({k: _clean(v) for k, v in logs.items() if self._declared(k)})
        self.run_dir.append_metrics(record)
        self.run_dir.update_status(step=state.global_step, total_steps=state.max_steps)
        parts = [f"step {state.global_step}/{state.max_steps}"]
        shown = ("loss", "eval_loss", "lr", "grad_norm")
        parts += [f"{k}={v:.4g}" for k, v in record.items()
                  if (k in shown or self._declared(k)) and isinstance(v, (int, float))]
        if record["tokens_per_s"]:
            parts.append(f"{record['tokens_per_s']:.0f} tok/s")
        self.run_dir.log("  ".join(parts))


def agreed_stop(reason: str | None) -> str | None:
    """In a run of several processes, every rank stops after the same step: rank 0 reads the STOP file, any
    rank may have caught a signal, and one all-reduce (max) per step makes the decision everyone's. Alone,
    the local reason as it is."""

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return reason
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if reason else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not reason:
        return "stop requested on another rank"
    return reason


def _memory_mb() -> float | None:
    try:
        if torch.cuda.is_available():
            return round(torch.cuda.max_memory_allocated() / 2**20, 1)

        return round(psutil.Process().memory_info().rss / 2**20, 1)
    except Exception:  # memory is informative only
        return None
