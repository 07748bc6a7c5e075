"""Trainer callback that turns training into run-directory files, and the graceful-stop switch.

Stopping is flag-only: SIGINT/SIGTERM handlers and the STOP file only set a flag; the callback turns
it into `should_training_stop` + `should_save` at the next step, so the run ends with a checkpoint and
status `aborted` instead of dying mid-write.

A run whose training loss or gradient norm becomes NaN/inf stops at that step with TrainingDiverged (the run
ends `failed`, with the step, the values and what to try), before anything saves the broken weights: no checkpoint
after it, no final model. The HF Trainer itself trains on (logging_nan_inf_filter only hides such a loss from the
log), and a loss is logged only every logging_steps, so every optimizer step is looked at (NonFiniteWatch).
"""
from __future__ import annotations

import math
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from transformers import TrainerCallback

from backend.core.rundir import PHASE_SAVING, PHASE_TRAINING, RunDir, checkpoint_step, checkpoints, is_complete_checkpoint
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


class TrainingDiverged(RuntimeError):
    """The training loss or gradient norm became NaN/inf; str() is the one line for status.json and the log."""


class NonFiniteWatch:
    """The gradient norm and loss of every optimizer step, checked for NaN/inf.

    The gradient norm decides: the norm of the gradients the trainable parameters hold before the optimizer step,
    every micro-batch of a gradient accumulation in it. A NaN/inf loss makes it NaN/inf, whichever stage computed
    the loss (the TRL trainers of dpo, kto, rm, grpo, ppo compute theirs outside the model), and it is what the
    optimizer would write into the weights. The loss is what the model's training forward returns (a forward hook
    adds up a step's micro-batches; sft, pt, and the log-probability forwards of the preference stages): said in
    the message, and the decider where there is no gradient norm: fp16 (the loss scaler's overflowing steps have
    inf gradients and are skipped by design) and DeepSpeed (it keeps the gradients outside the parameters; the
    logged values are checked too: RunDirCallback.on_log).

    Recording never waits for the device: the values stay tensors until `first_bad()` reads them all at once."""

    def __init__(self, skip_gradients: bool = False):
        self.skip_gradients = skip_gradients
        self._losses: list[torch.Tensor] = []  # the micro-batch losses of the optimizer step under way
        self._pending: list[tuple[int, bool, bool, torch.Tensor]] = []  # (step, has loss, has norm, [loss, norm])
        self._hook = None

    def attach(self, model) -> None:
        self._hook = model.register_forward_hook(self._record_loss)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _record_loss(self, module, inputs, output) -> None:  # noqa: ARG002 - forward hook signature
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation, generation, a reference pass
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().float().reshape(()))

    def record_step(self, step: int, model) -> None:
        """Optimizer step `step`, before the optimizer changes the weights: its summed micro-batch losses (NaN/inf
        when any is) and its gradient norm, kept as tensors."""
        losses, self._losses = self._losses, []
        norm = None if self.skip_gradients else _grad_norm(model)
        if not losses and norm is None:
            return
        device = norm.device if norm is not None else losses[0].device
        nothing = torch.zeros((), device=device)
        loss = torch.stack([x.to(device) for x in losses]).sum() if losses else nothing
        self._pending.append((step, bool(losses), norm is not None, torch.stack([loss, nothing if norm is None else norm])))

    @property
    def on_cpu(self) -> bool:
        """Whether the values recorded are CPU tensors: reading them costs nothing, so they are read every step."""
        return bool(self._pending) and self._pending[-1][3].device.type == "cpu"

    def first_bad(self) -> tuple[int, float | None, float | None] | None:
        """(step, loss, grad_norm) of the first recorded step whose gradient norm (without one, whose loss) is
        NaN/inf (None for what was not measured), or None. Reads (one transfer from the device) and forgets them."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        device = pending[0][3].device
        values = torch.stack([v.to(device) for *_, v in pending]).tolist()
        for (step, has_loss, has_norm, _), (loss, norm) in zip(pending, values):
            if not math.isfinite(norm if has_norm else loss):
                return step, (loss if has_loss else None), (norm if has_norm else None)
        return None


def _grad_norm(model) -> torch.Tensor | None:
    """The 2-norm of the gradients the parameters hold on this process (a sharded parameter's local part), or
    None where they hold none (DeepSpeed keeps its own)."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP's DTensors: this rank's shard
    if not grads:
        return None
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6: fused, one kernel per device
    if total_norm is not None:
        return total_norm(grads).float()
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(device)
                                                 for g in grads]))


