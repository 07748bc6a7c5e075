"""More than one training process: DDP, DeepSpeed ZeRO and FSDP, launched with torch's own launcher.

`tuneboard train` is the launcher. When a spec asks for more than one process (nproc_per_node x nnodes > 1),
or for an engine that needs a process group even on one device (deepspeed, FSDP), the `tuneboard train`
process (the training child of the supervising parent, backend/core/supervise.py) prepares the run directory, writes
status.json with the parent's pid (the launched process, whose group the UI stops) and its own as train_pid, and starts
the workers with torch's elastic agent (what `python -m torch.distributed.run` runs, called in-process so
that a worker's failure comes back as data: which rank, which exit code or signal, its error message).
Each worker is `python -m backend.cli train <same args> output_dir=<resolved>` with RANK/WORLD_SIZE/... set;
the environment variable TUNEBOARD_LAUNCHER_PID tells it that it is a worker.

The run-directory contract does not change with the process count: global rank 0 writes status.json,
trainer_log.jsonl, running_log.txt, the plot and the saved model; the STOP file is read by rank 0 and the
decision is all-reduced so every rank stops after the same step (backend.training.callbacks). DeepSpeed ZeRO
checkpoints are the one exception: every rank saves its own optimizer partition into checkpoint-N/.

This top half is light (standard library + yaml): spec.py (validate) and the web UI import it.
"""
from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from backend.core import paths
from backend.core.supervise import die_with_parent
import yaml
import time
from backend.core.rundir import end_reason, FINAL_STATES, read_status
import logging

LAUNCHER_ENV = "TUNEBOARD_LAUNCHER_PID"   # set for the workers: "you are rank N of a launched run"
DEEPSPEED_DIR = paths.EXAMPLES_DIR / "deepspeed"
ACCELERATE_DIR = paths.EXAMPLES_DIR / "accelerate"
CPU_FSDP_REASON = ("FSDP through the transformers Trainer does not run on a CPU (FSDP1 stops with 'no available "
                   "devices'; FSDP2 silently trains as plain DDP): it needs GPUs. On this machine use deepspeed "
                   "with examples/deepspeed/ds_z3_config.json for sharded training")


# ------------------------------------------------------------------------------------------- devices

@functools.lru_cache(maxsize=1)
def _nvidia_gpus() -> int:
    proc_dir = Path("/proc/driver/nvidia/gpus")
    if proc_dir.is_dir():
        return sum(1 for _ in proc_dir.iterdir())
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            return 0
    return 0


def list_gpus() -> list[str]:
    """The machine's NVIDIA GPUs as `nvidia-smi -L` lists them ("GPU 0: <name> (UUID: ...)"), whatever
    CUDA_VISIBLE_DEVICES says (it is what the UI's device picker offers); [] without nvidia-smi. No torch."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]


def visible_accelerators() -> int:
    """GPUs this process may use, without importing torch: CUDA_VISIBLE_DEVICES when it is set (an empty
    value or -1 hides them all), else the GPUs the NVIDIA driver lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if not ids or ids[0].startswith("-1"):
            return 0
        return min(len(ids), _nvidia_gpus()) if _nvidia_gpus() else 0
    return _nvidia_gpus()


def nproc(spec) -> int:
    """Processes on this node: nproc_per_node, where auto = every visible GPU, or 1 on a CPU-only machine."""
    value = spec.nproc_per_node
    if value == "auto":
        return max(1, visible_accelerators())
    return int(value)


def world_size(spec) -> int:
    return nproc(spec) * spec.nnodes


def uses_fsdp(spec) -> bool:
    return bool(spec.accelerate_config) or bool(spec.passthrough.get("fsdp"))


def needs_launcher(spec) -> bool:
    """Whether training runs in launched worker processes: more than one of them, or an engine that needs
    a process group even alone (DeepSpeed, FSDP)."""
    return world_size(spec) > 1 or bool(spec.deepspeed) or uses_fsdp(spec)


