"""Applying a fine-tuning method to a loaded model: one function per method declared in backend/core/methods.py.

    apply_finetuning(model, spec, ...)   the run's finetuning_type: an adapter method (lora, oft: earlier
                                         adapters merged or resumed, a new peft adapter) or freeze / full
    count_parameters(model)              (trainable, total)

`spec` is only read through attributes (backend.core.spec.RunSpec, or a SimpleNamespace in tests). Adding a
method: its declaration in backend/core/methods.py and one entry in NEW_ADAPTER (an adapter method: the peft
config of a new adapter) or TRAIN_IN_PLACE (a method that marks the model's own weights trainable).
"""
from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any, Callable

import torch
from peft import LoraConfig, OFTConfig, PeftModel, get_peft_model
from transformers.pytorch_utils import Conv1D

from backend.core.methods import adapter_methods, method

logger = logging.getLogger("tuneboard.models")
Warn = Callable[[str], None]

# Methods the spec accepts (LLaMA-Factory names) that a later issue implements.
_NOT_YET = ("use_apollo", "use_badam", "use_adam_mini", "use_muon", "use_llama_pro", "use_unsloth")


def _get(spec: Any, name: str, default: Any = None) -> Any:
    """A spec field, or `default` when the spec lacks it or holds None (backend.training.models reads specs through it too)."""
    value = getattr(spec, name, default)
    return default if value is None else value


def _split(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        items = value
    else:
        items = str(value).split(",")
    return [s.strip() for s in items if str(s).strip()]


def find_all_linear_modules(model) -> list[str]:
    """Short names of every linear layer (nn.Linear, bitsandbytes Linear4bit/8bitLt, GPT-2 Conv1D) except
    the output head, found by identity (model.get_output_embeddings()) so tied or renamed heads are
    excluded too. Our own rather than peft's "all-linear": we also need the list for error messages."""
    head = model.get_output_embeddings()
    names = set()
    for name, module in model.named_modules():
        if module is head or not name:
            continue
        if isinstance(module, (torch.nn.Linear, Conv1D)) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(name.rsplit(".", 1)[-1])
    head_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head and n}
    return sorted(names - head_names)


def _module_short_names(model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}


def _check_names(field: str, wanted: list[str], available: list[str] | set[str]) -> None:
    unknown = [w for w in wanted if w not in available]
    if unknown:
        raise ValueError(
            f"{field}: unknown module{'s' if len(unknown) > 1 else ''} {', '.join(repr(u) for u in unknown)}; "
            f"available: {', '.join(sorted(available))}"
        )


def _check_not_yet(spec: Any) -> None:
    for name in _NOT_YET:
        if _get(spec, name, False):
            raise NotImplementedError(f"not implemented yet: {name}")


def _upcast_trainable(model, spec: Any) -> None:
    """fp32 master weights for what we train (the frozen rest may stay bf16/fp16 under autocast),
    unless pure_bf16 asks to train in bf16 itself."""
    if _get(spec, "pure_bf16", False):
        return
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def apply_finetuning(model, spec: Any, *, for_training: bool = True, warn: Warn | None = None):
    """Make the right parameters trainable for spec.finetuning_type and return the (maybe wrapped) model.
    An adapter method returns a peft model; `freeze` and `full` return the model itself."""
    _check_not_yet(spec)
    declared = method(_get(spec, "finetuning_type", None))
    if declared.adapter:
        model = _with_adapters(model, spec, declared.id, for_training)
        if for_training and _half_frozen(model) and not _get(spec, "pure_bf16", False):
            lora_sums_in_fp32(model)
    else:
        if _get(spec, "adapter_name_or_path", None):
            raise ValueError(f"adapter_name_or_path needs an adapter method (finetuning_type "
                             f"{' or '.join(adapter_methods())}), not {declared.id}")
        if for_training:
            TRAIN_IN_PLACE[declared.id](model, spec)
    if for_training:
        trainable, total = count_parameters(model)
        logger.info("trainable params: %s || all params: %s || trainable%%: %.4f", f"{trainable:,}", f"{total:,}",
                    100 * trainable / max(total, 1))
    return model


def _half_frozen(model) -> bool:
    """Mixed precision: the frozen weights were loaded in bf16 / fp16 (bf16 asked, or its default: compute_dtype)."""
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters() if not p.requires_grad)


