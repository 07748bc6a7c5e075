"""Optimizer names shared by the spec (which validates them) and the model loader (which installs them).
Light: no torch, so the spec and the web UI can import it."""

# Optimizers GaLore has a variant of (transformers' galore_* optimizers, package galore-torch). The 8-bit one is
# not offered: galore-torch's GaLoreAdamW8bit calls torch.cuda.synchronize() in its step.
GALORE_OPTIMIZERS = {"adamw_torch": "galore_adamw", "adamw_torch_fused": "galore_adamw", "adamw_hf": "galore_adamw",
                     "adafactor": "galore_adafactor"}