def is_worker() -> bool:
    return bool(os.environ.get(LAUNCHER_ENV)) and "RANK" in os.environ


def rank() -> int:
    """This process's global rank (0 when not launched)."""
    return int(os.environ.get("RANK", "0")) if is_worker() else 0


DEFAULT_MULTINODE_PORT = 29500  # torchrun's default: every node must know it without asking node 0


def rendezvous_port(spec) -> int:
    """master_port; unset: a free port on one machine, torchrun's 29500 across machines (the other nodes
    cannot learn a port node 0 picked at random)."""
    if spec.master_port:
        return int(spec.master_port)
    return free_port() if spec.nnodes == 1 else DEFAULT_MULTINODE_PORT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- config files

def resolve_config(value: str | None) -> Path | None:
    """A config path as written: absolute; else from the current directory if it exists there; else from the
    repository root (so `deepspeed=examples/deepspeed/ds_z3_config.json` works from any folder)."""
    if not value:
        return None
    p = Path(str(value)).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    return (paths.REPO_ROOT / p).resolve()


def shipped_deepspeed_configs() -> list[str]:
    return sorted(f"examples/deepspeed/{p.name}" for p in DEEPSPEED_DIR.glob("*.json"))


def shipped_accelerate_configs() -> list[str]:
    return sorted(f"examples/accelerate/{p.name}" for p in ACCELERATE_DIR.glob("*.yaml"))


def read_deepspeed_config(value) -> dict:
    """The DeepSpeed JSON as a dict; ValueError says what is wrong with it."""
    path = resolve_config(value)
    if path is None or not path.is_file():
        raise ValueError(f"DeepSpeed config not found: {value} (shipped: {', '.join(shipped_deepspeed_configs())})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: the top level must be a JSON object")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict) or zero.get("stage", 0) not in (0, 1, 2, 3):
        raise ValueError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3")
    return config


def zero_stage(spec) -> int | None:
    """The ZeRO stage of the spec's DeepSpeed config (None without one, or when it cannot be read)."""
    return config_zero_stage(spec.deepspeed)


def config_zero_stage(value) -> int | None:
    """The ZeRO stage of a `deepspeed:` value as typed in a spec or the form (None when empty or unreadable)."""
    if not value:
        return None
    try:
        return int(read_deepspeed_config(value).get("zero_optimization", {}).get("stage", 0))
    except (ValueError, TypeError):
        return None


def read_accelerate_config(value) -> dict:
    """An accelerate config YAML (FSDP) as a dict; ValueError says what is wrong with it."""

    path = resolve_config(value)
    if path is None or not path.is_file():
        raise ValueError(f"accelerate config not found: {value} (shipped: {', '.join(shipped_accelerate_configs())})")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    if config.get("distributed_type") != "FSDP":
        raise ValueError(f"{path}: distributed_type is {config.get('distributed_type')!r}; TuneBoard takes FSDP "
                         "configs here (DDP: set nproc_per_node; DeepSpeed: set deepspeed to its JSON config)")
    fsdp = config.get("fsdp_config")
    if not isinstance(fsdp, dict) or not fsdp:
        raise ValueError(f"{path}: fsdp_config must be a mapping of fsdp_* settings")
    version = int(fsdp.get("fsdp_version", 1))
    if version not in (1, 2):
        raise ValueError(f"{path}: fsdp_version must be 1 or 2 (got {version})")
    if version == 1 and fsdp.get("fsdp_sharding_strategy") not in (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                                                    "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        raise ValueError(f"{path}: unknown fsdp_sharding_strategy {fsdp.get('fsdp_sharding_strategy')!r}")
    return config


def fsdp_training_arguments(config: dict) -> dict:
    """An accelerate FSDP config as TrainingArguments keys (fsdp + fsdp_config), the way transformers builds
    its FSDP plugin (it strips the fsdp_ prefixes; `version` picks FSDP1 or FSDP2)."""
    fsdp = dict(config["fsdp_config"])
    version = int(fsdp.pop("fsdp_version", 1))
    words = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
             "HYBRID_SHARD": "hybrid_shard", "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2"}
    mode = [words.get(fsdp.pop("fsdp_sharding_strategy", "FULL_SHARD"), "full_shard")] if version == 1 else ["full_shard"]
    if fsdp.get("fsdp_offload_params"):
        mode.append("offload")
    if fsdp.get("fsdp_auto_wrap_policy"):
        mode.append("auto_wrap")
    out = {k.removeprefix("fsdp_"): v for k, v in fsdp.items()}
    out["version"] = version
    return {"fsdp": " ".join(mode), "fsdp_config": out}


