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


# transformers' optimizers that need a package TuneBoard does not install (module to import, pip name, what it is
# for), by name or name prefix: each stopped a short run here after launch ("install ..."); validate refuses them
# while the module is missing, and takes them once it is there.
OPTIMIZER_PACKAGES = {
    "adamw_torch_xla": ("torch_xla", "torch_xla", "Google TPUs"),
    "adamw_torch_npu_fused": ("torch_npu", "torch_npu", "Ascend NPUs"),
    "adamw_anyprecision": ("torchdistx", "torchdistx", None),
    "adamw_torch_4bit": ("torchao", "torchao", None),
    "adamw_torch_8bit": ("torchao", "torchao", None),
    "lomo": ("lomo_optim", "lomo-optim", None),
    "adalomo": ("lomo_optim", "lomo-optim", None),
    "grokadamw": ("grokadamw", "grokadamw", None),
    "schedule_free_": ("schedulefree", "schedulefree", None),
    "apollo_": ("apollo_torch", "apollo-torch", None),
    "stable_adamw": ("optimi", "torch-optimi", None),
}


def optimizer_problem(optim: str | None) -> str | None:
    """Why transformers' optimizer `optim` cannot run here, in one line with what to do instead, or None.
    galore_* names are GaLore's own variants: use_galore picks them (they need its target modules)."""
    import importlib.util  # light; only when an optimizer is checked

    name = str(optim or "")
    if name.startswith("galore_"):
        return (f"{name} is a GaLore optimizer, which use_galore picks itself: set use_galore: true (finetuning_type "
                "full or freeze) with optim adamw_torch (or adafactor), and galore_target for its modules")
    for key, (module, package, what) in OPTIMIZER_PACKAGES.items():
        if (name == key or (key.endswith("_") and name.startswith(key))) and importlib.util.find_spec(module) is None:
            return (f"{name} needs the {package} package, which is not installed"
                    + (f" (it is for {what})" if what else "") + f": pip install {package}, or pick another optim "
                    "(adamw_torch, adamw_torch_fused, adafactor, sgd, adamw_8bit, ...)")
    return None
