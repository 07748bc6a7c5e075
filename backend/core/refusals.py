"""Refusal texts shared by the spec (`tuneboard validate`), the stages' own rules (backend/stages/rules.py) and
the commands that refuse the same thing when they run (`tuneboard export`). Light (no torch), so the spec
and the stage declarations can import it."""

REFUSED = "not supported"  # every refusal starts with it (tests/backend/test_every_key.py looks for it)


def reward_gguf_refusal(holder) -> str:
    """Why a reward model has no GGUF export (also the `tuneboard validate` message)."""
    return (f"gguf holds text-generating (causal LM) models for llama.cpp / Ollama, and {holder} is a reward model "
            "(a one-output score head trained with stage rm): set export_format: safetensors to export it as a "
            "merged AutoModelForSequenceClassification folder")
