"""A LoRA model's held-out answers generated with its adapter merged into the weights, and the weights exactly as
they were afterwards: the task metric at each save (backend.evaluation.task_metric) runs on the model being
trained, where peft computes every adapted linear layer as three products (the base weight, then A and B) each
decode step. Measured on the bench recipe (bench/README.md, scoring): a save of 32 rows decoded in ~105 s with the
adapter unmerged, ~58 s for the same decode steps on the bare base model.

`merged_lora(model)`: for each LoRA linear layer, a new weight W + delta (peft's own `get_delta_weight`, what
`merge_adapter` adds) is put in place of the base layer's weight and the adapter layers are switched off
(`disable_adapter`), so a forward pass is one product per layer; on leaving, each base layer gets back its original
weight tensor, untouched (not W + delta - delta, which rounds differently), and the adapter is on again. The answers
are the merged model's, as an export's would be (equal to the unmerged ones up to float rounding).

It does nothing (the caller's model as it is) for anything else than plain LoRA linear layers (DoRA, LoRA on
embeddings or convolutions, quantized bases, other PEFT methods), an adapter already merged, weights partitioned
by DeepSpeed ZeRO-3, or when the merged copies would take more than MERGE_SHARE of the memory available now."""
from __future__ import annotations

from contextlib import contextmanager

import psutil
import torch
from peft.tuners.lora.layer import Linear as LoraLinear, LoraLayer

MERGE_SHARE = 0.25  # of the available memory, at most, for the merged weights (a copy of every adapted weight)


def _plain_lora_layers(model) -> list | None:
    """The model's LoRA linear layers when all are plain, active and unmerged; None otherwise."""
    layers = []
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        if type(module) is not LoraLinear or module.merged or module.disable_adapters \
                or not isinstance(base, torch.nn.Linear) or hasattr(base.weight, "ds_id") \
                or any(module.use_dora.get(a) or getattr(module, "lora_bias", {}).get(a)
                       for a in module.active_adapters):
            return None
        layers.append(module)
    return layers or None


@contextmanager
def merged_lora(model):
    """Inside: the model's LoRA adapter merged (yields True), or the model as it is (yields False)."""
    layers = _plain_lora_layers(model) if hasattr(model, "disable_adapter") else None
    if layers:
        need = sum(layer.get_base_layer().weight.nbytes for layer in layers)
        if need > MERGE_SHARE * psutil.virtual_memory().available:
            layers = None
    if not layers:
        yield False
        return
    saved = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                weight = base.weight.data
                merged = weight.clone()
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        merged += layer.get_delta_weight(adapter).to(weight.dtype)
                saved.append((base, weight))
                base.weight.data = merged
        with model.disable_adapter():
            yield True
    finally:
        for base, weight in saved:
            base.weight.data = weight