def diverged_message(args, state, out: Path, first: int, at: int, loss: float | None = None,
                     grad_norm: float | None = None) -> str:
    """The one line of a diverged run: where (steps `first` to `at` when only a logged average showed it), the
    values (none: another rank saw them), what to try, and the last good checkpoint: the newest saved at step
    `first` - 2 or before (the one saved the step before holds the weights that gave the NaN/inf)."""
    where = f"step {at}" if first == at else f"steps {first}-{at}"
    values = ", ".join(f"{name} {value:.4g}" for name, value in (("loss", loss), ("grad_norm", grad_norm))
                       if value is not None) or "NaN/inf on another rank"
    clip = (f"a lower max_grad_norm (now {args.max_grad_norm:g})" if args.max_grad_norm and args.max_grad_norm > 0
            else "max_grad_norm: 1.0 to clip the gradients")
    tips = f"a lower learning_rate (now {args.learning_rate:g}), check the data for broken rows, or {clip}"
    if args.fp16:
        tips += ", or bf16 instead of fp16"
    done = [c for c in checkpoints(out) if is_complete_checkpoint(c) and checkpoint_step(c) < first]
    good = [c for c in done if checkpoint_step(c) <= first - 2]
    kept = f"Last good checkpoint: {good[-1]}" if good else "No good checkpoint was saved before it"
    if done and done[-1] not in good:
        kept += f" ({done[-1].name}, saved the step before, holds the weights that gave it)"
    return (f"training diverged at {where} of {state.max_steps}: {values}. Nothing was saved from there on (no "
            f"checkpoint, no final weights). Try {tips}. {kept}")