def distributed_errors(spec, check_files: bool = True) -> list[tuple[str, str, frozenset]]:
    """Validate rules of the distributed keys (backend.core.spec calls this), as (field, message, involved)."""
    errors: list[tuple[str, str, frozenset]] = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field,) + involved)))

    refused = "not supported"
    if spec.node_rank >= spec.nnodes:
        err("node_rank", f"must be below nnodes ({spec.nnodes}): node ranks are 0 .. nnodes-1", "nnodes")
    if spec.nnodes > 1 and not spec.master_addr:
        err("master_addr", "a multi-node run needs node 0's address that every node can reach", "nnodes")
    gpus = visible_accelerators()
    if spec.nproc_per_node != "auto" and gpus and int(spec.nproc_per_node) > gpus:
        err("nproc_per_node", f"{spec.nproc_per_node} processes but {gpus} GPU(s) visible here "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): one process per GPU")
    if needs_launcher(spec) and spec.do_predict:
        err("do_predict", f"{refused}: predictions are generated by one process from whole weights; a "
            f"{describe(spec)} run saves the model, then `tuneboard eval` with the trained run predicts",
            "nproc_per_node", "nnodes", "deepspeed", "accelerate_config")
    if spec.deepspeed and uses_fsdp(spec):
        err("deepspeed", "DeepSpeed and FSDP are two ways to shard one run: choose one", "accelerate_config")
    if spec.deepspeed and check_files:
        try:
            config = read_deepspeed_config(spec.deepspeed)
        except ValueError as exc:
            err("deepspeed", str(exc))
        else:
            nvme = [k for k in ("offload_optimizer", "offload_param")
                    if (config.get("zero_optimization", {}).get(k) or {}).get("device") == "nvme"]
            if nvme:
                err("deepspeed", f"{refused}: NVMe offload ({', '.join(nvme)}) needs DeepSpeed's async-io op, which "
                    "TuneBoard installs without (DS_BUILD_OPS=0): offload to device cpu instead")
    if uses_fsdp(spec):
        field = "accelerate_config" if spec.accelerate_config else "fsdp"
        if not gpus:
            err(field, f"{refused}: {CPU_FSDP_REASON}")
        elif spec.accelerate_config and check_files:
            try:
                config = read_accelerate_config(spec.accelerate_config)
            except ValueError as exc:
                err(field, str(exc))
            else:
                errors.extend(_accelerate_consistency(spec, config))
    return errors


def _accelerate_consistency(spec, config: dict) -> list[tuple[str, str, frozenset]]:
    """The accelerate config's process layout and precision agree with the spec (the spec decides both)."""
    out = []
    involved = frozenset({"accelerate_config", "nproc_per_node", "nnodes"})
    procs = config.get("num_processes")
    if isinstance(procs, int) and procs != world_size(spec):
        out.append(("accelerate_config", f"num_processes {procs} in the config but the spec asks for "
                    f"{world_size(spec)} (nproc_per_node x nnodes): make them agree", involved))
    machines = config.get("num_machines")
    if isinstance(machines, int) and machines != spec.nnodes:
        out.append(("accelerate_config", f"num_machines {machines} in the config but nnodes is {spec.nnodes}", involved))
    precision = str(config.get("mixed_precision", "no"))
    wanted = "bf16" if spec.bf16 else "fp16" if spec.fp16 else "no"
    if precision != wanted:
        out.append(("accelerate_config", f"mixed_precision {precision} in the config but the spec trains with "
                    f"{wanted} (bf16 / fp16 keys): make them agree", frozenset({"accelerate_config", "bf16", "fp16"})))
    return out


