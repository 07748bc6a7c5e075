"""Models: find them, load them, make them trainable.

    resolve_model(name)                  hub id / local folder / .gguf file -> ResolvedModel (no weights read)
    materialize_gguf(path)               GGUF -> a cached plain HF folder (dequantized once, then ~1 s loads)
    load_tokenizer(resolved)             tokenizer with a pad token
    load_model(spec, resolved, ...)      dtype, attention, liger, bitsandbytes quantization, checkpointing
    (applying a fine-tuning method: backend/training/adapters.py; the methods: backend/core/methods.py)

Nothing here is ever downloaded: a hub id only resolves if it is already in the local Hugging Face cache.
Requested accelerations this machine cannot provide (bf16, flash-attn, liger) are not errors: they go to
the `warn` callback once each (the stage writes them to running_log.txt and status.json) and the run
continues on the fallback. `spec` is only read through attributes, so any object with LLaMA-Factory's
field names works (backend.core.spec.RunSpec, or a SimpleNamespace in tests).
"""
from __future__ import annotations

import copy
import functools
import importlib
import json
import logging
import math
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from peft import prepare_model_for_kbit_training
from peft.optimizers import create_loraplus_optimizer
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          BitsAndBytesConfig)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from backend.training.adapters import _check_names, _get, _split, find_all_linear_modules, is_reward_model
from backend.core.checkpointing import checkpoint_kwargs, choose
from backend.training.losses import causal_lm_loss, liger_usable
from backend.core.methods import method, quantizable_methods
from backend.core.model_files import gguf_cache_folder, locate
from backend.core.optim_names import GALORE_OPTIMIZERS
from backend.core.paths import DEFAULT_MODEL_ID, default_model_file
from backend.core.registry import lookup_registry
from backend.core.precision import bf16_default_applies, native_bf16_cpu

logger = logging.getLogger("tuneboard.models")
Warn = Callable[[str], None]




def _default_warn(message: str) -> None:
    logger.warning(message)


# --------------------------------------------------------------------------------------------- resolve
@dataclass
class ResolvedModel:
    """Where a model's files are, without reading its weights. For a GGUF model `path` is the file's
    folder and `gguf_file` its name; load_* functions go through materialize_gguf()."""
    path: Path
    gguf_file: str | None
    model_id: str
    family: str | None
    template: str | None
    instruct: bool | None
    is_default: bool = False

    @property
    def gguf_path(self) -> Path | None:
        return self.path / self.gguf_file if self.gguf_file else None


def _family_from_folder(folder: Path) -> str | None:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _family_from_gguf(path: Path) -> str | None:
    """general.architecture from the GGUF header. Read by hand because gguf.GGUFReader indexes every
    tensor and vocabulary entry first (~10 s for the default model); this reads a few hundred bytes."""
    def read(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def read_string(f):
        return f.read(read(f, "<Q")).decode("utf-8", "replace")

    def skip_value(f, kind):
        if kind == 8:
            f.seek(read(f, "<Q"), 1)
        elif kind == 9:
            item, count = read(f, "<I"), read(f, "<Q")
            if item in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[item]) * count, 1)
            else:
                for _ in range(count):
                    skip_value(f, item)
        else:
            f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return None
            read(f, "<Q")  # tensor count
            for _ in range(read(f, "<Q")):
                key, kind = read_string(f), read(f, "<I")
                if key == "general.architecture" and kind == 8:
                    return read_string(f)
                skip_value(f, kind)
    except (OSError, EOFError, KeyError, struct.error):  # a damaged file is reported when it is loaded
        return None
    return None


def _resolved(path: Path, gguf_file: str | None, name: str, family: str | None, is_default=False) -> ResolvedModel:
    """Fill family / template / instruct from the registry (by id, else by the folder or file name)."""
    entry = lookup_registry(name) or lookup_registry(gguf_file or path.name)
    if entry:
        model_id = entry.model_id
    elif gguf_file:
        model_id = Path(gguf_file).stem
    else:
        model_id = path.name
    return ResolvedModel(
        path=path,
        gguf_file=gguf_file,
        model_id=model_id,
        family=entry.family if entry else family,
        template=entry.template if entry else None,
        instruct=entry.instruct if entry else None,
        is_default=is_default,
    )


