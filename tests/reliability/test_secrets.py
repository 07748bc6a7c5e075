"""Secrets never land in run_spec.yaml, the logs or the job records (issue 9).

A credential is never a spec key: hub_token and any *_token / *_key / *_secret / *password key is refused
by validate without echoing its value (the catalogue has those cases); credentials come from the
environment. Here a real, short `tuneboard train` on a tiny model is launched the way the web UI launches
one (webui.jobs.launch: launch.json, process_output.log) with the usual credential variables set, and every
byte of the run folder (spec, status, logs, checkpoint with training_args.bin, adapter, job record) is
searched for them."""
from __future__ import annotations

import sys

import pytest

from backend.core.rundir import read_status
from waiting import wait_for
from webui import jobs

pytestmark = pytest.mark.slow

SECRETS = {"HF_TOKEN": "hf_tok_7c1d9e", "HUGGING_FACE_HUB_TOKEN": "hf_hub_3b8a21", "WANDB_API_KEY": "wandb_55e0f4",
           "OPENAI_API_KEY": "sk-openai-9d2c77", "TUNEBOARD_API_KEY": "sk-tb-41aa08",
           "COMET_API_KEY": "comet_6f3e19"}


def test_a_real_run_keeps_no_secret_from_its_environment(tiny_llama, tmp_path):
    run = tmp_path / "run"
    spec = jobs.write_spec_yaml(run, "\n".join([
        f"model_name_or_path: {tiny_llama}", f"output_dir: {run}", "dataset: identity", "template: llama3",
        "cutoff_len: 64", "per_device_train_batch_size: 2", "gradient_accumulation_steps: 1", "logging_steps: 1",
        "lora_rank: 4", "max_steps: 2", "save_steps: 1", "plot_loss: false",
        "report_to: tensorboard,mlflow,wandb"]) + "\n")  # the trackers' files too (W&B offline: no network here)
    jobs.launch(run, [sys.executable, "-m", "backend.cli", "train", str(spec)], env={**SECRETS, "WANDB_MODE": "offline"})
    wait_for(lambda: read_status(run).get("state") in ("completed", "failed", "aborted"), timeout=600,
             what="the run's final status")
    assert read_status(run)["state"] == "completed", (run / "process_output.log").read_text()[-3000:]
    files = [p for p in run.rglob("*") if p.is_file()]
    names = {p.relative_to(run).as_posix() for p in files}
    assert {"run_spec.yaml", "status.json", "running_log.txt", "trainer_log.jsonl", "launch.json",
            "process_output.log", "checkpoint-1/training_args.bin", "adapter_model.safetensors"} <= names, names
    assert any(n.startswith("runs/") for n in names) and any(n.startswith("mlruns/") for n in names)
    assert any(n.startswith("wandb/offline-run-") for n in names), names
    for path in files:
        content = path.read_bytes()
        for variable, value in SECRETS.items():
            assert value.encode() not in content, f"{variable}'s value is in {path.relative_to(run)}"
