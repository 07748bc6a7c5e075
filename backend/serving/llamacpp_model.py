"""Open a GGUF file in llama.cpp (llama-cpp-python, the optional `llamacpp` extra), for the export check
(backend/exporting/llamacpp_check.py) and the llama.cpp chat engine (backend/serving/engine.py); and the logits
processor that engine gives llama.cpp for OpenAI's penalties and logit_bias (LlamaTokenPenalties). Light: llama_cpp
and numpy are imported on use.

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


class LlamaTokenPenalties:
    """OpenAI's frequency_penalty, presence_penalty and logit_bias as a llama-cpp-python logits processor (numpy: the
    sequence so far and one position's logits, in token id order): the same arithmetic as
    backend.serving.batching.TokenPenalties, counting the tokens after the first `prompt_len` (the answer's). Not
    llama.cpp's own penalties sampler (Llama.generate's frequency_penalty, presence_penalty), which counts only the
    last `last_n_tokens_size` tokens (64 by default)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float, bias: dict[int, float], n_vocab: int):
        import numpy as np  # comes with llama-cpp-python (the optional dependency): the module top stays light

        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence
        self._counts = np.zeros(n_vocab, dtype=np.float32)
        self._bias = np.zeros(n_vocab, dtype=np.float32)
        for token, value in bias.items():
            self._bias[token] = value
        self._seen = prompt_len

    def __call__(self, input_ids, scores):
        import numpy as np  # comes with llama-cpp-python (the optional dependency): the module top stays light

        if len(input_ids) < self._seen:  # another sequence: count anew
            self._counts[:] = 0
            self._seen = self.prompt_len
        np.add.at(self._counts, np.asarray(input_ids[self._seen:], dtype=np.int64), 1)
        self._seen = max(self._seen, len(input_ids))
        return scores - self._counts * self.frequency - (self._counts > 0) * self.presence + self._bias