def resolve_model(name_or_path: str) -> ResolvedModel:
    """A local HF folder (has config.json), a .gguf file, a folder holding exactly one .gguf, a hub id
    already in the local HF cache, or DEFAULT_MODEL_ID (-> the bundled GGUF)."""
    name = str(name_or_path).strip()
    if not name:
        raise ValueError("model_name_or_path is empty: give a local folder, a .gguf file or a known model id")
    if name.lower() == DEFAULT_MODEL_ID.lower():
        gguf = default_model_file()
        return _resolved(gguf.parent, gguf.name, DEFAULT_MODEL_ID, "llama", is_default=True)

    folder, gguf = locate(name)  # model_files says where (and why not) for validate and the run alike
    path = Path(name).expanduser()
    if path.is_file():
        path = path.resolve()  # a symlinked .gguf: its real folder
        folder, gguf = path.parent, path.name
    elif path.is_dir():
        folder = folder.resolve()
    family = _family_from_gguf(folder / gguf) if gguf else _family_from_folder(folder)
    resolved = _resolved(folder, gguf, name, family)
    if not path.exists():  # a hub id: its cached snapshot
        resolved.model_id = name
    return resolved


# --------------------------------------------------------------------------------------------- GGUF
def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def materialize_gguf(gguf_path: str | os.PathLike) -> Path:
    """Dequantize a GGUF file once into a plain HF folder (safetensors + config + tokenizer with its chat
    template + generation_config) under cache_dir()/models/<stem>-<size>-<mtime_ns>/ and return it.

    Why: transformers dequantizes GGUF on every load (~35 s for the 135M default) and refuses
    save_pretrained on a GGUF-loaded model (it carries a GGUF hf_quantizer). The cached folder loads in
    ~1 s, is an ordinary fp32 model, so full / merged models derived from it save normally. It is written
    to a temp folder and renamed into place, so a reader never sees half a folder and two processes
    converting at once both end with the same complete folder."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = gguf_cache_folder(gguf_path)
    if _is_complete(target):
        return target
    if target.exists():  # damaged by hand (our own writes are atomic): convert again
        shutil.rmtree(target, ignore_errors=True)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        logger.info("converting %s to a cached HF folder (one time)", gguf_path)
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as exc:
            raise ValueError(f"cannot load GGUF file {gguf_path}: {exc}") from exc
        # The weights are already dequantized; what blocks save_pretrained is the GGUF quantizer marker.
        model.hf_quantizer = None
        for holder in (model.config, getattr(model.config, "get_text_config", lambda: None)()):
            if holder is not None and hasattr(holder, "quantization_config"):
                delattr(holder, "quantization_config")
        model.config._name_or_path = str(target)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process got there first: its folder is complete (renamed atomically)
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_folder(resolved: ResolvedModel) -> Path:
    """The HF folder to load from (the materialized cache for GGUF models)."""
    return materialize_gguf(resolved.gguf_path) if resolved.gguf_file else resolved.path


# --------------------------------------------------------------------------------------------- loading
def load_tokenizer(resolved: ResolvedModel, *, trust_remote_code: bool = False, new_special_tokens: Any = None):
    """The model's tokenizer, with a pad token (eos when it has none). Padding is only used for batching:
    labels come from explicit spans, never from pad ids, so pad == eos does not unlearn the stop token.
    new_special_tokens (a comma list) are added as special tokens (never split); load_model() then grows the
    embeddings to match (see resize_vocab)."""
    tokenizer = AutoTokenizer.from_pretrained(model_folder(resolved), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {resolved.model_id} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokens = [t for t in _split(new_special_tokens) if t not in tokenizer.get_vocab()]
    if tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    return tokenizer


@functools.lru_cache(maxsize=1)
def cpu_bf16_supported() -> bool:
    """A CPU whose bf16 matmuls are native (avx512_bf16 or AMX, used by torch's oneDNN): there a 2048^3 bf16
    matmul ran at 107-165 GFLOP/s against 37-63 in fp32 in the same minute. torch also reports bf16 support
    on AVX-512 CPUs without those instructions, where bf16 is emulated and slower than fp32: those keep fp32."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
    except (AttributeError, RuntimeError):
        return False
    return native_bf16_cpu()


def bf16_supported() -> bool:
    """bf16 compute where it is fast: a GPU that supports it, else a CPU with native bf16 matmul."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_bf16_supported()


BF16_DEFAULT_NOTE = ("bf16: on, the default for LoRA SFT / PT on a CPU with native bf16 matmul (the model in bf16, the "
                     "trained weights and optimizer state fp32, autocast; it learns like fp32: bench/README.md); "
                     "bf16: false keeps fp32")


def bf16_by_default(spec: Any) -> bool:
    """bf16 left unset turns on for training where backend.core.precision says the spec takes the default (LoRA
    SFT / PT, from the stage and method declarations) and this machine is a CPU with native bf16 matmul that
    torch's oneDNN uses (not a GPU)."""
    return bf16_default_applies(spec) and not torch.cuda.is_available() and cpu_bf16_supported()


def compute_dtype(spec: Any, warn: Warn | None = None, *, training: bool = True) -> torch.dtype:
    """bf16 / fp16 where the spec asks and the machine runs it fast, else fp32: bf16 on a GPU that supports it
    or a CPU with native bf16 matmul (the model loads in bf16, trained weights stay fp32, and the Trainer's
    bf16=True runs the steps under autocast); fp16 on a GPU only. Elsewhere the request falls back to fp32 and
    the stage must pass bf16=False to the Trainer: call this without `warn` to ask again silently. bf16 left unset
    is on for training where bf16_by_default says so (inference keeps fp32 then)."""
    if training and bf16_by_default(spec):
        return torch.bfloat16
    if _get(spec, "bf16", False) or _get(spec, "pure_bf16", False):
        if bf16_supported():
            return torch.bfloat16
        if warn:
            warn("bf16 requested but not supported on this machine: training in fp32")
        return torch.float32
    if _get(spec, "fp16", False):
        if torch.cuda.is_available():
            return torch.float16
        if warn:
            warn("fp16 requested but not supported on this machine: training in fp32")
        return torch.float32
    return torch.float32


def _supports_sdpa(folder: Path, trust_remote_code: bool = False) -> bool:
    """Whether the model class behind config.json has an SDPA path (Gemma 2, for one, has not)."""
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        return bool(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", True))
    except Exception:  # remote code or an unknown class: let transformers decide when loading
        return True


def attention_implementation(spec: Any, warn: Warn | None = None, *, supports_sdpa: bool = True) -> str:
    """flash_attn: auto -> sdpa where the model has it (else eager), sdpa -> sdpa, disabled -> eager,
    fa2/fa3 -> flash_attention_2/3 if the package imports and a GPU is there, else the auto choice with
    a warning."""
    fallback = "sdpa" if supports_sdpa else "eager"
    choice = str(_get(spec, "flash_attn", "auto")).lower()
    if choice == "auto":
        return fallback
    if choice == "sdpa":
        if not supports_sdpa and warn:
            warn("flash_attn=sdpa requested but this model has no SDPA attention: using eager")
        return fallback
    if choice == "disabled":
        return "eager"
    if choice in ("fa2", "fa3"):
        package = "flash_attn" if choice == "fa2" else "flash_attn_interface"
        try:
            importlib.import_module(package)
            if torch.cuda.is_available():
                return "flash_attention_2" if choice == "fa2" else "flash_attention_3"
        except Exception:  # not installed, or built against another torch/CUDA
            pass
        if warn:
            warn(f"flash_attn={choice} requested but flash-attn is not installed / no GPU: "
                 f"using {'SDPA' if supports_sdpa else 'eager attention'}")
        return fallback
    raise ValueError(f"flash_attn: unknown value '{choice}' (choose auto, sdpa, fa2, fa3, disabled)")


def _apply_liger(model, warn: Warn) -> None:
    """Patch this model instance with liger's kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)."""
    try:
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance  # optional dependency: imported only where it is used
        except ImportError:  # older releases keep it in monkey_patch
            from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance  # optional dependency: imported only where it is used
        _apply_liger_kernel_to_instance(model=model)
        model.tuneboard_liger = True
    except Exception as exc:  # an unsupported family or an old liger must not kill the run
        warn(f"enable_liger_kernel: liger could not patch {model.config.model_type} ({exc}): using plain ops")


def quantization_config(spec: Any, dtype: torch.dtype):
    """BitsAndBytesConfig for quantization_bit 4|8, or None."""
    bits = _get(spec, "quantization_bit", None)
    if bits in (None, 0):
        return None

    bits = int(bits)
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    if bits == 4:
        quant_type = str(_get(spec, "quantization_type", "nf4")).lower()
        if quant_type not in ("nf4", "fp4"):
            raise ValueError(f"quantization_type: '{quant_type}' is not one of nf4, fp4")
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=bool(_get(spec, "double_quantization", True)),
            bnb_4bit_compute_dtype=dtype,
        )
    raise ValueError(f"quantization_bit: {bits} is not supported (choose 4 or 8, through bitsandbytes)")


def keep_4bit_layout_trainable(model) -> int:
    """Switch off bitsandbytes' CPU inference repacking on every 4-bit layer of a model that will train; returns
    how many layers. On a CPU with avx512_bf16, Linear4bit.forward in eval mode without grad (our padding-free
    probe, an evaluation) rewrites the weight into an AVX512-BF16 layout (`_convert_weight_packed_for_cpu`),
    and from then on matmul_4bit runs `gemv_4bit`, which has no autograd kernel: the backward stops at every
    base layer (measured: the LoRA gradients of all but the last layer became 0), and under DeepSpeed ZeRO-3
    the repacked weight, partitioned, breaks the checkpoint's state_dict ('packed_weight should be [N, K/2]'
    in `_convert_weight_packed_for_cpu_inverse`). The guard is the layer's own `support_avx512bf16_for_cpu`."""
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def load_model(spec: Any, resolved: ResolvedModel, *, for_training: bool = True, warn: Warn | None = None,
               reward_head: bool = False):
    """The base model, ready for apply_finetuning(): dtype from bf16/fp16 (fp32 fallback), attention from
    flash_attn, liger patches where a GPU can run them, bitsandbytes 4/8-bit + prepare_model_for_kbit_training
    for QLoRA, gradient checkpointing. GGUF models load from their materialized folder.
    reward_head: the model with a one-output score head instead of the LM head (a reward model: stage rm);
    the head is new (random) unless the folder is a saved reward model."""
    warn = warn or _default_warn
    folder = model_folder(resolved)
    remote = bool(_get(spec, "trust_remote_code", False))
    dtype = compute_dtype(spec, warn, training=for_training)
    attn = attention_implementation(spec, warn, supports_sdpa=_supports_sdpa(folder, remote))
    quant = quantization_config(spec, dtype)
    if quant is not None and not method(_get(spec, "finetuning_type", None)).quantized_base and for_training:
        raise ValueError(
            f"quantization_bit={_get(spec, 'quantization_bit')} needs finetuning_type: "
            f"{' or '.join(quantizable_methods())} (QLoRA); got '{_get(spec, 'finetuning_type')}'"
        )
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn}
    if reward_head:
        kwargs["num_labels"] = 1
    if quant is not None:
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = {"": torch.cuda.current_device()} if torch.cuda.is_available() else {"": "cpu"}
    if remote:
        kwargs["trust_remote_code"] = True
    if _get(spec, "rope_scaling", None):
        kwargs["config"] = rope_scaled_config(spec, folder, remote, warn)

    try:
        auto_class = AutoModelForSequenceClassification if reward_head else AutoModelForCausalLM
        model = auto_class.from_pretrained(folder, **kwargs)
    except ImportError as exc:
        if attn == "flash_attention_2":
            raise
        raise ValueError(f"cannot load {resolved.model_id} from {folder}: {exc}") from exc
    if _get(spec, "resize_vocab", False) or _get(spec, "new_special_tokens", None):
        resize_vocab(model, spec, resolved, warn)

    if _get(spec, "enable_liger_kernel", False):
        if liger_usable():
            _apply_liger(model, warn)
        else:
            warn("enable_liger_kernel requested but liger-kernel is not installed / no GPU: using plain ops")

    if not for_training:
        model.eval()
        return model

    model.config.use_cache = False  # caching is for generation; with checkpointing it is an error
    checkpointing = gradient_checkpointing_on(spec)

    if checkpointing:
        choose(spec, model)  # selective or plain, from the memory it would take (backend/core/checkpointing.py)

    if quant is not None:
        keep_4bit_layout_trainable(model)
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs=checkpoint_kwargs(),
        )
    elif checkpointing:
        # transformers 5 renamed it; the old name still works but warns
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs())
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs())
    if checkpointing:
        # adapters on frozen embeddings need an input that requires grad for the backward to reach them
        model.enable_input_require_grads()
    return model


