"""Selective activation checkpointing: what a checkpointed layer keeps from its forward so the backward's
recompute skips the costly ops (torch.utils.checkpoint's selective checkpoint contexts). Torch-free at import:
the Train tab's memory pre-flight uses the same sizing rule.

Plain checkpointing keeps only each layer's input and runs the whole layer forward again in the backward:
on the bench recipe that second forward is ~25% of a step, and a third of it is attention. Kept instead:
- the attention op's outputs (scaled_dot_product_attention's output and log-sum-exp: one hidden-size vector
  a token): attention is the costliest op per byte it produces;
- matrix products whose output is no wider than their inner dimension (q/k/v/o and down projections, a LoRA A
  product): each kept number saves >= hidden-size multiply-adds. The widening ones (gate/up: ~2.7x wider than
  the hidden size, most of a layer's activation memory) and everything element-wise are recomputed.
The values are those of plain checkpointing (the kept tensors are what the recompute would produce again), so
losses and gradients are equal (tests/backend/test_checkpointing.py). Measured on the bench recipe: +17%
tokens/s for +360 MiB peak RSS (1,386 -> 1,745 MiB; bench/README.md).

The extra memory grows with the tokens of a micro-batch (about SELECTIVE_VALUES hidden-size vectors a token a
layer), so it is chosen per run: selective when that extra fits in SELECTIVE_SHARE of the memory free at
start (RAM, or the GPU's), else plain checkpointing; the run log says which and why. Plain also where the stage's
TRL trainer switches an adapter's checkpointing to torch's reentrant form (DeepSpeed ZeRO-3), which takes no
selective contexts.
TUNEBOARD_SELECTIVE_CHECKPOINT=0 forces plain (the bench lever `full-recompute`), =1 forces selective; a spec
that sets activation_checkpointing_kwargs / gradient_checkpointing_kwargs itself gets exactly those.
"""
from __future__ import annotations

import functools
import os
import psutil
from backend.core.launch import config_zero_stage
from backend.core.methods import method
from backend.stages import pairwise, zero3_adapter_reentrant

ENV = "TUNEBOARD_SELECTIVE_CHECKPOINT"
SELECTIVE_VALUES = 4.7  # kept a token a layer, in hidden-size vectors: q, o, down, attention out + k, v (GQA)
SELECTIVE_SHARE = 0.1  # of the memory free at start that the kept outputs may take

_selective = False  # this process's choice (choose()); read by checkpoint_kwargs()
_why: str | None = None


def extra_bytes(tokens: float, hidden: float, layers: float, bytes_per_value: float) -> float:
    """What selective checkpointing keeps beyond plain checkpointing, for one micro-batch of `tokens`."""
    return tokens * hidden * layers * SELECTIVE_VALUES * bytes_per_value


def decide(extra: float, free: float) -> tuple[bool, str]:
    """(selective?, why) from the extra bytes and the free memory; TUNEBOARD_SELECTIVE_CHECKPOINT overrides."""
    forced = os.environ.get(ENV, "").strip().lower()
    mib = 2 ** 20
    if forced in ("0", "false", "no", "off"):
        return False, f"plain ({ENV}={forced})"
    if forced in ("1", "true", "yes", "on"):
        return True, f"selective ({ENV}={forced}; keeps up to ~{extra / mib:,.0f} MiB more)"
    if extra <= SELECTIVE_SHARE * free:
        return True, (f"selective: keeps matmul/attention outputs, up to ~{extra / mib:,.0f} MiB more, within "
                      f"{SELECTIVE_SHARE:.0%} of the {free / mib:,.0f} MiB free")
    return False, (f"plain: selective would keep ~{extra / mib:,.0f} MiB more, over {SELECTIVE_SHARE:.0%} of the "
                   f"{free / mib:,.0f} MiB free")