# ------------------------------------------------------------------------------------------- commands

def node_argv(args: list[str], spec, node: int, port: int) -> list[str]:
    """`tuneboard train` for one node of a multi-node run: the same spec and overrides, with that node's rank
    and the rendezvous address fixed."""
    fixed = ("node_rank", "master_addr", "master_port", "nnodes")
    keep = [a for a in args if a.split("=", 1)[0].removeprefix("--") not in fixed]
    if not spec.output_dir:  # the default folder name has a time stamp: every node must use the same one
        keep.append(f"output_dir={spec.default_output_dir()}")
    return ["tuneboard", "train", *keep, f"nnodes={spec.nnodes}", f"node_rank={node}",
            f"master_addr={spec.master_addr or '127.0.0.1'}", f"master_port={port}"]


def launch_commands(args: list[str], spec) -> list[str]:
    """One shell line per node (node 0 first), to start over ssh or a scheduler."""
    port = rendezvous_port(spec)
    return [shlex.join(node_argv(args, spec, node, port)) for node in range(spec.nnodes)]


def describe(spec) -> str:
    """The distribution of a run in words, for the log."""
    parts = [f"world size {world_size(spec)} ({nproc(spec)} process(es) per node x {spec.nnodes} node(s))"]
    if spec.deepspeed:
        stage = zero_stage(spec)
        parts.append(f"DeepSpeed ZeRO-{stage} ({spec.deepspeed})")
    elif uses_fsdp(spec):
        parts.append(f"FSDP ({spec.accelerate_config or spec.passthrough.get('fsdp')})")
    elif world_size(spec) > 1:
        parts.append("DDP")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------- workers

def become_worker() -> None:
    """In a worker, first thing: die with the launcher (a SIGKILLed launcher must leave no worker behind;
    the elastic agent starts each worker in its own session, out of reach of a kill of the launcher's group)."""
    if sys.platform.startswith("linux"):
        die_with_parent()
        launcher = os.environ.get(LAUNCHER_ENV, "")
        if launcher.isdigit() and os.getppid() != int(launcher) and os.getppid() == 1:
            os._exit(1)  # the launcher died before prctl took effect


def record_worker_failure(message: str) -> None:
    """Hand a worker's failure reason to the launcher (the elastic agent reads this file into the failure)."""
    target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not target:
        return

    try:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps({"message": message[:2000], "timestamp": int(time.time())}))
    except OSError:
        pass


