"""`tuneboard probe SPEC.yaml [key=value ...]`: measure, instead of guess, whether a run fits this machine.

The probe trains the exact spec for a couple of optimizer steps in a child `tuneboard train` process, with
the dataset's LONGEST rows first (the batches that need the most memory), and reports what it measured:

- peak RSS: the child's ru_maxrss (os.wait4, as bench/run.py measures it; with several processes, the
  largest one), and on CUDA torch.cuda.max_memory_allocated, written by the child;
- s/step: the duration of the child's last logged step (step 2 leaves the first step's warm-up out), times
  the spec's gradient_accumulation_steps (the probe steps one micro-batch at a time: memory does not grow
  with accumulation, time does);
- projected_total_s: s/step x the real run's number of optimizer steps (max_steps, or rows / effective batch
  x epochs, with the rows counted by the child after tokenization and packing);
- fits, and when it does not fit, what to change (smaller batch with more accumulation to keep the
  effective batch, a shorter cutoff, gradient checkpointing, QLoRA), each with the peak it should give.

The child runs in a temporary folder below the cache (paths.cache_dir()/probe/), never the user's
output_dir, saves no checkpoint, and the folder is removed at the end (also on Abort and timeout).

This module is light (no torch): the web UI launches `tuneboard probe` as a background job and reads the
JSON it writes (backend.core.rundir.PROBE_RESULT_FILE). The child's side (`instrument`, called from
backend.stages.base.fit when TUNEBOARD_PROBE is set) imports transformers lazily.

The suggestions' peaks are projections from the measurement, not further probes: the measured peak is
split into what was there when training began (model, data, runtime: `baseline`) and what training added
(activations, gradients, optimizer state: `training`); a smaller batch or cutoff scales `training` with
the tokens per micro-batch; checkpointing keeps CHECKPOINTING_KEEPS of it; QLoRA shrinks the frozen
weights to QLORA_BYTES_PER_PARAM bytes per parameter.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from backend.core.methods import method
from backend.core.atomic import read_json_dict, write_json_atomic, write_text_atomic
from backend.core.curves import step_seconds
from backend.core.rundir import PROBE_MEASURE_FILE, PROBE_RESULT_FILE, SPEC_FILE, stamp
import psutil
from backend.core.launch import world_size
from backend.core import paths
from backend.core.passthrough_rules import EVAL_LOOP_KEYS
from backend.core.spec import RunSpec, SpecError, load_spec, split_spec_args, validate_spec
import argparse

ENV = "TUNEBOARD_PROBE"  # in the child's environment: the file it writes its own measurements to
PROBE_DIRNAME = "probe"
DEFAULT_STEPS = 2
DEFAULT_TIMEOUT_S = 1800
FIT_MARGIN = 1.1  # a run fits when its measured peak x this is below the available memory
CHECKPOINTING_KEEPS = 0.3  # share of the training memory left with gradient checkpointing (see module doc)
QLORA_BYTES_PER_PARAM = 0.55  # NF4 weights + their scales (bitsandbytes, double quantization)
MIB = 2 ** 20


# ------------------------------------------------------------------ the child: longest rows first, measured

def active() -> str | None:
    """The measurements file when this process is a probe's child, else None."""
    return os.environ.get(ENV) or None


def row_length(row) -> int:
    """Tokens of a tokenized row: its input_ids, or the sum of its *_ids (a preference pair's prompt, chosen
    and rejected)."""
    if not isinstance(row, dict):
        return 0
    if isinstance(row.get("input_ids"), (list, tuple)):
        return len(row["input_ids"])
    return sum(len(v) for k, v in row.items() if k.endswith("_ids") and isinstance(v, (list, tuple)))


def longest_first(rows):
    """The rows sorted by length, longest first (stable: equal lengths keep their order)."""
    return sorted(rows, key=row_length, reverse=True)


def record_teacher(model) -> None:
    """In a probe's child: the frozen teacher's weight bytes and parameters (stage kd holds it besides the
    student), for the teacher_quantization_bit suggestion."""
    if active():
        _write_measures(teacher_weights_mib=sum(p.numel() * p.element_size() for p in model.parameters()) / MIB,
                        teacher_params=sum(p.numel() for p in model.parameters()))


def _write_measures(**fields) -> None:
    path = active()
    if not path:
        return
    data = read_json_dict(path)
    data.update(fields)
    write_json_atomic(path, data, indent=None)


class _FirstBatch:
    """Wraps a collator; writes the row lengths of the first batch it builds (the probe's proof that the
    longest rows went first)."""

    def __init__(self, collator):
        self.collator = collator
        self.seen = False

    def __call__(self, features):
        if not self.seen:
            self.seen = True
            _write_measures(first_batch_lengths=[row_length(f) for f in features])
        return self.collator(features)

    def __getattr__(self, name):  # the Trainer / TRL may look at the collator's attributes
        return getattr(self.collator, name)


