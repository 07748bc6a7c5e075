"""Where bf16 is the default, without torch: the training process asks it (backend.training.models.bf16_by_default,
which adds torch's own check of the CPU) and so does the Train tab's memory pre-flight (webui/preflight.py), so the
estimate counts the bytes the run will hold.

bf16 left unset trains in bf16 where the stage's and the method's declarations say so (bf16_by_default: LoRA SFT /
PT, measured to learn like fp32; not DoRA), not with fp16, pure_bf16 or a quantized base, and only on a CPU with
native bf16 matmul (avx512_bf16 or AMX, and oneDNN not held below it by ONEDNN_MAX_CPU_ISA, as `bench/run.py --isa
avx2` does). TUNEBOARD_BF16_AUTO=0 keeps fp32 (the test suite's exactness checks; bench lever fp32).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from backend.core.methods import method
from backend.stages import STAGES

AUTO_ENV = "TUNEBOARD_BF16_AUTO"
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) from which bf16 matmul is native; below them it is emulated or absent
_BF16_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10")


def _value(spec: Any, name: str) -> Any:
    return spec.get(name) if isinstance(spec, dict) else getattr(spec, name, None)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16_cpu() -> bool:
    """The CPU has bf16 matmul instructions and oneDNN may use them (torch's own check comes on top in a training
    process: backend.training.models.cpu_bf16_supported)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return bool(cpu_flags() & NATIVE_BF16_FLAGS) and (not isa or isa.startswith(_BF16_ISAS))


def bf16_default_applies(spec: Any) -> bool:
    """The spec (a RunSpec or the form's flat dict) leaves bf16 unset where the default turns it on: the stage and
    the method declare it, nothing asks for another precision, TUNEBOARD_BF16_AUTO is not 0. The machine is not
    asked here."""
    declared = STAGES.get(str(_value(spec, "stage") or "sft"))
    return (_value(spec, "bf16") is None and os.environ.get(AUTO_ENV, "1") != "0"
            and declared is not None and declared.bf16_by_default
            and method(_value(spec, "finetuning_type")).bf16_by_default and not _value(spec, "use_dora")
            and not _value(spec, "fp16") and not _value(spec, "pure_bf16") and not _value(spec, "quantization_bit"))
