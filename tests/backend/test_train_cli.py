"""End to end through the real CLI in a subprocess: `tuneboard train` on tiny models and on the
bundled default model. These are the slow tier: each trains for a few real optimizer steps."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.core.curves import smooth
from backend.training.models import cpu_bf16_supported

pytestmark = pytest.mark.slow
TUNEBOARD = [sys.executable, "-m", "backend.cli"]
REPO = Path(__file__).resolve().parents[2]


def train(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(TUNEBOARD + ["train", *overrides], cwd="/tmp", capture_output=True, text=True, timeout=timeout)


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def log_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "trainer_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tiny_args(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model_name_or_path={model}", f"output_dir={out}", "dataset=identity", "cutoff_len=128",
        "per_device_train_batch_size=2", "gradient_accumulation_steps=1", "logging_steps=1",
        "learning_rate=0.01", "max_steps=6", "save_steps=3", *extra,
    ]


def test_lora_sft_on_tiny_llama(tiny_llama, tmp_path):
    out = tmp_path / "run"
    proc = train(*tiny_args(tiny_llama, out, "template=llama3", "lora_rank=4"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    st = status(out)
    assert st["state"] == "completed" and st["exit_code"] == 0 and st["step"] == 6
    # the phases the trainer wrote into status.json as it went (what the progress card shows), in order
    assert list(st["phase_started"]) == ["loading", "training", "saving"] and st["phase"] == "saving"
    assert sorted(st["phase_started"].values()) == list(st["phase_started"].values())
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in rows)
    assert all(r["total_steps"] == 6 for r in rows)
    assert (out / "run_spec.yaml").exists() and (out / "running_log.txt").read_text()
    # the training process ran with jemalloc/tcmalloc preloaded when one is installed (backend/training/allocator.py)
    from backend.training import allocator

    first = next((name for name in allocator.LIBRARIES if allocator.find(name)), "glibc")
    assert f"memory allocator: {first}" in (out / "running_log.txt").read_text()
    assert "gradient checkpointing: selective" in (out / "running_log.txt").read_text()  # a tiny model: it fits
    # third-party warnings (transformers' on the tokenizer's pad token) are in the run's debug log, not in what the
    # user reads (the process output, running_log.txt)
    from backend.core.rundir import DEBUG_LOG

    user_text = proc.stdout + proc.stderr + (out / "running_log.txt").read_text()
    assert "FutureWarning" not in user_text and "UserWarning" not in user_text, user_text[-3000:]
    assert "transformers.trainer_utils WARNING" not in user_text
    assert "transformers.trainer_utils WARNING" in (out / DEBUG_LOG).read_text()
    assert (out / "checkpoint-3").is_dir() and (out / "checkpoint-6").is_dir()
    assert (out / "training_loss.png").stat().st_size > 1000
    # the adapter was saved and trained: LoRA B matrices start at zero, so any non-zero B moved
    from safetensors.torch import load_file

    weights = load_file(out / "adapter_model.safetensors")
    b_mats = [v for k, v in weights.items() if "lora_B" in k]
    assert b_mats and all(float(v.abs().max()) > 0 for v in b_mats)


@pytest.mark.parametrize("method", ["full", "freeze"])
def test_full_and_freeze_change_weights(method, tiny_qwen2, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / method
    extra = ["finetuning_type=" + method, "max_steps=3", "save_steps=100"]
    if method == "freeze":
        extra.append("freeze_trainable_layers=1")
    proc = train(*tiny_args(tiny_qwen2, out, *extra))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert status(out)["state"] == "completed"
    before, after = load_file(Path(tiny_qwen2) / "model.safetensors"), load_file(out / "model.safetensors")
    changed = {k for k in before if k in after and not (before[k] == after[k]).all()}
    if method == "full":
        assert any("layers.0." in k for k in changed) and any("layers.1." in k for k in changed)
    else:  # only the last decoder layer trains
        assert changed and all("layers.1." in k for k in changed), sorted(changed)


def test_qlora_4bit_on_tiny_mistral(tiny_mistral, tmp_path):
    out = tmp_path / "qlora"
    proc = train(*tiny_args(tiny_mistral, out, "quantization_bit=4", "max_steps=2", "template=mistral"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert status(out)["state"] == "completed"
    assert len(log_rows(out)) == 2


def test_pretraining_stage(tiny_llama, tmp_path):
    out = tmp_path / "pt"
    proc = train(*tiny_args(tiny_llama, out, "stage=pt", "dataset=c4_demo", "max_steps=2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert status(out)["state"] == "completed"


def test_a_stage_missing_its_input_is_refused_before_launch(tiny_llama, tmp_path):
    out = tmp_path / "ppo"
    proc = train(*tiny_args(tiny_llama, out, "stage=ppo"))
    assert proc.returncode == 1
    assert "reward_model: stage ppo needs a reward" in proc.stderr
    assert not out.exists()  # refused by validation: no run directory, nothing launched


def test_unavailable_accelerations_warn_and_continue(tiny_llama, tmp_path):
    out = tmp_path / "accel"
    proc = train(*tiny_args(tiny_llama, out, "flash_attn=fa2", "enable_liger_kernel=true", "bf16=true", "max_steps=1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    st = status(out)
    assert st["state"] == "completed"
    text = " ".join(st["warnings"])
    bf16_here = cpu_bf16_supported()  # a CPU with native bf16 matmul trains in bf16: no fallback warning
    for word in ("fa2", "iger") + (() if bf16_here else ("bf16",)):
        assert word in text, st["warnings"]
    log = (out / "running_log.txt").read_text()
    assert sum("WARNING" in line and "bf16" in line for line in log.splitlines()) == (0 if bf16_here else 1)
    assert ("dtype torch.bfloat16" in log) is bf16_here


def test_refuses_to_overwrite_a_finished_run(tiny_llama, tmp_path):
    out = tmp_path / "once"
    assert train(*tiny_args(tiny_llama, out, "max_steps=1")).returncode == 0
    first = (out / "trainer_log.jsonl").read_text()
    proc = train(*tiny_args(tiny_llama, out, "max_steps=1"))
    assert proc.returncode == 1 and "already holds a run" in proc.stdout + proc.stderr
    assert (out / "trainer_log.jsonl").read_text() == first  # nothing lost


def test_stop_file_aborts_with_a_checkpoint_then_resume(tiny_llama, tmp_path):
    out = tmp_path / "abort"
    args = tiny_args(tiny_llama, out, "max_steps=400", "save_steps=1000")
    proc = subprocess.Popen(TUNEBOARD + ["train", *args], cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while len(log_rows(out)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    (out / "STOP").touch()
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, output[-3000:]
    st = status(out)
    assert st["state"] == "aborted"
    stopped_at = st["step"]
    assert 3 <= stopped_at < 400
    assert (out / f"checkpoint-{stopped_at}").is_dir()

    (out / "STOP").unlink()
    proc = train(*tiny_args(tiny_llama, out, f"max_steps={stopped_at + 2}", "resume_from_checkpoint=true"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [r["step"] for r in log_rows(out)]
    assert steps == list(range(1, stopped_at + 3))  # continued, no duplicate steps
    assert status(out)["state"] == "completed"


def test_sigterm_aborts_gracefully(tiny_llama, tmp_path):
    out = tmp_path / "sigterm"
    proc = subprocess.Popen(TUNEBOARD + ["train", *tiny_args(tiny_llama, out, "max_steps=400", "save_steps=1000")],
                            cwd="/tmp", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while len(log_rows(out)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=300) == 130
    assert status(out)["state"] == "aborted"
    assert list(out.glob("checkpoint-*"))


def test_default_model_loss_goes_down(identity_adapter):
    """The real SmolLM2-135M-Instruct (bundled GGUF) learns the identity set: in the `make demo` run
    (examples/sft_lora_identity.yaml, 30 steps, a loss logged every 5), trained once per session for the slow
    tests, the last logged loss is clearly below the first."""
    losses = [r["loss"] for r in log_rows(identity_adapter) if r.get("loss") is not None]
    assert len(losses) == 6
    assert losses[-1] < 0.7 * losses[0], losses


def test_eval_during_training_and_predictions(tiny_llama, tmp_path):
    out = tmp_path / "eval"
    proc = train(*tiny_args(tiny_llama, out, "template=llama3", "max_steps=2", "val_size=4", "eval_strategy=steps",
                            "eval_steps=1", "do_predict=true", "max_new_tokens=4"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = log_rows(out)
    assert [r["step"] for r in rows if r["eval_loss"] is not None] == [1, 2]
    assert all(r["loss"] is not None for r in rows if r["eval_loss"] is None)
    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 4 and all({"prompt", "label", "predict"} <= set(p) for p in predictions)
    held = status(out)["final_metrics"]
    assert "eval_loss" in held
    losses = [r["loss"] for r in rows if r["loss"] is not None]  # issue 24: three loss numbers, one definition
    assert held["final_loss"] == losses[-1] and held["min_loss"] == min(losses)
    assert held["smoothed_loss"] == pytest.approx(smooth(losses)[-1])


def test_reference_guide_recipe_trains_here(tmp_path):
    """The guide's train_qwen_qlora.yaml with only model_name_or_path and dataset changed
    (examples/sft_qlora_extraction.yaml), cut to one step on 16 rows for test time: QLoRA 4-bit NF4 with
    double quantization on this CPU, packing, and one warning each for fa2, Liger and (on a CPU without native
    bf16 matmul) bf16."""
    out = tmp_path / "guide"
    proc = train(str(REPO / "examples" / "sft_qlora_extraction.yaml"), f"output_dir={out}",
                 "max_samples=16", "max_steps=1", timeout=900)  # logging_steps stays 10
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    st = status(out)
    assert st["state"] == "completed" and st["step"] == 1
    warnings = " ".join(st["warnings"])
    assert "fa2" in warnings and "iger" in warnings and ("bf16" in warnings) is not cpu_bf16_supported()
    log = (out / "running_log.txt").read_text()
    assert "bitsandbytes 4-bit nf4" in log and "packed into" in log
    assert log_rows(out)[0]["loss"] > 0


def test_last_step_is_logged_whatever_logging_steps_says(tiny_llama, tmp_path):
    out = tmp_path / "lastlog"
    proc = train(*tiny_args(tiny_llama, out, "max_steps=3", "logging_steps=10"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in log_rows(out)] == [3]
    assert status(out)["step"] == 3


def test_early_stopping_ends_the_run_when_eval_loss_stops_improving(tiny_llama, tmp_path):
    """learning_rate 1e-12 leaves a LoRA model's outputs bit-identical, so eval_loss never improves after
    the first evaluation: with patience 2 the run ends after step 3 of 20, says why, and is complete."""
    out = tmp_path / "early"
    proc = train(*tiny_args(tiny_llama, out, "template=llama3", "max_steps=20", "val_size=4", "eval_strategy=steps",
                            "eval_steps=1", "save_steps=1", "load_best_model_at_end=true",
                            "early_stopping_patience=2", "learning_rate=1e-12"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    st = status(out)
    assert st["state"] == "completed" and st["step"] == 3, st
    evals = [r["eval_loss"] for r in log_rows(out) if r["eval_loss"] is not None]
    assert len(evals) == 3 and len(set(evals)) == 1, evals
    assert "early stopping" in (out / "running_log.txt").read_text()


def test_a_data_error_is_one_line_in_the_terminal_and_its_traceback_in_the_run_log(tiny_llama, tmp_path):
    """Issue 24: an empty data file (or columns naming missing fields) printed a 20-line traceback before the
    one-line reason; the traceback belongs in running_log.txt only."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({
        "empty": {"file_name": "empty.json"},
        "wrong_columns": {"file_name": "rows.json", "columns": {"prompt": "question", "response": "answer"}}}))
    (data / "empty.json").write_text("")
    (data / "rows.json").write_text(json.dumps([{"instruction": "q", "output": "a"}] * 4))
    for name in ("empty", "wrong_columns"):
        out = tmp_path / name
        proc = train(*tiny_args(tiny_llama, out, "template=llama3", f"dataset={name}", f"dataset_dir={data}"))
        said = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"dataset '{name}'" in status(out)["error"], said
        assert "Traceback" not in said and f"FAILED: dataset '{name}'" in said, said
        assert "Traceback" in (out / "running_log.txt").read_text()
