"""llama.cpp as an optional dependency (the `llamacpp` extra: llama-cpp-python, which compiles llama.cpp from
its source package: a few minutes once, then pip's wheel cache). Light: it only asks whether the package is
installed (importlib.util.find_spec), so the spec and the web UI can refuse what needs it, with how to get it.

What needs it: the k-quant GGUF types (llama.cpp's quantizer writes them; the `gguf` package can only read
them). Every GGUF export is also checked in llama.cpp when it is installed (backend/exporting/llamacpp_check.py).
"""
from __future__ import annotations

import importlib.util

from backend.core.refusals import REFUSED

# export_gguf_type -> llama.cpp's llama_ftype name (llama_cpp.LLAMA_FTYPE_MOSTLY_<name>)
QUANT_TYPES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q4_0": "Q4_0"}
# perplexity on the held-out rows may rise by this share of the f16 file's before the export warns
PPL_WARN = {"f32": 0.01, "bf16": 0.01, "q8_0": 0.01, "q6_k": 0.02, "q5_k_m": 0.04, "q4_k_m": 0.06, "q4_0": 0.10}
# greedy answers, teacher-forced along the adapter's: where llama.cpp's top token is another, the adapter's own
# log-probability gap between the two (nats) up to which that is a near-tie the type's rounding may turn over; above it
# the export warns. About 4x the root-mean-square shift each type gave the log-probabilities of the adapter's tokens
# on the default model (bench/README.md, 2026-12-05: q8_0 0.048, q6_k 0.07-0.10, q4_k_m 0.27); q5_k_m and q4_0
# lie between and beyond those, not measured.
GREEDY_NEAR_TIE = {"f32": 0.1, "f16": 0.1, "bf16": 0.1, "q8_0": 0.2, "q6_k": 0.4, "q5_k_m": 0.7, "q4_k_m": 1.0,
                   "q4_0": 1.4}
HOW_TO_GET = "`make setup-gguf` builds it once (llama-cpp-python from source, a few minutes; pip caches the wheel)"


def available() -> bool:
    """llama-cpp-python is installed (not imported: importing it loads the compiled library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def missing(what: str) -> str:
    """The refusal of `what` when llama-cpp-python is not installed."""
    return f"{REFUSED}: {what} needs llama.cpp (the llama-cpp-python package), which is not installed: {HOW_TO_GET}"


def _serving_errors(spec) -> list[tuple[str, str, frozenset]]:
    """infer_backend llamacpp serves one GGUF file as it is (backend.serving.engine._load_llamacpp says the same at
    launch): no adapter, and model_name_or_path a .gguf file or a folder holding one."""
    if spec.infer_backend != "llamacpp":
        return []
    if spec.adapter_name_or_path:
        return [("infer_backend", "llamacpp serves a GGUF file as it is: merge the adapter into one first (tuneboard "
                 "export with export_format: gguf) and serve that file, or use infer_backend: huggingface",
                 frozenset({"infer_backend", "adapter_name_or_path"}))]
    from backend.core.model_files import locate  # light; here so this module's top stays a find_spec

    try:
        _, gguf = locate(spec.model_name_or_path)
    except ValueError:  # a model that is not there: validate's model check says why
        return []
    if gguf:
        return []
    return [("infer_backend", f"llamacpp needs a .gguf file (or an export folder holding one): model_name_or_path "
             f"{spec.model_name_or_path} is a transformers folder; export it with export_format: gguf, or use "
             "infer_backend: huggingface", frozenset({"infer_backend", "model_name_or_path"}))]


def spec_errors(spec) -> list[tuple[str, str, frozenset]]:
    """validate's rule: a k-quant GGUF type is written by llama.cpp's quantizer, export_imatrix weights that
    quantizer (so it needs one of its types), and infer_backend llamacpp runs llama.cpp: all need the package.
    infer_backend llamacpp serves one GGUF file, without an adapter (_serving_errors)."""
    errors = []
    if spec.export_imatrix and not (spec.export_format == "gguf" and spec.export_gguf_type in QUANT_TYPES):
        errors.append(("export_imatrix", "weights llama.cpp's quantizer: it needs export_format gguf with an "
                       f"export_gguf_type it quantizes ({', '.join(QUANT_TYPES)}); {spec.export_gguf_type} is not one"
                       if spec.export_format == "gguf" else "weights llama.cpp's quantizer of a GGUF export: set "
                       f"export_format gguf with export_gguf_type {', '.join(QUANT_TYPES)}",
                       frozenset({"export_imatrix", "export_gguf_type", "export_format"})))
    errors.extend(_serving_errors(spec))
    if available():
        return errors
    if spec.export_format == "gguf" and spec.export_gguf_type in QUANT_TYPES:
        errors.append(("export_gguf_type", missing(f"export_gguf_type {spec.export_gguf_type} (a k-quant GGUF, written "
                                                   "by llama.cpp's quantizer)"), frozenset({"export_gguf_type", "export_format"})))
    if spec.export_imatrix:
        errors.append(("export_imatrix", missing("export_imatrix (an importance matrix for llama.cpp's quantizer)"),
                       frozenset({"export_imatrix"})))
    if spec.infer_backend == "llamacpp":
        errors.append(("infer_backend", missing("infer_backend llamacpp"), frozenset({"infer_backend"})))
    return errors
