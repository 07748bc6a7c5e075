"""Dynamic choice lists read from the repository and the saves folder (plain YAML/JSON, no heavy imports)."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

import yaml

from backend.core import paths, registry
from backend.core.atomic import read_json_dict
from backend.core.dataset_info import DatasetError, read_dataset_info
from backend.core.rundir import CHECKPOINT_PREFIX, LOG_FILE, last_value
from webui import jobs
from webui.i18n import tr


def model_ids() -> list[str]:
    """The bundled default model first, then every id in backend/core/model_registry.yaml."""
    ids = [paths.DEFAULT_MODEL_ID]
    try:
        ids += [m for m in registry.model_ids() if m != paths.DEFAULT_MODEL_ID]
    except (OSError, ValueError, yaml.YAMLError):
        pass
    return ids


def model_info(model: str) -> dict | None:
    """Registry entry of a model id: {"family", "template", "instruct"} (case-insensitive match)."""
    try:
        entry = registry.load_registry().get((model or "").lower())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return None if entry is None else {"family": entry.family, "template": entry.template,
                                       "instruct": entry.instruct}


def template_names() -> list[str]:
    names = sorted(p.stem for p in paths.TEMPLATES_DIR.glob("*.yaml"))
    return ["auto"] + [n for n in names if n != "auto"]


def adapter_choices(root: Path | None = None) -> list[str]:
    """Run dirs that hold an adapter, and their checkpoint-N folders (newest run first)."""
    out = []
    for d in jobs.iter_run_dirs(root):
        if (d / "adapter_config.json").exists() or (d / "adapter_model.safetensors").exists():
            out.append(str(d))
        for ck in sorted(d.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1])
                         if p.name.split("-")[-1].isdigit() else 0, reverse=True):
            out.append(str(ck))
    return out


NO_ADAPTER = "— none: the base model —"  # locale key choice.no_adapter


def adapter_label(run_dir: Path, checkpoint: str | None = None) -> str:
    """A run as the adapter picker names it: model · method · stage · start time · final loss (the last
    logged loss), and the checkpoint-N folder when it is one. The full path is the choice's value."""
    spec = jobs.read_spec_dict(run_dir)
    status = jobs.read_json(run_dir / jobs.STATUS_FILE)
    model = jobs.model_slug(spec.get("model_name_or_path") or "model")
    parts = [model, str(spec.get("finetuning_type", "lora")), str(spec.get("stage", "sft"))]
    started = status.get("started_at")
    try:
        stamp = datetime.fromisoformat(started) if isinstance(started, str) else \
            datetime.fromtimestamp((run_dir / jobs.SPEC_FILE).stat().st_mtime)
        parts.append(stamp.strftime("%m-%d %H:%M"))
    except (OSError, ValueError):
        parts.append(run_dir.name)
    loss = last_value(run_dir / LOG_FILE, "loss")
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if checkpoint:
        parts.append(checkpoint)
    return " · ".join(parts)


def adapter_pairs(root: Path | None = None, lang: str = "en") -> list[tuple[str, str]]:
    """(label, path) of every adapter and checkpoint-N folder (newest run first), after a "none" choice (in
    `lang`)."""

    pairs, seen = [(tr(lang, "choice.no_adapter"), "")], set()
    for path in adapter_choices(root):
        p = Path(path)
        run = p.parent if p.name.startswith(CHECKPOINT_PREFIX) else p
        label = adapter_label(run, p.name if run != p else None)
        if label in seen:  # two runs of the same kind started the same minute
            label += f" · {run.name}"
        seen.add(label)
        pairs.append((label, path))
    return pairs


def dataset_info(dataset_dir: str | Path | None = None) -> dict:
    path = Path(dataset_dir or paths.DATA_DIR) / "dataset_info.json"
    return read_json_dict(path)


def dataset_names(dataset_dir: str | Path | None = None) -> list[str]:
    """The usable datasets of a folder's dataset_info.json, in file order: an entry with a schema problem or
    a name registered twice is left out (dataset_problems says why; the Data tab shows it)."""
    try:
        return list(read_dataset_info(dataset_dir).entries)
    except DatasetError:
        return []


def dataset_problems(dataset_dir: str | Path | None = None) -> tuple[dict[str, list[str]], str]:
    """({bad entry name: [problem, ...]}, "") of a folder's dataset_info.json, or ({}, the error) when the
    file itself cannot be read (missing, not JSON, not an object)."""
    try:
        return read_dataset_info(dataset_dir).problems, ""
    except DatasetError as exc:
        return {}, str(exc)