def lora_sums_in_fp32(model) -> int:
    """Under bf16 / fp16 autocast a LoRA layer returns base(x) + B(A(x)) * scaling summed in half precision, where
    the adapter's contribution in the first steps (~1e-3 of base(x)) is below the rounding step (2^-8 for bf16): it
    is rounded away in what the forward computes, so the run's logged losses, its evaluation and a chat under autocast
    see little of what the adapter learned (bench/README.md: logged losses 8-40% above fp32's; the adapter itself
    learns the same, read by an fp32 forward). Each plain LoRA Linear layer adds its branch in fp32 instead, its
    output then fp32. Returns how many layers; variants (DoRA and the like) keep peft's forward."""
    from peft.tuners.lora.layer import Linear as LoraLinear  # peft's LoRA layer class, only where LoRA trains

    layers = [m for m in model.modules() if type(m) is LoraLinear]
    for layer in layers:
        layer.forward = types.MethodType(_lora_forward_fp32_sum, layer)
    return len(layers)


def _lora_forward_fp32_sum(self, x, *args, **kwargs):
    names = [n for n in self.active_adapters if n in self.lora_A]
    if (self.disable_adapters or self.merged or not names or kwargs.get("adapter_names") is not None
            or not torch.is_autocast_enabled(x.device.type)
            or any(self.use_dora.get(n) or n in getattr(self, "lora_variant", {}) for n in names)):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    with torch.autocast(x.device.type, enabled=False):
        out = result.float()
        for n in names:
            out = out + self.lora_B[n](self.lora_A[n](self.lora_dropout[n](x).float())) * self.scaling[n]
    return out


def _is_quantized(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
                or getattr(model, "quantization_method", None))


def _check_adapter(path: str) -> str:
    folder = Path(path).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ValueError(f"adapter_name_or_path: '{path}' is not an adapter folder (no adapter_config.json)")
    return str(folder)


def _with_adapters(model, spec: Any, method_id: str, for_training: bool):
    """Earlier adapters (adapter_name_or_path, any peft type) merged into the base or resumed; then, when
    training and not resuming, a new adapter of `method_id` on the targeted linear layers."""
    adapters = [_check_adapter(p) for p in _split(_get(spec, "adapter_name_or_path", None))]
    create_new = bool(_get(spec, "create_new_adapter", False))
    quantized = _is_quantized(model)
    if quantized and adapters and (len(adapters) > 1 or (for_training and create_new)):
        raise ValueError(
            "a quantized model takes a single adapter, to resume or to run (merging into a 4/8-bit base is "
            "lossy): merge the adapters into a full-precision model first (tuneboard export)"
        )
    if adapters and ((for_training and not create_new) or quantized):
        to_merge, to_resume = adapters[:-1], adapters[-1]  # keep training (or run) the last one
    else:
        to_merge, to_resume = adapters, None  # bake them all into the base
    for path in to_merge:
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
    if to_resume is not None:
        model = PeftModel.from_pretrained(model, to_resume, is_trainable=for_training)
        return model
    if not for_training:
        return model

    target_field = f"{method_id}_target"
    target = _split(_get(spec, target_field, "all")) or ["all"]
    available = find_all_linear_modules(model)
    reward = is_reward_model(model)
    if reward:  # the score head is trained in full and saved with the adapter (modules_to_save), not adapted
        available = [name for name in available if name != "score"]
    if target == ["all"]:
        target = available
    else:
        _check_names(target_field, target, available)
    modules_to_save = _split(_get(spec, "additional_target", None)) or None
    if modules_to_save:
        _check_names("additional_target", modules_to_save, _module_short_names(model))
    if reward:
        modules_to_save = sorted(set(modules_to_save or []) | {"score"})
    if getattr(model, "tuneboard_resized_vocab", False):  # the new tokens' rows are trained and saved with the adapter
        modules_to_save = sorted(set(modules_to_save or []) | set(_embedding_names(model)))
    task_type = "SEQ_CLS" if reward else "CAUSAL_LM"
    return get_peft_model(model, NEW_ADAPTER[method_id](spec, target, modules_to_save, task_type))


def _lora_config(spec: Any, target: list[str], modules_to_save: list[str] | None, task_type: str):
    rank = int(_get(spec, "lora_rank", 8))
    init: Any = True
    if _get(spec, "pissa_init", False):
        niter = int(_get(spec, "pissa_iter", 16))
        init = f"pissa_niter_{niter}" if niter > 0 else "pissa"
    return LoraConfig(
        task_type=task_type,
        r=rank,
        lora_alpha=int(_get(spec, "lora_alpha", None) or 2 * rank),
        lora_dropout=float(_get(spec, "lora_dropout", 0.0)),
        target_modules=target,
        modules_to_save=modules_to_save,
        use_dora=bool(_get(spec, "use_dora", False)),
        use_rslora=bool(_get(spec, "use_rslora", False)),
        init_lora_weights=init,
    )