# Attention implementations that honour packed position_ids: transformers builds a block-diagonal causal mask
# from them for sdpa/eager (masking_utils.find_packed_sequence_indices) and flash-attention derives cu_seqlens.
PADDING_FREE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def padding_free_problem(model) -> str | None:
    """None when padding-free batches (backend.dataprep.preprocess.PaddingFreeCollator: rows concatenated with
    per-row position_ids) compute exactly what the padded batch does on this model, else the reason.

    The attention implementation must be one that honours packed position_ids, and a probe on the model
    itself must agree: two short rows run concatenated give the logits of the same rows run alone. The probe
    catches what a name check cannot (remote code, a family whose forward ignores position_ids, recurrent
    layers, an adapter or patch that changes attention). It runs in eval mode without gradients (a few
    tokens, well under a second) and leaves the model's mode and the global RNG as they were."""
    config = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in PADDING_FREE_ATTENTION:
        return f"attention '{attn}' does not take per-row position_ids"
    if is_reward_model(model):
        return "a reward head scores each row's last token"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if vocab < 2:
        return "the model has no vocabulary size to probe with"
    try:
        device = next(p.device for p in model.parameters())
    except StopIteration:
        return "the model has no parameters"
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, min(vocab, 4096), (n,), generator=gen).to(device) for n in (7, 5)]
    flat_ids = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None].to(device)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            flat = model(input_ids=flat_ids, position_ids=positions, use_cache=False).logits[0].float()
            alone = torch.cat([model(input_ids=r[None], use_cache=False).logits[0].float() for r in rows])
    except Exception as exc:  # a model that cannot take position_ids this way keeps padding
        return f"the padding-free probe failed ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
    error = (flat - alone).abs().max().item() / max(1.0, alone.abs().max().item())
    # half-precision arithmetic rounds the two ways differently: the weights' dtype, or a 4-bit layer's compute dtype
    half = _param_dtype(model) != torch.float32 or any(
        getattr(m, "compute_dtype", None) in (torch.bfloat16, torch.float16) for m in model.modules())
    tolerance = 3e-2 if half else 1e-3
    if not error <= tolerance:
        return f"rows attend to each other when concatenated (relative logit error {error:.2g})"
    return None


