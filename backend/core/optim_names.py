"""Optimizer names shared by the spec (which validates them) and the model loader (which installs them).
Light: no torch, so the spec and the web UI can import it."""

# Optimizers GaLore has a variant of (transformers' galore_* optimizers, package galore-torch). The 8-bit one is
# not offered: galore-torch's GaLoreAdamW8bit calls torch.cuda.synchronize() in its step.
GALORE_OPTIMIZERS = {"adamw_torch": "galore_adamw", "adamw_torch_fused": "galore_adamw", "adamw_hf": "galore_adamw",
                     "adafactor": "galore_adafactor"}

# Words in the names of transformers' optimizers that are bitsandbytes' (OptimizerNames: adamw_bnb_8bit, adamw_8bit,
# paged_adamw_32bit, lion_8bit, ademamix, rmsprop_bnb, ...): a run with one of them needs bitsandbytes loaded.
BITSANDBYTES_OPTIMIZER_WORDS = ("bnb", "8bit", "32bit", "paged", "lion", "ademamix")


def uses_bitsandbytes(optim: str | None) -> bool:
    """Whether transformers' optimizer `optim` is one of bitsandbytes'."""
    name = str(optim or "").lower()
    return any(word in name for word in BITSANDBYTES_OPTIMIZER_WORDS)
