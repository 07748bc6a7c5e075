"""The pre-flight formula against a measured run: the guide's recipe (examples/sft_qlora_extraction.yaml, QLoRA
4-bit, 4 x 4096 packed tokens a micro-batch, plain checkpointing) ran to the end on the 2-core, 24 GiB CPU
machine on 2026-12-01 with a peak RSS of 5,120 MiB (/usr/bin/time -v; webui/preflight.py says how). The issue
asks the estimate to be within 25% of that: a change to the formula that drifts further fails here."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from backend.core.paths import DEFAULT_MODEL_ID
from webui import preflight

REPO = Path(__file__).resolve().parents[2]
GUIDE_PEAK = 5120 * 2 ** 20  # measured, see above
FREE_THEN = 22_870 * 2 ** 20  # free memory when it was measured (decides plain vs selective checkpointing)


def test_the_guide_recipe_estimate_is_within_25_percent_of_its_measured_peak(monkeypatch):
    memory = SimpleNamespace(available=FREE_THEN, total=24 * 2 ** 30)
    monkeypatch.setattr(preflight.psutil, "virtual_memory", lambda: memory)
    flat = yaml.safe_load((REPO / "examples" / "sft_qlora_extraction.yaml").read_text())
    estimate = preflight.estimate(flat)
    assert estimate["known"] and estimate["total"] == pytest.approx(GUIDE_PEAK, rel=0.25), estimate["total"] / 2 ** 20


def test_a_reward_model_in_reward_funcs_counts_its_frozen_weights(tmp_path):
    """An rm run's adapter folder in reward_funcs: its own parameters plus its base's (run_spec.yaml), from the
    safetensors headers, at 4 bytes each (no bf16); the summary names the part. No reward model: nothing added."""
    import numpy as np
    from safetensors.numpy import save_file

    base, rm = tmp_path / "base", tmp_path / "rm"
    base.mkdir(), rm.mkdir()
    save_file({"embed": np.zeros((100, 10), np.float32), "head": np.zeros((10,), np.float32)},
              str(base / "model.safetensors"))
    save_file({"score": np.zeros((1, 10), np.float32)}, str(rm / "adapter_model.safetensors"))
    (rm / "adapter_config.json").write_text('{"task_type": "SEQ_CLS"}')
    (rm / "run_spec.yaml").write_text(yaml.safe_dump({"stage": "rm", "model_name_or_path": str(base)}))
    flat = {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "stage": "rloo",
            "reward_funcs": f"json_valid,{rm}"}
    assert preflight.reward_model_bytes(flat) == (1000 + 10 + 10) * 4
    assert preflight.reward_model_bytes({**flat, "bf16": True}) == (1000 + 10 + 10) * 2
    assert preflight.estimate(flat)["reward_models"] == (1000 + 10 + 10) * 4
    assert "reward models 0.0" in preflight.summary_md(flat)
    assert preflight.reward_model_bytes({**flat, "reward_funcs": "json_valid"}) == 0


def test_bf16_left_unset_is_counted_as_the_run_will_hold_it(monkeypatch):
    """The default model's LoRA SFT form with bf16 unset: on a CPU with native bf16 matmul the run trains in bf16
    (backend.core.precision), so its weights and activations count 2 bytes, as with bf16 asked; with
    TUNEBOARD_BF16_AUTO=0, under oneDNN held to AVX2, for DPO (not declared) or with bf16: false, 4 bytes. The
    training process's own rule (backend.training.models.bf16_by_default, with torch's check) agrees on this
    machine."""
    from backend.core import precision
    from backend.core.spec import load_spec
    from backend.training.models import bf16_by_default

    monkeypatch.setattr(preflight.launch, "visible_accelerators", lambda: 0)
    base = {"model_name_or_path": DEFAULT_MODEL_ID, "finetuning_type": "lora", "stage": "sft",
            "per_device_train_batch_size": 4, "cutoff_len": 512}
    weights = lambda **more: preflight.estimate({**base, **more})["weights"]  # noqa: E731
    monkeypatch.setenv(precision.AUTO_ENV, "1")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert preflight._half(base) is bf16_by_default(load_spec(None, ["finetuning_type=lora"]))  # this machine

    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert weights() == weights(bf16=True) == weights(bf16=False) / 2
    assert weights(stage="dpo") == weights(bf16=False) and weights(use_dora=True) == weights(bf16=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert weights() == weights(bf16=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv(precision.AUTO_ENV, "0")
    assert weights() == weights(bf16=False)
    monkeypatch.setenv(precision.AUTO_ENV, "1")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert weights() == weights(bf16=False)
