"""A run whose loss or gradient norm turns NaN/inf ends `failed` at that step, before it saves the broken weights.

Found by a bug hunt: a LoRA SFT run with a huge learning rate trained on into NaN weights, wrote them as its
checkpoints and final adapter and ended `completed` (logging_nan_inf_filter showed its NaN losses as 0).

The run below warms its learning rate (1e30) up from 0, so step 1 leaves the weights as they were (checkpoint-1 is
good), step 2's update breaks them (checkpoint-2 holds them) and step 3's loss is NaN. Gradient accumulation 2 and
logging_steps 10 (no loss logged before step 3): every optimizer step is looked at, not the logged average."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from backend.core.paths import REPO_ROOT
from backend.core.rundir import is_complete_checkpoint, read_status
from backend.training.callbacks import NonFiniteWatch


@pytest.mark.slow
def test_a_nan_loss_fails_the_run_at_that_step_and_keeps_the_last_good_checkpoint(tiny_llama, tmp_path):
    out = tmp_path / "diverged"
    args = [f"model_name_or_path={tiny_llama}", f"output_dir={out}", "dataset=identity", "template=llama3",
            "cutoff_len=64", "per_device_train_batch_size=2", "gradient_accumulation_steps=2", "logging_steps=10",
            "learning_rate=1e30", "warmup_steps=3", "lora_rank=4", "max_steps=6", "save_steps=1", "plot_loss=false"]
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "train", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]

    status = read_status(out)
    assert status["state"] == "failed" and status["exit_code"] == 1 and status["step"] == 3
    error = status["error"]
    assert re.match(r"training diverged at step 3 of 6: loss -?(nan|inf), grad_norm -?(nan|inf)\. ", error), error
    assert "Nothing was saved from there on" in error
    assert "lower learning_rate (now 1e+30)" in error and "check the data" in error and "max_grad_norm" in error
    assert f"Last good checkpoint: {out / 'checkpoint-1'} (checkpoint-2, saved the step before" in error
    log = (out / "running_log.txt").read_text()
    assert f"FAILED: {error}\n" in log and "Traceback" not in log

    # nothing written from step 3 on: no checkpoint-3, no final adapter; the checkpoints before it are whole and finite
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert not (out / "adapter_model.safetensors").exists()
    for name in ("checkpoint-1", "checkpoint-2"):
        assert is_complete_checkpoint(out / name)
        assert all(w.isfinite().all() for w in load_file(out / name / "adapter_model.safetensors").values())


class _Lossy(torch.nn.Module):
    """A model whose training forward returns its loss, as a causal LM given labels does; `offset` is added to the
    loss without reaching the weights."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x, offset=0.0):
        return {"loss": self.linear(x).sum() + offset}


def test_the_watch_finds_the_first_bad_step_of_those_it_has_not_read_yet():
    """What a GPU run does between two looks: steps recorded as tensors, read at once. A NaN in one micro-batch of a
    gradient accumulation is that step's; the gradient norm decides where it is measured, the loss where not."""
    model = _Lossy()

    def step(watch: NonFiniteWatch, number: int, *micro_batches: tuple[float, float]) -> None:
        model.zero_grad()
        for value, offset in micro_batches:
            model(torch.tensor([[value, 1.0]]), offset)["loss"].backward()
        watch.record_step(number, model)

    watch = NonFiniteWatch()
    watch.attach(model)
    step(watch, 1, (1.0, 0.0), (2.0, 0.0))
    step(watch, 2, (1.0, 0.0), (float("nan"), 0.0))  # the second micro-batch breaks it
    step(watch, 3, (float("inf"), 0.0))
    number, loss, grad_norm = watch.first_bad()
    assert number == 2 and math.isnan(loss) and math.isnan(grad_norm)
    assert watch.first_bad() is None  # read and forgotten
    step(watch, 4, (1.0, float("inf")))  # a loss that does not reach the weights: their gradients are finite
    assert watch.first_bad() is None
    watch.detach()

    fp16 = NonFiniteWatch(skip_gradients=True)  # the loss scaler's overflowing steps have inf gradients: the loss decides
    fp16.attach(model)
    step(fp16, 5, (1.0, 0.0))
    step(fp16, 6, (1.0, float("inf")))
    assert fp16.first_bad() == (6, float("inf"), None)
    model.eval()  # an evaluation forward between two steps is no training step's loss
    with torch.no_grad():
        model(torch.tensor([[float("nan"), 1.0]]))
    model.train()
    step(fp16, 7, (1.0, 0.0))
    assert fp16.first_bad() is None