def worker_exit(code: int) -> None:
    """End a worker: flush, then os._exit. A plain interpreter exit after a gloo process group aborted
    ('terminate called without an active exception', SIGABRT) in 13-27% of 2-process runs here (the
    process group's threads torn down during interpreter finalisation); skipping finalisation gave 0 in 50."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# ------------------------------------------------------------------------------------------- the launcher

def _failure_text(rank_id: int, failure, status: dict) -> str:
    """Which rank died and why, in words, with where the run was (backend.core.rundir.end_reason's wording)."""

    who = f"rank {rank_id} (local rank {failure.local_rank}, pid {failure.pid})"
    if failure.exitcode < 0:
        why = end_reason(failure.exitcode, status.get("step"), status.get("total_steps"))
        return f"{who} was {why}"
    message = failure.message if failure.error_file != "<N/A>" else ""
    where = end_reason(failure.exitcode, status.get("step"), status.get("total_steps")).split(" without")[0]
    return f"{who} failed: {message or where}"


# The reasons a worker gives (backend.training.train.failure_message) when a write failed: the disk is the cause
# then, and a peer's error in the same second (a shared checkpoint folder half written) is its consequence.
WRITE_FAILURES = ("no space left on device", "file too large", "could not write a file")


def root_failures(failures: dict) -> list[tuple[int, object]]:
    """The failures that started it: a rank whose write failed (disk full) when there is one; else a rank killed
    by a signal (its peers then fail on a closed connection); else the earliest (the timestamps are whole seconds:
    ties go to the lower rank)."""
    full = sorted((r, f) for r, f in failures.items()
                  if f.exitcode > 0 and f.error_file != "<N/A>" and str(f.message).startswith(WRITE_FAILURES))
    if full:
        return full[:1]
    killed = sorted((r, f) for r, f in failures.items() if f.exitcode < 0)
    if killed:
        return killed
    first = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    return [first]


def run_launcher(spec, args: list[str], run_dir) -> int:
    """Start this node's workers with torch's elastic agent and wait; write the final status the workers
    could not (a rank killed, a crash at exit). run_dir: the RunDir on node 0, None on the other nodes.
    Returns the exit code of `tuneboard train` (0 completed, 130 aborted, 1 failed)."""

    from torch.distributed.elastic.multiprocessing.api import SignalException  # heavy: loaded on use, so importing this module stays light
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # heavy: loaded on use, so importing this module stays light
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # heavy: loaded on use, so importing this module stays light


    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    n = nproc(spec)
    port = rendezvous_port(spec)
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=n, run_id="tuneboard",
        rdzv_backend="static", rdzv_endpoint=f"{spec.master_addr or '127.0.0.1'}:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": 900}, max_restarts=0, monitor_interval=0.1,
        start_method="spawn", shutdown_timeout=60,
    )
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    # OMP_NUM_THREADS is left as it is: for CPU workers accelerate sets 1 thread each when it sets up the process
    # group (after the data is tokenized).
    worker_args = paths.tuneboard_argv("train", *args, f"output_dir={spec.output_dir}", unbuffered=True)[1:]  # minus the python
    say = run_dir.log if run_dir is not None else (lambda line: print(line, flush=True))
    say(f"launching {n} worker process(es) on node {spec.node_rank} of {spec.nnodes} (torch elastic agent, "
        f"rendezvous {spec.master_addr or '127.0.0.1'}:{port})")
    failure, signalled = None, None
    try:
        elastic_launch(config, sys.executable)(*worker_args)
    except ChildFailedError as exc:
        failure = exc.failures
    except SignalException as exc:
        signalled = exc.sigval.name
    if run_dir is None:  # another node: node 0's launcher keeps the status
        if failure:
            for r, f in root_failures(failure):
                print(f"error: {_failure_text(r, f, {})}", flush=True)
        return 1 if failure else (130 if signalled else 0)
    run_dir.status = read_status(run_dir.path) or run_dir.status
    status = run_dir.status
    state = status.get("state")
    if failure:
        text = "; ".join(_failure_text(r, f, status) for r, f in root_failures(failure))
        if state in ("completed", "aborted"):  # the run was saved; a rank failed on its way out
            run_dir.warn(f"after the run ended: {text}")
            return 0 if state == "completed" else 130
        error = f"{text}; the other ranks were stopped"
        run_dir.log(f"FAILED: {error}")
        run_dir.finish("failed", 1, error=error)
        return 1
    if signalled and state not in FINAL_STATES:
        reason = f"stopped by {signalled} before rank 0 wrote its final status"
        run_dir.log(f"ABORTED: {reason}")
        run_dir.finish("aborted", 130, error=reason)
        return 130
    if state not in FINAL_STATES:
        error = "every worker exited without rank 0 writing a final status"
        run_dir.finish("failed", 1, error=error)
        return 1
    return {"completed": 0, "aborted": 130}.get(state, 1)
