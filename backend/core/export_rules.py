"""validate's rules for `tuneboard export` that read files: where export_dir is and what it holds, and whether a GGUF
export can write this model. Light (no torch): the spec imports it, and so does the export itself, which says the same
lines again before it loads anything (backend/exporting/export.py check_request), so a request refused here never
starts.

- export_dir: not a file, not under a file, its parent writable (the export is written to a hidden sibling and moved
  into place), empty unless export_overwrite, and never holding a source: a folder that is, contains or is inside the
  model's files (a local folder, a .gguf file, or a hub id's folder in the Hugging Face cache, whatever the name's
  form) or an adapter folder is refused: replacing export_dir deletes what it holds.
- GGUF: the model's config.json has a model_type the GGUF writer knows (GGUF_ARCHS, the one table
  backend/exporting/gguf_export.py writes by) and plain RoPE (GGUF_ROPE_TYPES); rope_scaling is refused there.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from backend.core.model_files import locate
from backend.core.refusals import REFUSED
from backend.core.rundir import reward_model_folder

# HF model_type -> (GGUF architecture, q/k rows permuted as llama.cpp's llama converter does)
GGUF_ARCHS = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
              "qwen3": ("qwen3", False), "gemma2": ("gemma2", False)}
# RoPE types the GGUF writer writes (llama.cpp's llama3 frequency factors, linear / yarn scaling are not written)
GGUF_ROPE_TYPES = ("default",)


def gguf_model_problem(model_type, rope_type) -> str | None:
    """Why a model with this config cannot be written as GGUF (None when it can): the export's and validate's line."""
    if model_type not in GGUF_ARCHS:
        return (f"GGUF export supports model_type {', '.join(GGUF_ARCHS)} for now; this model is {model_type!r}: "
                "export safetensors instead (export_format: safetensors)")
    if (rope_type or "default") not in GGUF_ROPE_TYPES:
        return (f"GGUF export: RoPE scaling {rope_type!r} is not supported yet (the GGUF writer writes plain RoPE "
                "only; llama.cpp would run the model with other positions): export safetensors instead "
                "(export_format: safetensors)")
    return None


def config_rope_type(config: dict) -> str | None:
    """The RoPE type of a config.json (transformers' rope_parameters, or the older rope_scaling)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path.expanduser()))


def source_paths(spec) -> list[Path]:
    """What an export reads and must never delete: the model's files (its folder, its .gguf file, or a hub id's
    whole folder in the Hugging Face cache: snapshots and the blobs they link to) and each adapter folder."""
    out = []
    try:
        folder, gguf = locate(spec.model_name_or_path)
    except ValueError:  # validate's model check says why; nothing of it exists to protect
        folder, gguf = None, None
    if folder is not None:
        given = Path(str(spec.model_name_or_path)).expanduser()
        if gguf and given.is_file():
            out.append(_real(given))
        elif folder.parent.name == "snapshots":  # a hub id: models--org--name/snapshots/<rev>
            out.append(_real(folder.parent.parent))
        else:
            out.append(_real(folder))
    for name in str(spec.adapter_name_or_path or "").split(","):
        if name.strip() and Path(name.strip()).expanduser().exists():
            out.append(_real(Path(name.strip())))
    return out


def holds_source(folder: Path, sources: list[Path]) -> Path | None:
    """The first source that `folder` is, contains or is inside, else None."""
    folder = _real(folder)
    for source in sources:
        if folder == source or folder in source.parents or source in folder.parents:
            return source
    return None


NAME_MAX = 255  # the longest file name Linux file systems take
STAGING_SUFFIX = len(".partial-") + 1 + 7  # export.py's hidden sibling .<name>.partial-<pid> (pids up to 7 digits)


def export_dir_problem(spec) -> str | None:
    """What is wrong with export_dir for this export (None when it can be written): the one line after 'export_dir: '."""
    out = _real(Path(spec.export_dir))
    if len(out.name) + STAGING_SUFFIX > NAME_MAX or any(len(part) > NAME_MAX for part in out.parts):
        return (f"the name {out.name[:40]}... is too long ({len(out.name)} characters): the export is written beside "
                f"it as .<name>.partial-<pid>, whose name must fit {NAME_MAX} characters")
    try:
        return _dir_problem(spec, out)
    except OSError as exc:  # a path the system refuses to look at (too long, a loop of links, ...)
        return f"cannot use {out}: {exc.strerror or exc}"


def _dir_problem(spec, out: Path) -> str | None:
    source = holds_source(out, source_paths(spec))
    if source is not None:
        return f"{out} holds the source {source} (or lies inside it); writing there would destroy it"
    if out.exists() and not out.is_dir():
        return f"{out} exists and is a file"
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot create {out}: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return (f"cannot write {out}: {existing} is not writable (the export is written beside export_dir, then "
                "moved into place)")
    if out.is_dir() and any(out.iterdir()) and not spec.export_overwrite:
        return f"{out} is not empty; choose another folder or set export_overwrite: true to replace its contents"
    return None


def _gguf_errors(spec) -> list[tuple[str, str, frozenset]]:
    errors = []
    if spec.rope_scaling is not None:
        errors.append(("rope_scaling", f"{REFUSED}: a GGUF export runs in llama.cpp with the model's plain RoPE (the "
                       "GGUF writer writes no RoPE scaling): export safetensors (export_format: safetensors) to keep "
                       "rope_scaling, or drop it", frozenset({"rope_scaling", "export_format"})))
    if reward_model_folder(spec.model_name_or_path, spec.adapter_name_or_path):
        return errors  # a reward model has no GGUF at all: the spec's reward_gguf_refusal says why
    try:
        folder, gguf = locate(spec.model_name_or_path)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8")) if not gguf else None
    except (ValueError, OSError):  # a .gguf model is converted on load; a missing model: validate's model check
        config = None
    if isinstance(config, dict):
        problem = gguf_model_problem(config.get("model_type"), config_rope_type(config))
        if problem:
            errors.append(("export_format", f"{problem} ({spec.model_name_or_path})",
                           frozenset({"export_format", "model_name_or_path"})))
    return errors


def export_errors(spec, check_files: bool = True) -> list[tuple[str, str, frozenset]]:
    """validate's export rules that read files, as (field, message, fields involved)."""
    if not check_files:
        return []
    errors = []
    if spec.export_dir:
        problem = export_dir_problem(spec)
        if problem:
            errors.append(("export_dir", problem,
                           frozenset({"export_dir", "export_overwrite"})))
    if spec.export_format == "gguf":
        errors.extend(_gguf_errors(spec))
    return errors