def schedule_from_resume(step: int, optimizer, scheduler, log=print) -> None:
    """A resumed run's first step at the learning rate its schedule gives there. The checkpoint's optimizer holds the
    rate of its last step, right for a plain resume, but a run continued past its end (the Runs tab's "Continue N
    more steps": resume with a larger max_steps) stretches the schedule over the new total, and its first step trained
    at the old schedule's last rate (0.0 for a cosine or linear decay: a wasted step, then a jump). A schedule of
    lambdas (every transformers schedule but reduce_lr_on_plateau) is evaluated at its restored position; a plain
    resume finds the same rate and changes nothing."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if optimizer is None or not lambdas or len(lambdas) != len(optimizer.param_groups):
        return
    rates = [base * lam(scheduler.last_epoch) for base, lam in zip(scheduler.base_lrs, lambdas)]
    held = [group["lr"] for group in optimizer.param_groups]
    if all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(rates, held)):
        return
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = list(rates)
    log(f"resumed at step {step} with a longer schedule than the checkpoint's: step {step + 1} trains at the new "
        f"schedule's learning rate, {rates[0]:.3g} (the checkpoint held {held[0]:.3g}, its old schedule's last)")


class RunDirCallback(TrainerCallback):
    """Writes trainer_log.jsonl (one line per logging step), status.json progress and log lines; stops the run
    (TrainingDiverged) at the first NaN/inf loss or gradient norm, before anything is saved after it."""

    def __init__(self, run_dir: RunDir, stop: StopSwitch, metric_keys: tuple[str, ...] = ()):
        self.run_dir = run_dir
        self.metric_keys = metric_keys  # the stage's own metrics (rewards/*, kl, ...), from backend/stages
        self.stop = stop
        self.stop_reason: str | None = None
        self._t0 = None
        self._tokens0 = 0
        self._step0 = 0
        self._logged_step = 0  # the step of the last training loss logged
        self.watch: NonFiniteWatch | None = None

    def _declared(self, key: str) -> bool:
        """A key the stage declares (a `rewards/*` pattern covers rewards/<name>/mean, ...)."""
        return any(matches(key, pattern) for pattern in self.metric_keys)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step > 0:
            schedule_from_resume(state.global_step, optimizer, lr_scheduler, self.run_dir.log)
        self._t0 = time.time()
        self._tokens0 = state.num_input_tokens_seen or 0
        self._step0 = self._logged_step = state.global_step
        self.watch = NonFiniteWatch(skip_gradients=bool(args.fp16))
        if model is not None:
            self.watch.attach(model)
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

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.watch is not None and model is not None:
            self.watch.record_step(state.global_step + 1, model)

    def on_step_end(self, args, state, control, **kwargs):
        self.run_dir.update_status(step=state.global_step, total_steps=state.max_steps)
        local = self.stop.reason if not self.stop_reason else None
        # NaN/inf: looked at every step where that costs no wait for a device (a CPU, or a run of several
        # processes, whose agreement below waits anyway), else before anything reads or writes the weights'
        # results (DefaultFlowCallback, which runs first, has set this step's log / eval / save)
        due = (control.should_log or control.should_evaluate or control.should_save or control.should_training_stop
               or local or state.global_step >= state.max_steps or _distributed())
        bad = self.watch.first_bad() if self.watch is not None and (due or self.watch.on_cpu) else None
        stop_anywhere, bad_anywhere = _on_any_rank(bool(local), bad is not None)
        if bad_anywhere:
            step, loss, grad_norm = bad or (state.global_step, None, None)
            self._diverge(args, state, step, step, loss, grad_norm)
        reason = local or ("stop requested on another rank" if stop_anywhere and not self.stop_reason else None)
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

    def on_epoch_end(self, args, state, control, **kwargs):
        self._look(args, state)  # before the epoch's log / eval / save (save_strategy: epoch)

    def on_train_end(self, args, state, control, **kwargs):
        self._look(args, state)  # before the final save
        if self.watch is not None:
            self.watch.detach()
        self.run_dir.set_phase(PHASE_SAVING)  # the final save (and the loss plot) come next

    def _look(self, args, state) -> None:
        """The steps a GPU run recorded since its last look (every rank of a run of several processes has looked
        at each step already, so none is left here that another rank would not find too)."""
        bad = self.watch.first_bad() if self.watch is not None else None
        if bad:
            self._diverge(args, state, bad[0], bad[0], bad[1], bad[2])

    def _diverge(self, args, state, first: int, at: int, loss=None, grad_norm=None):
        """End the run here: TrainingDiverged out of the Trainer, before its save of this step and the stage's
        final save (train.py writes the run `failed` with the message)."""
        if self.watch is not None:
            self.watch.detach()
        raise TrainingDiverged(diverged_message(args, state, self.run_dir.path, first, at, loss, grad_norm))

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if not any(k in logs for k in ("loss", "eval_loss")):
            return  # the final train summary is reported by the stage, not as a step
        if "loss" in logs:  # the trainer's own loss over the logging steps, and where the watch sees no gradients
            loss, grad_norm = logs.get("loss"), None if args.fp16 else logs.get("grad_norm")
            if any(isinstance(v, float) and not math.isfinite(v) for v in (loss, grad_norm)):
                self._diverge(args, state, self._logged_step + 1, state.global_step, loss, grad_norm)
            self._logged_step = state.global_step
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
    (anywhere,) = _on_any_rank(bool(reason))
    if anywhere and not reason:
        return "stop requested on another rank"
    return reason


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _on_any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag, true when it is true on any rank (one all-reduce, max); alone, the flags as they are."""
    if not _distributed():
        return flags
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in values.tolist())


def _memory_mb() -> float | None:
    try:
        if torch.cuda.is_available():
            return round(torch.cuda.max_memory_allocated() / 2**20, 1)

        return round(psutil.Process().memory_info().rss / 2**20, 1)
    except Exception:  # memory is informative only
        return None
