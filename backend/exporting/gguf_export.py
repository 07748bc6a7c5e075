"""HF decoder model (Llama, Mistral, Qwen2, Qwen3, Gemma2) -> one GGUF file, written with the `gguf`
package's GGUFWriter.

Why our own (small) converter: the `gguf` package has the writer, the tensor name map and the
quantizers but no HF converter, and llama.cpp's convert_hf_to_gguf.py is an external script that
rejects tokenizers it does not know by hash. This follows that script for these architectures: the
same metadata keys, tensor names (gguf.get_tensor_name_map), the q/k RoPE row permutation where
llama.cpp uses it (llama, mistral), Gemma's norm weights stored as 1 + w, 1-D tensors kept in f32, and
a gpt2 (byte-level BPE) vocabulary with token types and merges.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backend.core.export_rules import GGUF_ARCHS as ARCHS, gguf_model_problem

SUPPORTED_ARCHS = tuple(ARCHS)
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")


class GGUFExportError(ValueError):
    pass


def check_supported(config) -> None:
    """Raise GGUFExportError unless this model can be written by write_gguf()."""
    rope = _rope_parameters(config)
    problem = gguf_model_problem(getattr(config, "model_type", None), rope.get("rope_type") or rope.get("type"))
    if problem:  # validate says the same from config.json (backend/core/export_rules.py)
        raise GGUFExportError(problem)


def _rope_parameters(config) -> dict:
    rope = getattr(config, "rope_parameters", None) or {}
    if not rope and getattr(config, "rope_scaling", None):
        rope = dict(config.rope_scaling)
    return dict(rope)


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = _rope_parameters(config).get("rope_theta", 10000.0)
    return float(theta)


def permute_qk(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF's rotate-half layout -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def detect_pre_tokenizer(tokenizer_json: dict) -> str:
    """llama.cpp's tokenizer.ggml.pre name from the tokenizer.json pre-tokenizer's shape."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    items = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [p.get("type") for p in items]
    if "Digits" in types and "ByteLevel" in types:
        return "smollm"
    patterns = json.dumps(items)
    if "Split" in types and "p{N}{1,3}" in patterns:
        return "llama-bpe"
    if "Split" in types and "p{N}" in patterns:
        return "qwen2"
    return "gpt-2"  # llama.cpp's name for GPT-2's byte-level split ("gpt2" is the tokenizer model, not a pre)


def vocab_metadata(tokenizer, vocab_size: int) -> dict:
    """tokens, token types, merges, pre for a byte-level BPE tokenizer (GGUF tokenizer model "gpt2")."""
    import gguf  # heavy: loaded on use, so importing this module stays light

    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    model = tj.get("model", {})
    if model.get("type") != "BPE" or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise GGUFExportError("GGUF export supports byte-level BPE (GPT-2 style) tokenizers for now; this "
                              f"tokenizer is {model.get('type')!r} with a {(tj.get('decoder') or {}).get('type')!r} decoder")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            if i in added:
                types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
            else:
                types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges, "pre": detect_pre_tokenizer(tj)}


def _tensor_data(name: str, data: np.ndarray, gguf_type: str):
    """(array, raw_dtype or None) in the requested type; 1-D tensors stay f32 as llama.cpp keeps them."""
    import gguf  # heavy: loaded on use, so importing this module stays light
    from gguf.quants import quantize  # heavy: loaded on use, so importing this module stays light

    if data.ndim <= 1 or gguf_type == "f32":
        return data.astype(np.float32), None
    if gguf_type == "f16":
        return data.astype(np.float16), None
    if gguf_type == "bf16":
        return quantize(data.astype(np.float32), gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    if gguf_type == "q8_0":
        if data.shape[-1] % 32 == 0:
            return quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return data.astype(np.float16), None
    raise GGUFExportError(f"export_gguf_type: unknown type {gguf_type!r} (choose {', '.join(GGUF_TYPES)})")


def tensor_namer(config):
    """hf tensor name -> its GGUF name (None where the map has none), as write_gguf() names it: the importance
    matrix (backend/exporting/imatrix.py) is keyed by these names, which llama.cpp's quantizer looks up."""
    import gguf  # heavy: loaded on use, so importing this module stays light

    check_supported(config)
    arch, _ = ARCHS[config.model_type]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    return lambda hf_name: tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def write_gguf(path: Path, state_dict: dict, config, tokenizer, *, gguf_type: str, chat_template: str,
               eot_token_id: int | None, name: str, log=print) -> dict:
    """Write the model (fp32 state dict) as GGUF; return a summary of what went in."""
    import gguf  # heavy: loaded on use, so importing this module stays light

    check_supported(config)
    if gguf_type not in GGUF_TYPES:
        raise GGUFExportError(f"export_gguf_type: unknown type {gguf_type!r} (choose {', '.join(GGUF_TYPES)})")
    n_layers, n_head = config.num_hidden_layers, config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    vocab_size = config.vocab_size
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]

    arch, permute = ARCHS[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // n_head or arch == "gemma2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(file_type)

    vocab = vocab_metadata(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    special = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
               "pad": tokenizer.pad_token_id}
    if special["bos"] is not None:
        writer.add_bos_token_id(special["bos"])
    writer.add_eos_token_id(special["eos"])
    if special["unk"] is not None:
        writer.add_unk_token_id(special["unk"])
    if special["pad"] is not None:
        writer.add_pad_token_id(special["pad"])
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    probe = tokenizer("a").input_ids
    writer.add_add_bos_token(bool(special["bos"] is not None and probe and probe[0] == special["bos"]))
    writer.add_add_eos_token(bool(special["eos"] is not None and probe and probe[-1] == special["eos"]))
    writer.add_chat_template(chat_template)

    gguf_name = tensor_namer(config)
    tied = bool(getattr(config, "tie_word_embeddings", False)) or arch == "gemma2"
    written = 0
    for hf_name, tensor in state_dict.items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        gname = gguf_name(hf_name)
        if gname is None:
            raise GGUFExportError(f"GGUF export: no GGUF name for tensor {hf_name!r}")
        data = tensor.detach().float().cpu().numpy()
        if permute and hf_name.endswith("self_attn.q_proj.weight"):
            data = permute_qk(data, n_head, n_head)
        elif permute and hf_name.endswith("self_attn.k_proj.weight"):
            data = permute_qk(data, n_head, n_kv)
        elif arch == "gemma2" and hf_name.endswith("norm.weight"):
            data = data + 1  # Gemma's RMSNorm scales by (1 + w); llama.cpp stores the sum
        array, raw = _tensor_data(gname, data, gguf_type)
        if raw is None:
            writer.add_tensor(gname, array)
        else:
            writer.add_tensor(gname, array, raw_dtype=raw)
        written += 1
    log(f"writing {written} tensors ({gguf_type}) to {path}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"tensors": written, "gguf_type": gguf_type, "pre_tokenizer": vocab["pre"], "vocab_size": vocab_size,
            "special_ids": {k: v for k, v in special.items() if v is not None} | (
                {"eot": eot_token_id} if eot_token_id is not None else {})}