def _causal_lm(model):
    """The ...ForCausalLM module inside a (peft-wrapped) model, or None."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner if type(inner).__name__.endswith("ForCausalLM") and hasattr(inner, "get_decoder") else None


def install_chunked_loss(model) -> str | None:
    """Make the model's training forward compute its loss with backend.training.losses.causal_lm_loss (the last hidden
    state projected in chunks, only where there are labels: never the full logits). Returns None when
    installed, else the reason it was not (the plain loss stays).

    The family's own forward still runs everything up to the head; it is asked for no logits
    (logits_to_keep = no position) and a hook on the decoder hands over the last hidden state. Only for a
    plain nn.Linear head (a peft-wrapped or resized head keeps the plain path); Gemma's final logit
    soft-capping is applied. A probe on the model itself then compares the chunked loss with the plain one
    on a few random tokens, so a family whose head does anything else (logit scaling, a hidden-state
    multiplier) keeps the plain path. Eval and generation (eval mode, no labels) always take the plain
    forward. A model patched by Liger (enable_liger_kernel on a GPU) already has its fused loss."""
    lm = _causal_lm(model)
    if lm is None:
        return f"{type(model).__name__} is not a causal LM"
    if getattr(model, "tuneboard_liger", False) or getattr(lm, "tuneboard_liger", False):
        return "Liger's fused linear cross-entropy is installed"
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain Linear"
    decoder = lm.get_decoder()
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    softcap = getattr(text, "final_logit_softcapping", None) or None
    plain_forward = lm.forward

    def chunked_forward(*args, labels=None, logits_to_keep=0, **kwargs):
        if labels is None or not (lm.training or lm.tuneboard_probe) or kwargs.get("return_dict") is False \
                or not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            return plain_forward(*args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        captured = []
        hook = decoder.register_forward_hook(lambda module, inputs, output: captured.append(
            output[0] if isinstance(output, tuple) else output.last_hidden_state))
        try:
            nothing = torch.zeros(0, dtype=torch.long, device=head.weight.device)
            out = plain_forward(*args, labels=None, logits_to_keep=nothing, **kwargs)
        finally:
            hook.remove()
        out["loss"] = causal_lm_loss(captured[-1], head.weight, head.bias, labels,
                                     num_items_in_batch=kwargs.get("num_items_in_batch"),
                                     shift_labels=kwargs.get("shift_labels"), softcap=softcap)
        return out

    lm.tuneboard_probe = True
    lm.forward = chunked_forward
    try:
        problem = _probe_chunked_loss(model, lm, plain_forward)
    finally:
        lm.tuneboard_probe = False
    if problem:
        lm.forward = plain_forward
        return problem
    lm.tuneboard_chunked_loss = True
    return None


def _probe_chunked_loss(model, lm, plain_forward) -> str | None:
    """None when the chunked loss equals the plain loss on a few random tokens of this model."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    device = lm.get_output_embeddings().weight.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(int(config.vocab_size), 4096), (2, 9), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :3] = -100
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            plain = plain_forward(input_ids=ids, labels=labels, use_cache=False).loss.float().item()
            chunked = model(input_ids=ids, labels=labels, use_cache=False).loss.float().item()
    except Exception as exc:  # a family whose forward takes no logits_to_keep tensor, ...
        return f"the chunked-loss probe failed ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
    tolerance = 1e-4 if _param_dtype(lm) == torch.float32 else 2e-2
    if not abs(chunked - plain) <= tolerance * max(1.0, abs(plain)):
        return f"its head is not a plain projection (chunked loss {chunked:.6g} vs plain {plain:.6g})"
    return None