def choose(spec, model) -> str:
    """Decide for this training process from the spec's largest micro-batch and the model's shape; returns the
    line for the run log."""
    global _selective, _why
    import torch  # heavy: loaded on use, so importing this module stays light


    given = given_by_spec(spec)
    if given:
        _selective, _why = False, f"as the spec's {given} say"
        return _why
    reentrant = made_reentrant(getattr(spec, "stage", "sft"), getattr(spec, "finetuning_type", None),
                               config_zero_stage(getattr(spec, "deepspeed", None)))
    if reentrant:
        _selective, _why = False, reentrant
        return _why
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not hidden or not layers:
        _selective, _why = False, "plain (the model's config has no hidden_size/num_hidden_layers)"
        return _why
    pairs = pairwise(getattr(spec, "stage", "sft"))
    batch = getattr(spec, "per_device_train_batch_size", 1) or 1
    tokens = batch * (getattr(spec, "cutoff_len", 1024) or 1024) * (2 if pairs else 1)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    width = param.element_size() if param is not None and param.element_size() in (2, 4) else 4
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:  # the processes of this machine share its RAM
        free = psutil.virtual_memory().available / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    _selective, _why = decide(extra_bytes(tokens, hidden, layers, width), free)
    return _why


def made_reentrant(stage: str | None, finetuning_type: str | None, zero: int | None) -> str | None:
    """Why checkpointing is plain where the stage's TRL trainer makes an adapter's checkpointing reentrant (DeepSpeed
    ZeRO stage `zero` 3), which takes no selective contexts; None elsewhere. The training process and the form's
    pre-flight ask (each with the ZeRO stage it has read)."""
    if zero3_adapter_reentrant(stage) and zero == 3 and method(finetuning_type).adapter:
        return (f"plain: the {stage} stage's TRL trainer makes an adapter's checkpointing reentrant under DeepSpeed "
                "ZeRO-3, which keeps no outputs selectively")
    return None


def given_by_spec(spec) -> str | None:
    """The checkpoint-kwargs key the spec passes to the Trainer itself (then it gets exactly those), or None."""
    passthrough = getattr(spec, "passthrough", None) or {}
    return next((k for k in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs") if k in passthrough),
                None)


def described() -> str | None:
    """The last choice's line (None before any)."""
    return _why


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy  # heavy: loaded on use, so importing this module stays light

    if op in _attention_ops():
        return CheckpointPolicy.MUST_SAVE
    aten = _aten()
    if op is aten.mm.default or op is aten.addmm.default:
        a, b = (args[0], args[1]) if op is aten.mm.default else (args[1], args[2])
        if b.shape[-1] <= a.shape[-1]:
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _aten():
    import torch  # heavy: loaded on use, so importing this module stays light

    return torch.ops.aten


@functools.lru_cache(maxsize=1)
def _attention_ops() -> tuple:
    aten = _aten()
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return tuple(getattr(aten, name).default for name in names if hasattr(aten, name))


def checkpoint_kwargs() -> dict:
    """The kwargs for torch.utils.checkpoint.checkpoint (through transformers' activation_checkpointing_kwargs)."""
    kwargs: dict = {"use_reentrant": False}
    if _selective:
        kwargs["context_fn"] = _context_fn()
    return kwargs


class _SelectiveContexts(dict):
    """torch's context_fn: a callable that makes the selective checkpoint contexts. A dict, so TrainingArguments
    that hold it still turn into JSON (TensorBoard's report_to writes args.to_json_string()): it reads
    {"selective_checkpoint": ...} there."""

    def __call__(self):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts  # heavy: loaded on use, so importing this module stays light

        return create_selective_checkpoint_contexts(_current_policy)


@functools.lru_cache(maxsize=1)
def _context_fn():
    """One object for the process, so two TrainingArguments built from one spec compare equal."""
    return _SelectiveContexts(selective_checkpoint="attention and narrowing matmul outputs kept")


def _current_policy(ctx, op, *args, **kwargs):
    return _policy(ctx, op, *args, **kwargs)  # looked up per call (a test counts through a stand-in)
