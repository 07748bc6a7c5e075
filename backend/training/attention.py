"""Varlen SDPA for padding-free batches: each row of a concatenated batch attends to itself alone, through one
causal ``scaled_dot_product_attention`` per row, instead of one SDPA over the whole [T x T] with a
block-diagonal mask.

Why: a padding-free batch (backend.dataprep.preprocess.PaddingFreeCollator) is one sequence of T = sum of the rows'
lengths. Plain SDPA then computes attention over all T x T query/key pairs and masks the pairs across rows:
for 4 rows that is ~4x the attention work of the padded batch, and a masked SDPA cannot take the fast
is_causal kernel. Per row, the work is sum(len^2) with the causal kernel, which is what flash-attention's
varlen kernels do on a GPU; this is the same idea in plain PyTorch, so it runs on the CPU.

The rows come from the collator's ``cu_seq_lens_q`` (its flash_attn_kwargs, which transformers passes down to
the attention function with the other keyword arguments); ``row_masks``, when given, is one [n, n] boolean mask a
row used instead of the causal one (backend/training/shared_prompt.py: a DPO pair's prompt + chosen + rejected).
``prefix_stash`` keeps each row's first keys and values (a KTO row's prompt), and ``prefix_kv`` puts them before the
rows of a later forward that continues those rows (its KL rows: the same prompt, another answer), row_masks then
[n, kept + n].
Any call without them (eval, generation, a padded batch) is plain SDPA with the mask transformers built for it: the
implementation registers transformers' own SDPA mask function under its name, so everything but the padding-free
training batch is unchanged.
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "tuneboard_varlen_sdpa"


def varlen_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, Hkv, T, D] ->
    (output [B, T, H, D], None)."""

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] or kwargs.get("position_bias") is not None \
            or kwargs.get("softcap") is not None or (is_causal is False) or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    bounds = cu.tolist()
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    window = getattr(module, "sliding_window", None)
    if not sizes or (window and max(sizes) > window) or bounds[0] != 0 or bounds[-1] != query.shape[2] \
            or min(sizes) < 0:
        # the mask has the window (keep it), or the boundaries do not cover the batch exactly
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    masks = kwargs.get("row_masks") or [None] * len(sizes)  # [n, n] a row (shared_prompt's pairs), else causal
    groups = getattr(module, "num_key_value_groups", 1)
    # One split per tensor, not a slice per row: a slice's backward writes its gradient into a zeroed tensor of
    # the whole [B, H, T, D] input, so slicing n rows cost n full-size zero fills per layer (the guide's packed
    # recipe has ~80 rows in a 16k-token batch: 6x the attention time); split's backward is one concatenation.
    keys, values = key.split(sizes, 2), value.split(sizes, 2)
    stash, prefixes = kwargs.get("prefix_stash"), kwargs.get("prefix_kv")  # shared_prompt.PrefixStash
    if stash is not None:  # keep each row's first keys / values for a later forward of its continuations
        stash.keep(getattr(module, "layer_idx", None), keys, values)
    if prefixes is not None:  # each row continues a stashed one: its keys / values come first (row_masks say so)
        kept = prefixes.layers[module.layer_idx]
        keys = [torch.cat([pk, k], 2) for (pk, _), k in zip(kept, keys)]
        values = [torch.cat([pv, v], 2) for (_, pv), v in zip(kept, values)]
    outs = [torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                             scale=scaling, is_causal=mask is None,
                                                             enable_gqa=groups > 1)
            for q, k, v, n, mask in zip(query.split(sizes, 2), keys, values, sizes, masks) if n]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make NAME a known attention implementation (idempotent); returns NAME."""

    AttentionInterface.register(NAME, varlen_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def use_varlen_attention(model) -> str | None:
    """Switch a model whose attention is SDPA to the varlen SDPA for padding-free batches (the collator must then
    send cu_seq_lens: PaddingFreeCollator(flash_attn_kwargs=True)). A probe on the model checks that two rows run
    concatenated through it give the logits of the rows run alone; on any difference the model goes back to SDPA.
    Returns None when switched, else the reason it was not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(inner.config, "_attn_implementation", None) == NAME:
        return None
    if getattr(inner.config, "_attn_implementation", None) != "sdpa":
        return f"attention is '{getattr(inner.config, '_attn_implementation', None)}', not sdpa"
    if not hasattr(inner, "set_attn_implementation"):
        return "the model cannot switch its attention implementation"
    try:
        inner.set_attn_implementation(register())
    except Exception as exc:  # a family without the functional attention interface
        return f"cannot switch attention ({type(exc).__name__}: {exc})"
    problem = _probe(model)
    if problem:
        inner.set_attn_implementation("sdpa")
    return problem


def _probe(model) -> str | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    device = next(p.device for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, min(int(config.vocab_size), 4096), (n,), generator=gen).to(device) for n in (7, 5)]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None].to(device)
    cu = torch.tensor([0, 7, 12], dtype=torch.int32, device=device)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            flat = model(input_ids=torch.cat(rows)[None], position_ids=positions, use_cache=False, cu_seq_lens_q=cu,
                         cu_seq_lens_k=cu, max_length_q=7, max_length_k=7).logits[0].float()
            alone = torch.cat([model(input_ids=r[None], use_cache=False).logits[0].float() for r in rows])
    except Exception as exc:
        return f"the varlen probe failed ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
    error = (flat - alone).abs().max().item() / max(1.0, alone.abs().max().item())
    tolerance = 1e-3 if flat.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        return f"varlen attention differs from the rows alone (relative logit error {error:.2g})"
    return None
