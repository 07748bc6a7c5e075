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
