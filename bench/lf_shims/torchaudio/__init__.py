"""An empty stand-in for torchaudio, put on PYTHONPATH for the LLaMA-Factory run only (bench/run.py).

LLaMA-Factory 0.9.5 imports torchaudio when it starts (llamafactory/data/mm_plugin.py, for audio datasets).
No torchaudio build matches torch 2.13 (PyPI's newest is 2.11, whose C library does not load against 2.13), and
the text recipe never calls it. Any use fails loudly."""


def __getattr__(name):
    raise ImportError(f"torchaudio.{name}: torchaudio is a stub in the benchmark (no build matches this torch)")
