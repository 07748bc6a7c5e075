"""Open a GGUF file in llama.cpp (llama-cpp-python, the optional `llamacpp` extra), for the export check
(backend/exporting/llamacpp_check.py) and the llama.cpp chat engine (backend/serving/engine.py).

Why not plain `llama_cpp.Llama(path)`: on this machine class (a Xeon with AMX, in a VM) llama.cpp's "extra
buffer types" (its AMX and weight-repacking CPU kernels) crash the first decode with a segmentation fault,
even on the bundled SmolLM2 GGUF. llama.cpp turns them off with the model parameter use_extra_bufts = false
(llama-cli's --no-repack), which Llama() does not expose: its default model parameters are swapped for
that one call. The plain CPU kernels run every GGUF type.
"""
from __future__ import annotations

import threading

_SWAP = threading.Lock()


def open_llama(path: str, **kwargs):
    """llama_cpp.Llama(model_path=path, **kwargs) without the extra CPU buffer types."""
    import llama_cpp  # optional dependency (the llamacpp extra): loaded only where llama.cpp runs
    from llama_cpp import llama_cpp as bindings  # the module Llama() takes its default model parameters from

    with _SWAP:
        default = bindings.llama_model_default_params

        def no_extra_buffers():
            params = default()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = no_extra_buffers
        try:
            return llama_cpp.Llama(model_path=path, **kwargs)
        finally:
            bindings.llama_model_default_params = default