def _param_dtype(model) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def gradient_checkpointing_on(spec: Any) -> bool:
    """LLaMA-Factory's default: checkpointing is on for training unless the spec says
    gradient_checkpointing: false or disable_gradient_checkpointing: true (unset = on). It costs a second
    forward per layer and saves most activation memory: the guide's recipe (cutoff 4096, batch 4) needs it
    to fit in 24 GiB."""
    return _get(spec, "gradient_checkpointing", None) is not False and not _get(spec, "disable_gradient_checkpointing", False)


def resize_vocab(model, spec: Any, resolved: ResolvedModel, warn: Warn) -> None:
    """Grow the input and output embeddings to the tokenizer's size (with new_special_tokens added), padded to
    a multiple of 64 as LLaMA-Factory does; the new rows start at the mean of the old ones (transformers'
    mean_resizing). Marks the model so that apply_finetuning trains the embeddings and a LoRA adapter saves
    them (modules_to_save), and the same spec at chat/export time rebuilds the same shapes."""
    tokenizer = load_tokenizer(resolved, trust_remote_code=bool(_get(spec, "trust_remote_code", False)),
                               new_special_tokens=_get(spec, "new_special_tokens", None))
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) <= rows:
        warn(f"resize_vocab: the embeddings ({rows} rows) already hold the tokenizer's {len(tokenizer)} tokens: "
             "nothing to resize")
        return
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    model.tuneboard_resized_vocab = True
    logger.info("resized the embeddings from %d to %d rows", rows, model.get_input_embeddings().weight.shape[0])


