"""The run log names the CPU kernels a run uses, and torch's own switch (what `bench/run.py --isa avx2` sets) moves
a process to the AVX2 path on any x86 machine: the line a reader checks when comparing CPU classes."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

SNIPPET = ("import sys; from transformers import AutoModelForCausalLM; from backend.training.models import describe_model; "
           "print(describe_model(AutoModelForCausalLM.from_pretrained(sys.argv[1])))")


def test_the_model_line_names_the_kernels_and_the_avx2_switch_moves_them(tiny_llama):
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    line = subprocess.run([sys.executable, "-c", SNIPPET, str(tiny_llama)], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert line.endswith("device cpu, CPU kernels AVX2"), line
    here = subprocess.run([sys.executable, "-c", SNIPPET, str(tiny_llama)], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}, check=True).stdout
    assert here.strip().endswith(f"CPU kernels {torch.backends.cpu.get_cpu_capability()}"), here
