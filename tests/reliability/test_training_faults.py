"""Real `tuneboard train` runs on a tiny model under faults (issue 9, items 5, 6 and 7):

- one spec and seed give one run: two runs log the same losses and grad norms, step for step (the LoRA
  weights used to be drawn before any seed was set);
- a run stopped with the STOP file at step 3 and resumed gives the same steps as the run never stopped, and the
  same summary (mean train loss over all its steps, not the resumed ones alone; its time counts both processes),
  and the resume does not stop again at once on the STOP file the abort left behind;
- a run killed with SIGKILL mid-training is marked failed by the launcher, with the signal and the step;
- a run whose checkpoint save hits a full disk ends `failed` naming the checkpoint, leaves no .tmp file,
  and a resume refuses the half-written checkpoint instead of loading it.

Exact steps come from tests/reliability/train_with_hooks.py (the real CLI plus a step hook), not from
timing."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from backend.core.paths import REPO_ROOT
from backend.core.rundir import is_complete_checkpoint, read_status
from waiting import wait_for
from webui import jobs, live
from webui.tabs import runs

pytestmark = pytest.mark.slow
HOOKS = str(Path(__file__).with_name("train_with_hooks.py"))


def tiny_args(model: Path, out: Path, *extra: str) -> list[str]:
    args = [f"model_name_or_path={model}", f"output_dir={out}", "dataset=identity", "template=llama3",
            "cutoff_len=64", "per_device_train_batch_size=2", "gradient_accumulation_steps=1", "logging_steps=1",
            "learning_rate=0.01", "lora_rank=4", "lora_dropout=0.1", "max_steps=6", "save_steps=100",
            "plot_loss=false", *extra]
    return list({a.split("=", 1)[0]: a for a in args}.values())  # an extra key=value replaces the default


def train(*args: str, hooks: dict | None = None, preexec_fn=None) -> subprocess.CompletedProcess:
    argv = [sys.executable, HOOKS] if hooks else [sys.executable, "-m", "backend.cli", "train"]
    proc = subprocess.run(argv + list(args), cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(hooks or {})}, preexec_fn=preexec_fn)
    return proc


def steps(out: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in rows]


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


def test_same_spec_same_run_and_a_stopped_run_resumes_into_the_same_run(tiny_llama, tmp_path):
    first, second, stopped = tmp_path / "first", tmp_path / "second", tmp_path / "stopped"
    for out in (first, second):
        proc = train(*tiny_args(tiny_llama, out))
        assert proc.returncode == 0, output(proc)
    assert [s[0] for s in steps(first)] == [1, 2, 3, 4, 5, 6]
    assert steps(first) == steps(second)  # losses, grad norms and learning rates, exactly

    # the same spec stopped by the STOP file at step 3 (as Abort does), then resumed by the plain CLI
    proc = train(*tiny_args(tiny_llama, stopped), hooks={"TUNEBOARD_TEST_STOP_AT": "3"})
    assert proc.returncode == 130, output(proc)
    assert read_status(stopped)["state"] == "aborted" and read_status(stopped)["step"] == 3
    assert (stopped / "STOP").exists() and (stopped / "checkpoint-3" / "trainer_state.json").is_file()
    before = read_status(stopped)
    proc = train(*tiny_args(tiny_llama, stopped, "resume_from_checkpoint=true"))
    assert proc.returncode == 0, output(proc)  # it used to abort again at once on the old STOP file
    assert read_status(stopped)["state"] == "completed" and not (stopped / "STOP").exists()
    assert steps(stopped) == steps(first)  # step for step the run that was never stopped
    assert "removed the STOP file left by an earlier stop" in (stopped / "running_log.txt").read_text()

    # its summary is the whole run's, as the never-stopped run's: the Trainer's own train_loss after a resume was the
    # mean of steps 4-6 alone
    resumed, whole = read_status(stopped), read_status(first)
    assert resumed["resumed_at"] == [3] and whole["resumed_at"] == []
    for key in ("train_loss", "final_loss", "smoothed_loss", "min_loss", "global_step", "num_input_tokens_seen", "epoch"):
        assert resumed["final_metrics"][key] == pytest.approx(whole["final_metrics"][key], rel=1e-6), key
    # its time counts the stopped process too, from its first start (the Runs table's duration and started)
    took = [(datetime.fromisoformat(st["finished_at"]) - datetime.fromisoformat(st["started_at"])).total_seconds()
            for st in (before, resumed)]
    assert resumed["run_started_at"] == before["started_at"] and resumed["earlier_s"] == took[0]
    row = next(r for r in runs.run_rows(tmp_path) if r["name"] == "stopped")
    assert row["duration"] == live.fmt_duration(sum(took))
    assert row["started"] == datetime.fromisoformat(before["started_at"]).astimezone().strftime("%Y-%m-%d %H:%M")
    # the Trainer's timings cover the resumed steps alone: the summary says so
    assert "| train_runtime (steps 4-6 only: resumed at step 3) |" in live.final_metrics_md(resumed)


def test_a_run_continued_past_its_end_trains_its_next_step_on_the_longer_schedule(tiny_llama, tmp_path):
    """The Runs tab's "Continue N more steps" resumes a finished run with a larger max_steps: its first new step
    trained at the checkpoint's last rate (0.0 for a cosine decay: a wasted step, then a jump up); it trains at
    the longer schedule's rate there, as every later step already did."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    run = tmp_path / "continued"
    proc = train(*tiny_args(tiny_llama, run, "max_steps=2", "save_steps=2"))
    assert proc.returncode == 0, output(proc)
    proc = train(*tiny_args(tiny_llama, run, "max_steps=4", "save_steps=2", "resume_from_checkpoint=true"))
    assert proc.returncode == 0, output(proc)

    def planned(total: int) -> list[float]:  # the rate of each step of a cosine schedule over `total` steps
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
        schedule, rates = get_cosine_schedule_with_warmup(optimizer, 0, total), []
        for _ in range(total):
            rates.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
        return rates

    assert [s[3] for s in steps(run)] == pytest.approx(planned(2) + planned(4)[2:])
    assert "with a longer schedule than the checkpoint's: step 3 trains at" in (run / "running_log.txt").read_text()


