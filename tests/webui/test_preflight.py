"""The pre-flight formula against a measured run: the guide's recipe (examples/sft_qlora_extraction.yaml, QLoRA
4-bit, 4 x 4096 packed tokens a micro-batch, plain checkpointing) ran to the end on the 2-core, 24 GiB CPU
machine on 2026-12-01 with a peak RSS of 5,120 MiB (/usr/bin/time -v; webui/preflight.py says how). The issue
asks the estimate to be within 25% of that: a change to the formula that drifts further fails here."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

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
