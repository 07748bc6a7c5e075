"""`tuneboard train`: one run, from a validated RunSpec to a finished run directory.

Everything that is the same for every stage lives here: the run directory, the status life cycle,
the stop switch, TrainingArguments, the Trainer with our logging callback, saving and the loss plot.
Each stage module (backend/stages/<stage>.py) builds its datasets, model and collator and hands
them to `fit()`.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import traceback
import warnings
from pathlib import Path

from backend.core.optim_names import uses_bitsandbytes
from backend.core.paths import DEFAULT_MODEL_ID
from backend.core.rundir import DEBUG_LOG, LOG_FILE, SPEC_FILE, RunDir, checkpoints, is_complete_checkpoint
from backend.dataprep.preprocess import tokenizing
from backend.stages import stage_module
from backend.stages.base import CheckpointSaveError, RunError
import ctypes
from backend.core import launch
from backend.training import allocator
from backend.core.launch import record_worker_failure

EXIT_OK, EXIT_FAILED, EXIT_ABORTED = 0, 1, 130
_RUN_OUTPUTS = (LOG_FILE, "adapter_model.safetensors", "model.safetensors", "trainer_state.json")


def prepare_output_dir(spec) -> Path:
    """Resolve output_dir, refuse to clobber an earlier run, and write run_spec.yaml.

    A directory that holds only run_spec.yaml (written by the web UI before launch) is fine.
    """
    out = Path(spec.output_dir or spec.default_output_dir()).resolve()
    spec.output_dir = str(out)
    has_run = out.is_dir() and (
        any((out / name).exists() for name in _RUN_OUTPUTS) or any(out.glob("checkpoint-*"))
    )
    if has_run and not (spec.overwrite_output_dir or spec.resume_from_checkpoint):
        raise RunError(
            f"output_dir {out} already holds a run: pick another output_dir, or set "
            "overwrite_output_dir: true to replace it, or resume_from_checkpoint: true to continue it"
        )
    if has_run and spec.overwrite_output_dir and not spec.resume_from_checkpoint:
        for child in out.iterdir():
            if child.name != SPEC_FILE:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / SPEC_FILE
    if not spec_path.exists():
        spec_path.write_text(spec.to_yaml(), encoding="utf-8")
    return out


# Allocations of at least this size get their own mmap from glibc and go back to the OS when freed.
HEAP_MMAP_THRESHOLD = 1 << 20


def return_freed_memory() -> int | None:
    """Make glibc malloc give big blocks back to the OS when they are freed (mallopt M_MMAP_THRESHOLD = 1 MiB);
    returns the threshold set, or None where it does not apply (not glibc, TUNEBOARD_MMAP_THRESHOLD=0).
    The fallback for a process without jemalloc/tcmalloc preloaded (backend/training/allocator.py), which are as lean
    and ~35% faster.

    Why: a training step allocates and frees thousands of activation-sized tensors (MBs each). glibc's
    default threshold is dynamic: after the first such block is freed it rises to that block's size (up to
    32 MiB), so later ones come from the heap, whose freed holes are reused badly and never returned: on the
    bench recipe the process's RSS grew ~1 GB above what its live tensors needed (peak RSS 2,449 MiB, 1,483
    with the fixed threshold, same losses: bench/README.md). A fixed threshold (which also turns the dynamic
    one off) maps each big block on its own and unmaps it on free; the price is page faults on every such
    allocation (more system time; `bench/run.py --levers glibc-heap` measures it)."""
    value = os.environ.get("TUNEBOARD_MMAP_THRESHOLD")
    threshold = HEAP_MMAP_THRESHOLD if value is None else int(value)
    if threshold <= 0 or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: no such mallopt knobs
            return None
        M_MMAP_THRESHOLD = -3
        return threshold if libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1 else None
    except (OSError, AttributeError):
        return None


def seed_everything(spec) -> None:
    """Seed Python, numpy and torch from spec.seed before anything random happens (data order, model and
    adapter initialisation), so one spec and seed give one run. The Trainer seeds again when it is built,
    but by then the adapter weights were already drawn. full_determinism also asks torch for
    deterministic kernels."""
    from transformers import enable_full_determinism, set_seed  # heavy: loaded on use, so importing this module stays light

    if spec.passthrough.get("full_determinism"):
        enable_full_determinism(spec.seed)
    else:
        set_seed(spec.seed)


_MODEL_KEYS = ("model_name_or_path", "ref_model", "teacher_model_name_or_path", "reward_model")


def _plain_model(name: str) -> bool:
    """A model that loads without bitsandbytes: the embedded default, a GGUF file, or a local folder whose
    config.json holds no quantization_config. A hub id is not read here (it may be saved quantized)."""
    folder = Path(name).expanduser()
    if name.lower() == DEFAULT_MODEL_ID.lower() or name.lower().endswith(".gguf"):
        return True
    try:
        return folder.is_dir() and "quantization_config" not in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


def leave_out_bitsandbytes(spec) -> bool:
    """Keep bitsandbytes out of a training process that does not use it. peft imports it at its own import whenever
    it is installed (~45 MiB of peak RSS in every run, its CPU kernels loaded); only 4/8-bit loading (QLoRA, a KD
    teacher, a model saved quantized), bitsandbytes' optimizers and GaLore (galore_torch imports it) use it. It is
    marked absent (None in sys.modules: importlib's find_spec then says not installed, so transformers and peft take
    their paths without it) only where every model the spec names is known to load without it. Returns whether it was
    left out; TUNEBOARD_BITSANDBYTES=1 keeps it."""
    if "bitsandbytes" in sys.modules or os.environ.get("TUNEBOARD_BITSANDBYTES") == "1":
        return False
    fields = spec.model_dump() if hasattr(spec, "model_dump") else dict(vars(spec))
    if any(value for key, value in fields.items() if key.endswith("quantization_bit")):
        return False
    if fields.get("use_galore") or uses_bitsandbytes(fields.get("optim")):
        return False
    models = [str(fields[k]) for k in _MODEL_KEYS if fields.get(k)]
    if "/" in str(fields.get("reward_funcs") or "") or not all(_plain_model(m) for m in models):
        return False
    sys.modules["bitsandbytes"] = None
    return True


def _write_failure(exc: BaseException) -> str | None:
    """'no space left on device' / 'file too large' when `exc` (or what caused it) is a failed write."""
    no_space, too_large, unwritten = launch.WRITE_FAILURES  # the launcher reads these as the root cause
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = getattr(exc, "errno", None)
        text = str(exc)
        if code in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text:
            return no_space
        if code == errno.EFBIG or "File too large" in text:
            return f"{too_large} for this file system or process limit"
        if "unexpected pos" in text or "PytorchStreamWriter failed" in text:  # torch.save on a full disk
            return f"{unwritten} (disk full?)"
        exc = exc.__cause__ or exc.__context__
    return None


def failure_message(exc: BaseException, out: Path) -> str:
    """The one-line reason a run failed, for status.json. A failed write names the checkpoint it was saving."""
    plain = isinstance(exc, (RunError, ValueError, FileNotFoundError, NotImplementedError, CheckpointSaveError))
    message = str(exc) if plain else f"{type(exc).__name__}: {exc}"
    why = _write_failure(exc)
    if isinstance(exc, CheckpointSaveError):
        return (why or "error") + f" while saving {exc.checkpoint} ({message})"
    if why:
        found = checkpoints(out)
        saving = found[-1].name if found and not is_complete_checkpoint(found[-1]) else None
        message = why + (f" while saving {saving}" if saving else "") + f" ({message})"
    return message


# The libraries whose chatter (deprecations, "this is slow", notices below ERROR) is not the user's business: it goes
# to the run's debug log. Their errors still reach stderr, i.e. the log the user reads.
LIBRARY_LOGGERS = ("transformers", "datasets", "peft", "trl", "accelerate", "huggingface_hub", "torch", "bitsandbytes")


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


class _ErrorAndUp(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def route_library_noise(run_path: Path):
    """Send third-party warnings of this training process to <run dir>/DEBUG_LOG: everything the `warnings`
    module shows (FutureWarning, UserWarning, ...) and the records below ERROR of the LIBRARY_LOGGERS, whose
    errors keep going to stderr. Returns the open debug file (line-buffered; it lives as long as the process)."""
    debug = open(Path(run_path) / DEBUG_LOG, "a", encoding="utf-8", buffering=1)

    def show(message, category, filename, lineno, file=None, line=None):
        debug.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
    to_file = logging.StreamHandler(debug)
    to_file.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s", "%H:%M:%S"))
    to_file.addFilter(_BelowError())
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if name == "transformers":  # its own stderr handler is made on first use: make it now, to filter it
            from transformers.utils import logging as hf_logging  # heavy: the training process has it anyway

            hf_logging.get_logger("transformers")
        if not logger.handlers:  # a logger that propagated to the root (no handler: Python's stderr fallback)
            to_stderr = logging.StreamHandler(sys.stderr)
            logger.addHandler(to_stderr)
        for handler in logger.handlers:
            handler.addFilter(_ErrorAndUp())
        logger.addHandler(to_file)
        logger.propagate = False
    return debug


def run(spec, args: list[str] | None = None) -> int:
    """Run a training stage; return the process exit code. Never raises. `args`: the command line the spec
    came from (SPEC.yaml key=value ...), which the workers of a launched run are started with."""

    if launch.is_worker():
        return _run_worker(spec)
    if launch.needs_launcher(spec) and spec.node_rank > 0:  # node 0 keeps the run directory
        spec.output_dir = str(Path(spec.output_dir or spec.default_output_dir()).resolve())
        Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
        return launch.run_launcher(spec, list(args or []), None)
    try:
        out = prepare_output_dir(spec)
        run_dir = RunDir(out)
        run_dir.start(continues=bool(spec.resume_from_checkpoint))  # a resume: its time counts on
    except RunError as exc:
        print(f"error: {exc}", flush=True)
        return EXIT_FAILED
    except OSError as exc:  # output_dir is a file, not writable, or the disk is full
        where = exc.filename or spec.output_dir
        print(f"error: output_dir {spec.output_dir}: cannot write {where}: {exc.strerror or exc}", flush=True)
        return EXIT_FAILED
    run_dir.update_status(world_size=launch.world_size(spec))
    if launch.needs_launcher(spec):
        run_dir.log(f"stage {spec.stage}, {spec.finetuning_type}, model {spec.model_name_or_path}, output {out}")
        run_dir.log(f"distributed: {launch.describe(spec)}")
        try:
            code = launch.run_launcher(spec, list(args or []), run_dir)
        except Exception as exc:  # the launcher itself failed (rendezvous port taken, ...)
            run_dir.log_traceback()
            run_dir.finish("failed", EXIT_FAILED, error=f"could not launch the workers: {type(exc).__name__}: {exc}")
            code = EXIT_FAILED
        run_dir.close()
        return code
    return _train(spec, run_dir, out)


def _train(spec, run_dir: RunDir, out: Path, rank: int = 0, launched: bool = False) -> int:
    """The stage, from a started run directory to its final status (rank 0 writes it; other ranks only
    train). Returns the exit code."""
    leave_out_bitsandbytes(spec)  # before anything imports peft (the callbacks import transformers' Trainer parts)
    from backend.training.callbacks import StopSwitch, TrainingDiverged  # heavy: loaded on use, so importing this module stays light

    threshold = None if allocator.loaded() else return_freed_memory()
    if rank == 0:  # before the stage's heavy imports, which warn too; rank 0 alone writes the run directory
        route_library_noise(out)
    stop = StopSwitch(run_dir)
    stop.install()
    try:
        stage = stage_module(spec.stage)
        if not launched:
            run_dir.log(f"stage {spec.stage}, {spec.finetuning_type}, model {spec.model_name_or_path}, output {out}")
        if rank == 0:
            mmap = f", mmap threshold {threshold >> 10} KiB" if threshold else ""
            run_dir.log(f"memory allocator: {allocator.describe()}{mmap}")
        seed_everything(spec)
        # preprocessing_batch_size, and the rows tokenized so far in status.json (the Train tab's tokenizing bar)
        with tokenizing(spec.preprocessing_batch_size, run_dir.tokenizing_progress):
            result = stage.run(spec, run_dir, stop)
    except Exception as exc:  # the run ends here; the status says why
        # a NaN/inf loss (the callback stopped the run before any save of the broken weights) is one line, as bad input
        diverged = isinstance(exc, TrainingDiverged)
        message = str(exc) if diverged else failure_message(exc, out)
        if rank:
            trace = "" if diverged else "\n" + traceback.format_exc().rstrip()
            print(f"rank {rank}: FAILED: {message}{trace}", file=sys.stderr, flush=True)
        if not (diverged or isinstance(exc, RunError)):
            run_dir.log_traceback()
        run_dir.log(f"FAILED: {message}")
        run_dir.finish("failed", EXIT_FAILED, error=message)
        run_dir.close()

        record_worker_failure(message)
        return EXIT_FAILED
    state, code = ("aborted", EXIT_ABORTED) if result.stopped else ("completed", EXIT_OK)
    run_dir.log(f"{state}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.metrics.items()))
    run_dir.finish(state, code, final_metrics=result.metrics)
    run_dir.close()
    return code


def _run_worker(spec) -> int:
    """One rank of a launched run (backend.core.launch): the launcher prepared the run directory and holds its
    status; global rank 0 writes, the others train silently. Ends the process (flush, os._exit): completed and
    aborted exit 0 (a non-zero exit makes the agent stop every rank), failed exits 1."""

    launch.become_worker()
    rank = launch.rank()
    out = Path(spec.output_dir)
    try:
        run_dir = RunDir(out, writer=rank == 0)
    except OSError as exc:
        launch.record_worker_failure(f"cannot open the run directory {out}: {exc}")
        launch.worker_exit(EXIT_FAILED)
    code = _train(spec, run_dir, out, rank=rank, launched=True)
    launch.worker_exit(EXIT_FAILED if code == EXIT_FAILED else EXIT_OK)
    return code  # not reached