def rope_scaled_config(spec: Any, folder: Path, remote: bool, warn: Warn):
    """The model config with LLaMA-Factory's rope_scaling: factor ceil(cutoff_len / max_position_embeddings),
    max_position_embeddings raised by that factor (not for dynamic: transformers' dynamic NTK starts
    rescaling past max_position_embeddings), the original length kept for dynamic / yarn / llama3
    (llama3 with Meta's low/high frequency factors 1 and 4). Only where cutoff_len exceeds the model's
    positions (else nothing would change: an error, as validate says for local folders)."""
    kind = str(_get(spec, "rope_scaling"))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=remote)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    params = getattr(text, "rope_parameters", None)
    nested = isinstance(params, dict) and hasattr(text, "nested_rope_parameter_keys") and \
        text.nested_rope_parameter_keys(params)
    if not isinstance(limit, int) or not isinstance(params, dict) or nested:
        raise ValueError(f"rope_scaling: {getattr(text, 'model_type', 'this model')} has no single RoPE setting "
                         "to scale; drop rope_scaling")
    cutoff = int(_get(spec, "cutoff_len", 1024))
    if cutoff <= limit:
        raise ValueError(f"rope_scaling: it stretches the model's {limit} positions to cover cutoff_len (factor "
                         f"ceil(cutoff_len / {limit})), and cutoff_len {cutoff} fits already: raise cutoff_len "
                         f"above {limit} or drop rope_scaling")
    factor = float(math.ceil(cutoff / limit))
    scaled = {**params, "rope_type": kind, "factor": factor}
    if kind in ("dynamic", "yarn", "llama3"):
        scaled["original_max_position_embeddings"] = limit
    if kind == "llama3":
        scaled.setdefault("low_freq_factor", 1.0)
        scaled.setdefault("high_freq_factor", 4.0)
    text.rope_parameters = scaled
    if kind != "dynamic":  # transformers' dynamic NTK rescales past max_position_embeddings: keep the original
        text.max_position_embeddings = int(limit * factor)
    warn(f"rope_scaling {kind}: factor {factor:g} ({limit} -> {int(limit * factor)} positions)")
    return config


