"""The importance matrix of `export_imatrix: true`: which input columns of each linear layer matter, so llama.cpp's
quantizer spends its precision there (a k-quant's scales and mins are fitted to minimise the error weighted by it).

What llama.cpp's llama-imatrix computes, done here in torch on the merged model (llama-cpp-python does not build that
program): for every weight a matrix multiplication reads (the linear layers; the token embedding is a lookup and the
output head is left out, as llama-imatrix does by default), the mean over all tokens of the square of each input
column's activation. Keyed by the GGUF tensor name our writer gives the weight (gguf_export.tensor_namer), which is the
name llama.cpp's quantizer looks up; handed to it as llama_model_quantize_params.imatrix (llamacpp_check.quantize).

The rows: bundled alpaca_en_demo.json conversations rendered with the training template. They are held out from the
export's own checks: the perplexity rows (llamacpp_check.HELD_OUT, the probe pairs) and the probe prompts are other
texts, so the measured deltas are not taken on the calibration text.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from backend.core.paths import REPO_ROOT
from backend.exporting.gguf_export import tensor_namer

CALIBRATION_FILE = REPO_ROOT / "data" / "alpaca_en_demo.json"
CALIBRATION_ROWS = 64
MAX_ROW_TOKENS = 512


def calibration_conversations(n: int = CALIBRATION_ROWS, start: int = 0) -> list[list[dict]]:
    """n alpaca_en_demo rows from row `start` as chat turns (instruction [+ input] -> output): the first
    CALIBRATION_ROWS for the importance matrix, the rest for the exports' perplexity check."""
    rows = json.loads(CALIBRATION_FILE.read_text(encoding="utf-8"))[start:start + n]
    return [[{"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")},
             {"role": "assistant", "content": r["output"]}] for r in rows]


def calibration_rows(template, tokenizer, n: int = CALIBRATION_ROWS, start: int = 0) -> list[list[int]]:
    """Token ids of calibration_conversations(n, start) rendered with the training template (every token: the
    matrix wants the activations of whole rows)."""
    return [tokenizer(template.render_text(c), add_special_tokens=False).input_ids[:MAX_ROW_TOKENS]
            for c in calibration_conversations(n, start)]


@torch.no_grad()
def compute(model, rows: list[list[int]]) -> dict[str, np.ndarray]:
    """{GGUF weight name: mean squared input activation per input column (float32, in_features long)} of every
    linear layer but the output head, over the tokens of `rows`."""
    name_of = tensor_namer(model.config)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    def hook_for(name: str):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module_name.endswith("lm_head"):
            continue
        name = name_of(module_name + ".weight")
        if name is not None:
            hooks.append(module.register_forward_pre_hook(hook_for(name)))
    try:
        device = next(model.parameters()).device
        for ids in rows:
            model(input_ids=torch.tensor([ids], device=device))
    finally:
        for h in hooks:
            h.remove()
    return {name: (sums[name] / counts[name]).float().cpu().numpy() for name in sums}


def save(path: Path, matrix: dict[str, np.ndarray]) -> None:
    """The matrix as .npz (one float32 array per GGUF weight name): what the quantizer's child process reads
    (llamacpp_check._quantize_main)."""
    with open(path, "wb") as fh:
        np.savez(fh, **matrix)

