"""A 4-bit model loaded for training keeps bitsandbytes' trainable weight layout after an eval-mode forward.

On a CPU with avx512_bf16, bitsandbytes' Linear4bit repacks its weight for inference on the first eval-mode,
no-grad forward (our padding-free probe is one), and the repacked path (`gemv_4bit`) has no backward: the
LoRA gradients of every layer below the last went to 0 (and a ZeRO-3 checkpoint could not be written).
backend.training.models.load_model switches the repacking off for a training model; this checks the gradients are the
ones of a model that was never probed.
"""
from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")


def _model(tiny_llama):
    from backend.training.adapters import apply_finetuning
    from backend.training.models import load_model, resolve_model
    from backend.core.spec import RunSpec

    spec = RunSpec(model_name_or_path=str(tiny_llama), dataset="identity", template="llama3", quantization_bit=4,
                   lora_rank=4)
    torch.manual_seed(0)
    model = load_model(spec, resolve_model(spec.model_name_or_path), warn=lambda m: None)
    return apply_finetuning(model, spec, warn=lambda m: None)


def _grads(model) -> dict[str, torch.Tensor]:
    model.train()
    ids = torch.arange(5, 40)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_an_eval_forward_leaves_the_qlora_gradients_intact(tiny_llama):
    from backend.training.models import padding_free_problem

    plain = _grads(_model(tiny_llama))
    probed_model = _model(tiny_llama)
    assert padding_free_problem(probed_model) is None  # the eval-mode, no-grad probe forward
    layers = [m for m in probed_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    probed = _grads(probed_model)
    assert set(probed) == set(plain)
    first = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert plain[first].abs().max() > 0  # the lowest layer's LoRA gets a gradient through the base layers above
    for name, grad in plain.items():
        assert torch.allclose(probed[name], grad, rtol=1e-5, atol=1e-8), name