# --------------------------------------------------------------------------------------------- optimizers
def install_optimizer(trainer, spec: Any) -> None:
    """LoRA+ (loraplus_lr_ratio) and GaLore (use_galore) build their own optimizer: hook it into the Trainer's
    create_optimizer (called once the model is placed), as LLaMA-Factory's trainers do. No-op otherwise."""
    if not (_get(spec, "loraplus_lr_ratio", None) or _get(spec, "use_galore", False)):
        return
    default = trainer.create_optimizer

    def create_optimizer(model=None):
        if trainer.optimizer is None:
            trainer.optimizer = build_optimizer(spec, model or trainer.model, trainer.args)
        return default(model) if model is not None else default()

    trainer.create_optimizer = create_optimizer


def build_optimizer(spec: Any, model, args):
    """The LoRA+ or GaLore optimizer for this model and these TrainingArguments (see install_optimizer)."""
    from transformers import Trainer  # the trainer stack (accelerate): only a training run pays for it

    if _get(spec, "use_galore", False):
        galore = copy.copy(args)  # the TrainingArguments of transformers' own GaLore optimizers
        galore.optim = GALORE_OPTIMIZERS.get(args.optim, args.optim)
        targets = _split(_get(spec, "galore_target", "all")) or ["all"]
        available = find_all_linear_modules(model)
        if targets == ["all"]:
            targets = available
        else:
            _check_names("galore_target", targets, available)
        # names ending in .<target> (transformers would also take a target found anywhere inside a name)
        galore.optim_target_modules = [rf".*\.{re.escape(t)}" for t in targets]
        galore.optim_args = (f"rank={int(_get(spec, 'galore_rank', 16))},"
                             f"update_proj_gap={int(_get(spec, 'galore_update_interval', 200))},"
                             f"scale={float(_get(spec, 'galore_scale', 2.0))},proj_type=std")
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(galore, model)
        params = kwargs.pop("params")
        return optimizer_cls(params, **kwargs)

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs = {k: v for k, v in kwargs.items() if k != "lr"}
    return create_loraplus_optimizer(model, optimizer_cls, lr=args.learning_rate,
                                     loraplus_lr_ratio=float(_get(spec, "loraplus_lr_ratio")),
                                     loraplus_weight_decay=args.weight_decay, **kwargs)


def describe_model(model) -> str:
    """One log line saying what really runs: dtype, attention, quantization, Liger."""
    config = getattr(model, "config", None)
    parts = [f"dtype {getattr(model, 'dtype', '?')}", f"attention {getattr(config, '_attn_implementation', '?')}"]
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        bits = 4 if getattr(quant, "load_in_4bit", False) else 8 if getattr(quant, "load_in_8bit", False) else "?"
        kind = getattr(quant, "bnb_4bit_quant_type", "") if bits == 4 else "int8"
        parts.append(f"bitsandbytes {bits}-bit {kind}".rstrip())
    if getattr(model, "tuneboard_liger", False):
        parts.append("Liger kernels")
    device = getattr(model, "device", "?")
    parts.append(f"device {device}")
    if getattr(device, "type", None) == "cpu":  # which kernels: AVX512, or AVX2 (such a CPU, or ATEN_CPU_CAPABILITY=avx2)
        parts.append(f"CPU kernels {torch.backends.cpu.get_cpu_capability()}")
    return ", ".join(parts)