def _oft_config(spec: Any, target: list[str], modules_to_save: list[str] | None, task_type: str):
    """peft's OFT (orthogonal fine-tuning): each targeted layer's output is rotated by a block-diagonal
    orthogonal matrix; LLaMA-Factory's keys: oft_rank (number of blocks) or oft_block_size (their size),
    exactly one of them non-zero, and module_dropout."""
    return OFTConfig(
        task_type=task_type,
        r=int(_get(spec, "oft_rank", 0)),
        oft_block_size=int(_get(spec, "oft_block_size", 32)),
        module_dropout=float(_get(spec, "module_dropout", 0.0)),
        target_modules=target,
        modules_to_save=modules_to_save,
    )


def is_reward_model(model) -> bool:
    """A sequence-classification model with one output (what load_model(reward_head=True) builds)."""
    return type(model).__name__.endswith("ForSequenceClassification") and getattr(model.config, "num_labels", 0) == 1


def _embedding_names(model) -> list[str]:
    """Short module names of the input and output embeddings (embed_tokens, lm_head for most families)."""
    wanted = [model.get_input_embeddings(), model.get_output_embeddings()]
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and any(module is w for w in wanted if w is not None)})


def _decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList of decoder layers (name, list): the first one as long as num_hidden_layers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return name, module
    raise ValueError(f"freeze: cannot find the {n} decoder layers of {type(model).__name__}")


def _setup_freeze(model, spec: Any) -> None:
    """Train the last N decoder layers (freeze_trainable_layers > 0) or the first N (< 0), only their
    freeze_trainable_modules ("all" or e.g. "mlp,self_attn"), plus freeze_extra_modules outside the
    layers (e.g. "embed_tokens,norm"). Everything else is frozen."""
    layers_name, layers = _decoder_layers(model)
    n = len(layers)
    count = int(_get(spec, "freeze_trainable_layers", 2))
    if count == 0:
        raise ValueError("freeze_trainable_layers: 0 trains nothing; give N > 0 (last N layers) or N < 0 (first N)")
    ids = range(max(0, n - count), n) if count > 0 else range(min(-count, n))

    inner = sorted({name.split(".", 1)[0] for name, _ in layers[0].named_children()})
    wanted = _split(_get(spec, "freeze_trainable_modules", "all")) or ["all"]
    if wanted != ["all"]:
        _check_names("freeze_trainable_modules", wanted, inner)
        inner = wanted
    prefixes = [f"{layers_name}.{i}.{m}." for i in ids for m in inner]

    outer: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if not name or name == layers_name or name.startswith(layers_name + "."):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            outer.setdefault(name.rsplit(".", 1)[-1], []).append(name + ".")
    extra = _split(_get(spec, "freeze_extra_modules", None))
    _check_names("freeze_extra_modules", extra, set(outer))
    prefixes += [p for e in extra for p in outer[e]]
    if is_reward_model(model):  # a new score head must learn whatever layers train
        prefixes += outer.get("score", [])
    if getattr(model, "tuneboard_resized_vocab", False):  # new tokens' rows must learn too
        prefixes += [p for e in _embedding_names(model) for p in outer.get(e, [])]

    for name, param in model.named_parameters():
        param.requires_grad_(any(name.startswith(p) for p in prefixes))
    _upcast_trainable(model, spec)


def _setup_full(model, spec: Any) -> None:
    for param in model.parameters():
        param.requires_grad_(True)
    _upcast_trainable(model, spec)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit packed weights count as the values they hold."""
    trainable = total = 0
    for param in model.parameters():
        num = param.numel()
        if type(param).__name__ == "Params4bit":
            storage = getattr(param, "quant_storage", None)
            num = num * 2 * (getattr(storage, "itemsize", 1) or 1)
        total += num
        if param.requires_grad:
            trainable += num
    return trainable, total


# The per-method code, keyed by the ids backend/core/methods.py declares (tests/backend/test_methods.py checks
# that every declared method has its entry).
NEW_ADAPTER = {"lora": _lora_config, "oft": _oft_config}
TRAIN_IN_PLACE = {"freeze": _setup_freeze, "full": _setup_full}