def test_a_run_killed_with_sigkill_is_marked_failed_with_the_signal_and_step(tiny_llama, tmp_path):
    run = tmp_path / "killed"
    spec = jobs.write_spec_yaml(run, "\n".join(a.replace("=", ": ", 1) for a in tiny_args(tiny_llama, run)) + "\n")
    pid = jobs.launch(run, [sys.executable, HOOKS, str(spec)], env={"TUNEBOARD_TEST_PAUSE_AT": "2"})
    wait_for(lambda: (run / "paused-at-2").exists(), timeout=600, what="training paused at step 2")
    assert read_status(run)["state"] == "running"
    os.killpg(pid, signal.SIGKILL)  # what the kernel's OOM killer does: no handler runs
    wait_for(lambda: read_status(run).get("state") != "running", timeout=60, what="the watcher's final status")
    status = read_status(run)
    assert status["state"] == "failed" and status["exit_code"] == -9
    assert status["error"] == "killed by signal 9 (SIGKILL, out of memory?) at step 2 of 6"
    assert jobs.run_state(run).state == "failed"
    assert "FAILED: killed by signal 9" in (run / "running_log.txt").read_text()
    assert not [p for p in psutil.process_iter() if _in_group(p, pid)]  # nothing of the run left


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


def _small_disk():
    """In the child: every file write past 1 MiB fails (EFBIG), as a full disk fails one with ENOSPC. The
    checkpoint's tokenizer.json (about 2 MiB) hits it; the logs and status stay far below."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def _tmpfs_works() -> bool:
    """A private mount namespace (root, or an unprivileged user namespace) where a tmpfs can be mounted."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || mount -t tmpfs -o size=64k tmpfs /tmp"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def train_on_a_small_disk(args: list[str], run: Path, size: str) -> subprocess.CompletedProcess:
    """`tuneboard train` with output_dir on a real `size` tmpfs (ENOSPC when it fills up), mounted in a private
    mount namespace; the run dir is copied to `run` when the process ends. Without a namespace to mount in,
    the process's file size limit stands in for the full disk (EFBIG)."""
    if not _tmpfs_works():
        return train(*args, f"output_dir={run}", preexec_fn=_small_disk)
    mount = run.parent / f"{run.name}-mnt"
    mount.mkdir()
    script = ('mount -t tmpfs -o size="$1" tmpfs "$2" || exit 99; dir="$2/run"; copy="$3"; shift 3; '
              '"$@" "output_dir=$dir"; rc=$?; cp -a "$dir" "$copy"; exit $rc')
    argv = ["unshare", "--mount", "--map-root-user", "--propagation", "private", "sh", "-c", script, "sh",
            size, str(mount), str(run), sys.executable, "-m", "backend.cli", "train", *args]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)