def instrument(train_dataset, collator, callbacks: list):
    """In a probe's child (backend.stages.base.fit): the training rows longest first (the spec sets a
    sequential sampler), the first batch recorded, and a callback that writes what the parent cannot see
    (rows, the memory when training begins, frozen weight bytes, CUDA peak). Returns (rows, collator)."""
    from transformers import TrainerCallback  # heavy: loaded on use, so importing this module stays light

    if isinstance(train_dataset, list):
        train_dataset = longest_first(train_dataset)
    elif hasattr(train_dataset, "sort") and hasattr(train_dataset, "map"):  # a datasets.Dataset
        lengths = [row_length(r) for r in train_dataset]
        train_dataset = train_dataset.add_column("_probe_len", lengths).sort("_probe_len", reverse=True) \
            .remove_columns("_probe_len")
    if collator is not None:
        collator = _FirstBatch(collator)

    class ProbeCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
            frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad) if model else 0
            rows = len(train_dataset) if hasattr(train_dataset, "__len__") else None  # a stream (streaming) has no length
            _write_measures(rows=rows, rss_train_begin_mib=psutil.Process().memory_info().rss / MIB,
                            frozen_weights_mib=frozen / MIB,
                            params=sum(p.numel() for p in model.parameters()) if model else None)

        def on_step_end(self, args, state, control, **kwargs):
            import torch  # heavy: loaded on use, so importing this module stays light

            fields = {"steps_done": state.global_step}
            if torch.cuda.is_available():
                fields["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
                fields["cuda_total_mib"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / MIB
            _write_measures(**fields)

    callbacks.append(ProbeCallback())
    return train_dataset, collator


# ------------------------------------------------------------------ the parent: run the child, read it

PROBE_VALUES = {"gradient_accumulation_steps": 1, "logging_steps": 1, "save_strategy": "no", "plot_loss": False,
                "train_sampling_strategy": "sequential", "val_size": 0, "eval_dataset": None, "report_to": "none",
                "overwrite_output_dir": True, "resume_from_checkpoint": None}


def probe_spec(spec: RunSpec, run_dir: Path, steps: int) -> RunSpec:
    """The spec made a probe: its own folder, `steps` optimizer steps of one micro-batch each, the rows in the order
    the child sorts them, nothing saved, evaluated, predicted, judged or plotted: every key of the eval group, the
    saves' keys and the evaluation loop's passthrough keys go back to their defaults (validate refuses them in a run
    that neither saves nor evaluates)."""
    fields = RunSpec.model_fields
    flat = {k: v for k, v in spec.flat_dict().items() if k not in EVAL_LOOP_KEYS}
    for name, field in fields.items():
        if name != "passthrough" and (field.json_schema_extra or {}).get("group") == "eval":
            flat[name] = field.default
    for name in ("save_steps", "save_total_limit"):
        flat[name] = fields[name].default
    if flat.get("lr_scheduler_type") == "reduce_lr_on_plateau":  # it steps on evaluations; the rate moves no memory
        flat["lr_scheduler_type"] = "constant"
    return validate_spec({**flat, **PROBE_VALUES, "output_dir": str(run_dir), "max_steps": steps})


def total_steps(spec, rows: int | None) -> int | None:
    """Optimizer steps of the real run: max_steps, else ceil(rows per process / batch / accumulation) x epochs."""
    if spec.max_steps and spec.max_steps > 0:
        return int(spec.max_steps)
    if not rows:
        return None

    batches = math.ceil(rows / max(1, world_size(spec)) / max(1, spec.per_device_train_batch_size))
    per_epoch = max(1, math.ceil(batches / max(1, spec.gradient_accumulation_steps)))
    return max(1, math.ceil(per_epoch * float(spec.num_train_epochs or 1)))


def machine_memory() -> tuple[float, float]:
    """(total, available) RAM of this machine in MiB."""

    vm = psutil.virtual_memory()
    return vm.total / MIB, vm.available / MIB


def suggestions(spec, measured: dict, available_mib: float) -> list[dict]:
    """What to change so the run fits `available_mib`, each {"change": {key: value}, "peak_mib": projected,
    "fits": bool}, the cheapest first: checkpointing (more time), a smaller batch with more accumulation (same
    effective batch, same maths), QLoRA (frozen weights in 4 bits), a shorter cutoff (changes the data)."""
    peak = measured["peak_mib"]
    base = min(measured.get("baseline_mib") or 0.0, peak)
    training = peak - base
    out: list[dict] = []

    def add(change: dict, projected: float) -> None:
        out.append({"change": change, "peak_mib": round(projected, 1),
                    "fits": projected * FIT_MARGIN <= available_mib})

    from backend.training.models import gradient_checkpointing_on  # heavy: loaded on use, so importing this module stays light

    checkpointing = gradient_checkpointing_on(spec)
    if not checkpointing:
        add({"gradient_checkpointing": True}, base + training * CHECKPOINTING_KEEPS)
    bs, ga = spec.per_device_train_batch_size, spec.gradient_accumulation_steps
    for smaller in (bs // 2, bs // 4, 1):
        if 1 <= smaller < bs:
            projected = base + training * smaller / bs
            add({"per_device_train_batch_size": smaller, "gradient_accumulation_steps": ga * (bs // smaller)}, projected)
            if projected * FIT_MARGIN <= available_mib:
                break
    frozen = measured.get("frozen_weights_mib") or 0.0
    params = measured.get("params") or 0
    if method(spec.finetuning_type).quantized_base and not spec.quantization_bit and frozen and params:
        add({"quantization_bit": 4}, peak - frozen + params * QLORA_BYTES_PER_PARAM / MIB)
    teacher, teacher_params = measured.get("teacher_weights_mib") or 0.0, measured.get("teacher_params") or 0
    if teacher and teacher_params and not getattr(spec, "teacher_quantization_bit", None):  # stage kd's teacher
        add({"teacher_quantization_bit": 4}, peak - teacher + teacher_params * QLORA_BYTES_PER_PARAM / MIB)
    longest = max(measured.get("first_batch_lengths") or [0])
    cutoff = spec.cutoff_len
    while cutoff > 128:  # a cutoff only saves memory below the longest row
        cutoff //= 2
        if cutoff < longest:
            projected = base + training * cutoff / longest
            add({"cutoff_len": cutoff}, projected)
            if projected * FIT_MARGIN <= available_mib:
                break
    return out


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except OSError:
        pass


def run_probe(args: list[str], *, steps: int = DEFAULT_STEPS, available_mib: float | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, keep: bool = False, log=None) -> dict:
    """Probe the spec of `args` ([SPEC.yaml] [key=value ...]); returns the result dict (see the module doc).
    `available_mib`: the memory the run may use (default: what this machine has available now)."""

    log = log or (lambda line: print(line, flush=True))
    spec = load_spec(*_split(args))
    total_mib, free_mib = machine_memory()
    available = float(available_mib) if available_mib is not None else free_mib
    root = paths.cache_dir() / PROBE_DIRNAME
    _remove_stale(root)
    probe_dir = root / f"{os.getpid()}-{stamp()}"
    run_dir = probe_dir / "run"
    result = {"state": "failed", "error": None, "probe_dir": str(probe_dir), "steps": steps,
              "machine_total_mib": round(total_mib, 1), "available_mib": round(available, 1),
              "output_dir": spec.output_dir, "suggestions": []}
    try:
        child_spec = probe_spec(spec, run_dir, steps)
        run_dir.mkdir(parents=True)
        (run_dir / SPEC_FILE).write_text(child_spec.to_yaml(), encoding="utf-8")
        measures = probe_dir / PROBE_MEASURE_FILE
        env = dict(os.environ, **{ENV: str(measures)})
        argv = paths.tuneboard_argv("train", str(run_dir / SPEC_FILE))
        log(f"probe: {steps} steps of the spec, longest rows first, in {run_dir}")
        started = time.time()
        with open(probe_dir / "child_output.log", "wb") as sink:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                    cwd=str(paths.REPO_ROOT))
        stopped = []

        def on_signal(signum, frame):  # noqa: ARG001 - Abort (SIGTERM to the job's group) or Ctrl-C
            stopped.append(signum)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # wait4, not poll: poll would lose the rusage
                if pid:
                    break
                if stopped or time.time() - started > timeout_s:
                    _kill(proc)
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.2)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        code = os.waitstatus_to_exitcode(status)
        peak = usage.ru_maxrss / 1024  # KiB on Linux
        child = _read_json(measures)
        per_micro, logged = step_seconds(run_dir)
        result.update(peak_rss_mib=round(peak, 1), exit_code=code, wall_s=round(time.time() - started, 1),
                      steps_measured=logged, rows=child.get("rows"), first_batch_lengths=child.get("first_batch_lengths"),
                      baseline_mib=_round(child.get("rss_train_begin_mib")),
                      frozen_weights_mib=_round(child.get("frozen_weights_mib")), params=child.get("params"),
                      peak_vram_mib=_round(child.get("cuda_peak_mib")), vram_total_mib=_round(child.get("cuda_total_mib")))
        if per_micro is not None:
            s_per_step = per_micro * max(1, spec.gradient_accumulation_steps)
            total = total_steps(spec, child.get("rows"))
            result.update(s_per_step=round(s_per_step, 3), total_steps=total,
                          projected_total_s=round(s_per_step * total, 1) if total else None)
        if stopped:
            result.update(state="aborted", error="stopped on request")
        elif time.time() - started > timeout_s and code != 0:
            result.update(state="timeout", error=f"no step finished within {timeout_s:.0f} s (peak RSS so far "
                                                  f"{peak / 1024:.1f} GiB)")
        elif code == 0 and logged:
            result["state"] = "completed"
        elif code in (-signal.SIGKILL, 128 + signal.SIGKILL):  # tuneboard train: 128 + N
            result.update(state="killed", error=f"the probe was killed by signal 9 (out of memory?) at peak RSS "
                                                f"{peak / 1024:.1f} GiB")
        else:
            result["error"] = _last_error(probe_dir / "child_output.log") or f"the probe exited with code {code}"
        if result["state"] in ("completed", "killed"):
            vram_ok = (result["peak_vram_mib"] is None or result["vram_total_mib"] is None
                       or result["peak_vram_mib"] * FIT_MARGIN <= result["vram_total_mib"])
            result["fits"] = result["state"] == "completed" and peak * FIT_MARGIN <= available and vram_ok
            if not result["fits"]:
                target = available if vram_ok else result["vram_total_mib"]
                measured = {"peak_mib": peak if vram_ok else result["peak_vram_mib"],
                            "baseline_mib": child.get("rss_train_begin_mib") if vram_ok else 0.0,
                            "frozen_weights_mib": child.get("frozen_weights_mib"), "params": child.get("params"),
                            "first_batch_lengths": child.get("first_batch_lengths")}
                result["suggestions"] = suggestions(spec, measured, target)
    finally:
        if not keep:
            shutil.rmtree(probe_dir, ignore_errors=True)
    return result


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    return split_spec_args(list(args))


def _round(value, digits: int = 1):
    return round(value, digits) if isinstance(value, (int, float)) else None


_read_json = read_json_dict


def _last_error(path: Path) -> str | None:
    """The child's last error line ("error: ..." or "FAILED: ..."), for the result."""
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("error:") or "FAILED:" in line:
            return line[:500]
    return lines[-1][:500] if lines else None


def _remove_stale(root: Path) -> None:
    """Folders of earlier probes whose process is gone (killed before it could clean up)."""

    if not root.is_dir():
        return
    for folder in root.iterdir():
        pid = folder.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def option_problem(opts) -> str | None:
    """The one line for a probe option that cannot work, or None."""
    if opts.steps < 1:
        return f"--steps must be >= 1 (got {opts.steps})"
    if opts.available_mib is not None and not opts.available_mib > 0:
        return f"--available-mib must be > 0 (got {opts.available_mib:g})"
    if not opts.timeout > 0:
        return f"--timeout must be > 0 (got {opts.timeout:g})"
    if opts.out:
        out = Path(opts.out).expanduser()
        folder = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
        if out.is_dir():
            return f"--out {out} is a folder: give a file name for the JSON result"
        if folder is not None and not folder.is_dir():
            return f"--out {out}: {folder} is a file, not a folder"
    return None


def main(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(
        prog="tuneboard probe",
        description="Train the spec for a few steps with its longest rows first, in a temporary folder, and report the "
                    "measured peak memory, s/step, the projected time and whether it fits (JSON).")
    parser.add_argument("spec", nargs="*", help="[SPEC.yaml] [key=value ...]")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps to measure (default 2)")
    parser.add_argument("--available-mib", type=float, default=None,
                        help="memory the run may use, MiB (default: what this machine has available now)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before the probe gives up")
    parser.add_argument("--out", help=f"write the JSON result here too (the web UI reads {PROBE_RESULT_FILE})")
    parser.add_argument("--keep", action="store_true", help="keep the probe's temporary folder (debugging)")
    opts = parser.parse_intermixed_args(argv)
    problem = option_problem(opts)
    if problem:  # before the probe's minutes of training, not after them
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        result = run_probe(opts.spec, steps=opts.steps, available_mib=opts.available_mib,
                           timeout_s=opts.timeout, keep=opts.keep)
    except (SpecError, FileNotFoundError) as exc:
        print(f"error: invalid run spec: {exc}", file=sys.stderr)
        result = {"state": "failed", "error": f"invalid run spec: {exc}"}
    text = json.dumps(result, indent=1)
    if opts.out:
        write_text_atomic(opts.out, text)
    print(text)
    return 0 if result["state"] == "completed" else 1