def test_a_checkpoint_save_that_hits_a_full_disk_fails_the_run_and_leaves_no_checkpoint(tiny_llama, tmp_path):
    run = tmp_path / "full"
    args = [a for a in tiny_args(tiny_llama, run, "max_steps=4", "save_steps=2") if not a.startswith("output_dir=")]
    proc = train_on_a_small_disk(args, run, "1m")  # the logs fit; checkpoint-2's tokenizer.json (2 MiB) does not
    assert proc.returncode == 1, output(proc)
    status = read_status(run)
    assert status["state"] == "failed" and status["step"] == 2
    why = "no space left on device" if _tmpfs_works() else "file too large for this file system or process limit"
    assert status["error"].startswith(f"{why} while saving checkpoint-2 ("), status["error"]
    assert "Traceback" not in status["error"]
    # complete or absent: no checkpoint-2, no staging folder, no .tmp file
    assert not (run / "checkpoint-2").exists()
    assert not [p.name for p in run.iterdir() if p.name.startswith(".saving-") or p.name.endswith(".tmp")]
    assert f"FAILED: {why} while saving checkpoint-2" in (run / "running_log.txt").read_text()

    # a resume has nothing to continue: validate says so before anything starts, and the failed run stays as it was
    proc = train(*tiny_args(tiny_llama, run, "max_steps=4", "save_steps=2", "resume_from_checkpoint=true"))
    assert proc.returncode != 0
    assert f"resume_from_checkpoint: no complete checkpoint-N folder in {run}" in output(proc)
    assert "Traceback" not in output(proc) and read_status(run) == status


def test_a_save_killed_midway_leaves_no_checkpoint_and_a_resume_uses_the_last_complete_one(tiny_llama, tmp_path):
    """SIGKILL while checkpoint-4 is being written (paused inside the save, after the weights): the folder
    is a hidden staging folder, never checkpoint-4; the resume takes checkpoint-2 and removes the leftover;
    save_total_limit rotates the renamed checkpoints."""
    run = tmp_path / "killed-saving"
    spec = jobs.write_spec_yaml(run, "\n".join(a.replace("=", ": ", 1)
                                                for a in tiny_args(tiny_llama, run, "save_steps=2")) + "\n")
    pid = jobs.launch(run, [sys.executable, HOOKS, str(spec)], env={"TUNEBOARD_TEST_PAUSE_IN_SAVE": "4"})
    wait_for(lambda: (run / "paused-saving-4").exists() or read_status(run).get("state") not in (None, "running"),
             timeout=600, what="paused inside the save of checkpoint-4")
    assert (run / "paused-saving-4").exists(), read_status(run)
    staged = run / ".saving-4" / "checkpoint-4"
    assert staged.is_dir() and any(staged.glob("adapter_model.safetensors"))
    assert (run / "checkpoint-2" / "trainer_state.json").is_file() and not (run / "checkpoint-4").exists()
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: read_status(run).get("state") != "running", timeout=60, what="the watcher's final status")
    assert read_status(run)["state"] == "failed"
    (run / "paused-saving-4").unlink()

    proc = train(str(spec), "resume_from_checkpoint=true", "save_total_limit=2")
    assert proc.returncode == 0, output(proc)
    log = (run / "running_log.txt").read_text()
    assert "removed .saving-4, an unfinished checkpoint save of an earlier process" in log
    assert f"resuming from {run / 'checkpoint-2'}" in log
    assert not (run / ".saving-4").exists() and (run / "checkpoint-4" / "trainer_state.json").is_file()
    # save_total_limit still rotates the renamed folders: checkpoint-2 went when checkpoint-6 came
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert read_status(run)["state"] == "completed" and [s[0] for s in steps(run)] == [1, 2, 3, 4, 5, 6]


def test_a_zero3_run_that_fills_its_disk_fails_naming_the_full_disk_and_leaves_no_process(tiny_llama, tmp_path):
    """The same full disk under DeepSpeed ZeRO-3 with 2 processes (full fine-tuning: checkpoint-2's sharded optimizer
    states, tens of MB, do not fit the 30 MB tmpfs; the logs do): failed, naming the full disk and the rank it hit,
    no traceback in the status, and no rank left running."""
    run = tmp_path / "full-zero3"
    args = [a for a in tiny_args(tiny_llama, run, "max_steps=3", "save_steps=2", "per_device_train_batch_size=1",
                                 "finetuning_type=full", "learning_rate=1e-4", "nproc_per_node=2",
                                 "deepspeed=examples/deepspeed/ds_z3_config.json")
            if not a.startswith("output_dir=")]
    if not _tmpfs_works():
        pytest.skip("no tmpfs can be mounted here (unshare --mount as root); the file size limit stand-in of the "
                    "one-process test does not reach a launcher's workers the same way")
    before = {p.pid for p in psutil.process_iter()}
    proc = train_on_a_small_disk(args, run, "30m")
    assert proc.returncode == 1, output(proc)
    status = read_status(run)
    assert status["state"] == "failed", status
    assert "no space left on device" in status["error"] or "disk full" in status["error"], status["error"]
    assert "rank " in status["error"] and "Traceback" not in status["error"], status["error"]
    assert all(is_complete_checkpoint(c) for c in run.glob("checkpoint-*"))  # complete or absent, never half
    left = [p for p in psutil.process_iter() if p.pid not in before and _of_run(p, run)]
    assert not left, left


def _of_run(proc: psutil.Process, run: Path) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and any(str(run.name) in a for a in proc.cmdline())
    except psutil.Error:
        return False
