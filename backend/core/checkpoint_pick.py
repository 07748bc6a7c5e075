"""Which adapters `tuneboard eval checkpoints=...` evaluates: the complete checkpoint-N folders of a training
run (adapter_name_or_path = the run folder) and its final adapter, by name ("all", or a comma list of
checkpoint-N / N / final); of a full / freeze run (model_name_or_path = the run folder, finetuning_type full or
freeze) its checkpoints and final weights are model folders. Each refusal is one line naming the key. Light
(standard library + yaml): the spec's validation and the Evaluate tab's checkpoint picker use it.

The final adapter is the run's top-level one; after a promote (backend/core/promote.py) that is a checkpoint's copy,
so "final" is then the run's own final adapter, kept in PROMOTION_KEEP_DIR. A run with load_best_model_at_end
ended on its best checkpoint's weights (loaded_checkpoint): its final is labelled with that checkpoint's step, and
`all` leaves it out when that checkpoint is scored anyway (the same weights, scored twice)."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import yaml

from backend.core.atomic import read_json_dict
from backend.core.methods import is_adapter
from backend.core.model_files import adapter_problem, weights_problem
from backend.core.promote import promoted_checkpoint
from backend.core.rundir import (CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_PREFIX, CHECKPOINT_SCORES_FILE,
                                 PROMOTION_KEEP_DIR, SPEC_FILE, checkpoint_step, checkpoints, is_complete_checkpoint,
                                 is_reward_model_dir, last_logged_step, read_status)

ALL = "all"
FINAL = "final"
ADAPTER_CONFIG = "adapter_config.json"  # peft's adapter folder marker
MODEL_CONFIG = "config.json"  # a model folder's marker (a full / freeze run's checkpoints and final weights)


class CheckpointChoiceError(ValueError):
    """A refusal: one line naming the key."""


class Choice(NamedTuple):
    name: str  # checkpoint-N or final
    folder: Path  # the adapter folder to load
    step: int | None  # the training step it was saved at


def split_names(value: str | None) -> list[str]:
    return [v.strip() for v in str(value or "").split(",") if v.strip()]


def _run_spec(run: Path) -> dict:
    try:
        spec = yaml.safe_load((run / SPEC_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return spec if isinstance(spec, dict) else {}


def _finetuning_type(run: Path) -> str | None:
    spec = _run_spec(run)
    return str(spec.get("finetuning_type") or "lora") if spec else None


def loaded_checkpoint(run: Path) -> str | None:
    """The checkpoint-N whose weights the run ended on (load_best_model_at_end), or None: the best save of its
    eval_metric (checkpoint_scores.json's "loaded"), else, when its spec set load_best_model_at_end, the Trainer's
    best_model_checkpoint (its trainer_state.json)."""
    loaded = read_json_dict(run / CHECKPOINT_SCORES_FILE).get("loaded")
    if not loaded and _run_spec(run).get("load_best_model_at_end") is True:
        loaded = read_json_dict(run / CHECKPOINT_COMPLETE_MARKER).get("best_model_checkpoint")
    name = Path(str(loaded)).name if loaded else None
    return name if name and checkpoint_step(name) is not None else None


def final_folder(run: Path, models: bool = False) -> Path | None:
    """The run's own final adapter (or model, `models`) folder (the kept one after a promote), None while it
    has none."""
    marker = MODEL_CONFIG if models else ADAPTER_CONFIG
    if promoted_checkpoint(run) and (run / PROMOTION_KEEP_DIR / marker).is_file():
        return run / PROMOTION_KEEP_DIR
    return run if (run / marker).is_file() else None


def final_step(run: Path) -> int | None:
    """The step the final weights were saved at: the loaded best checkpoint's (loaded_checkpoint), else the run's
    last."""
    loaded = loaded_checkpoint(run)
    if loaded:
        return checkpoint_step(loaded)
    step = read_status(run).get("step")
    return step if isinstance(step, int) else last_logged_step(run)


def is_model_run(run_dir: str | Path | None) -> bool:
    """A full / freeze run: its complete checkpoints are model folders, not adapters."""
    complete = [p for p in checkpoints(run_dir) if is_complete_checkpoint(p)] if run_dir else []
    return bool(complete) and not any((p / ADAPTER_CONFIG).is_file() for p in complete) \
        and any((p / MODEL_CONFIG).is_file() for p in complete)


def available(run_dir: str | Path | None) -> list[str]:
    """The names a run offers: its complete checkpoint-N folders (oldest first), then final when it has one.
    [] for anything that is not a training run folder with checkpoints (or a reward model's)."""
    if not run_dir or not Path(run_dir).expanduser().is_dir() or is_reward_model_dir(run_dir):
        return []
    run = Path(run_dir).expanduser()
    models = is_model_run(run)
    marker = MODEL_CONFIG if models else ADAPTER_CONFIG
    names = [p.name for p in checkpoints(run) if is_complete_checkpoint(p) and (p / marker).is_file()]
    return names + ([FINAL] if names and final_folder(run, models) else [])


def pick(run_dir: str | Path | None, wanted: str | None, models: bool = False, base: str | None = None,
         resized: bool = False) -> list[Choice]:
    """The adapters (`models`: the model folders of a full / freeze run) to evaluate, in step order (final
    last), or CheckpointChoiceError saying why not (with `base`, an adapter that does not fit that base model,
    its vocabulary grown first when `resized`: model_files.adapter_base_mismatch)."""
    key = "model_name_or_path" if models else "adapter_name_or_path"
    if not run_dir or "," in str(run_dir):
        raise CheckpointChoiceError(f"checkpoints: set {key} to one training run folder (the output_dir of a run "
                                    "that saved checkpoints)")
    run = Path(str(run_dir).strip()).expanduser()
    if not run.is_dir():
        raise CheckpointChoiceError(f"checkpoints: {key} {run} is not a folder")
    if run.name.startswith(CHECKPOINT_PREFIX) and checkpoint_step(run) is not None:
        raise CheckpointChoiceError(f"checkpoints: {run} is one checkpoint; set {key} to its run folder {run.parent}")
    if is_reward_model_dir(run):
        raise CheckpointChoiceError(f"checkpoints: {run} is a reward model: its checkpoints score pairs; evaluate "
                                    "one at a time with stage rm (adapter_name_or_path=<run>/checkpoint-N)")
    found = checkpoints(run)
    complete = [p for p in found if is_complete_checkpoint(p)]
    if complete and is_model_run(run) and not models:
        kind = _finetuning_type(run) or "full weights"
        raise CheckpointChoiceError(
            f"checkpoints: {run} is a {kind} run: its checkpoints are whole models, not adapters: set "
            f"model_name_or_path={run} and finetuning_type {kind} (each checkpoint is loaded as the model)")
    if complete and models and not is_model_run(run):
        raise CheckpointChoiceError(f"checkpoints: {run} is an adapter run: set adapter_name_or_path={run} and its "
                                    "base model as model_name_or_path")
    if not complete:
        if found:
            raise CheckpointChoiceError(f"checkpoints: {run} has no complete checkpoint ({', '.join(p.name for p in found)} "
                                        "were cut short: no trainer_state.json)")
        raise CheckpointChoiceError(f"checkpoints: {run} holds no checkpoint-N folders (an adapter without its "
                                    "training checkpoints): train with save_steps to keep some, or evaluate it "
                                    "without checkpoints")
    by_name = {p.name: p for p in complete}
    final = final_folder(run, models)
    names = split_names(wanted)
    if not names:
        raise CheckpointChoiceError("checkpoints: give all, or checkpoint-N names, comma-separated")
    if len(names) == 1 and names[0].lower() == ALL:  # final, unless it is a scored checkpoint's weights
        names = [p.name for p in complete] + ([FINAL] if final and loaded_checkpoint(run) not in by_name else [])
    out: list[Choice] = []
    for raw in names:
        name = f"{CHECKPOINT_PREFIX}{raw}" if raw.isdigit() else raw.rstrip("/").split("/")[-1]
        if name == FINAL:
            if final is None:
                raise CheckpointChoiceError(f"checkpoints: {run} has no final weights yet (no "
                                            f"{MODEL_CONFIG if models else ADAPTER_CONFIG}): pick its checkpoints")
            out.append(Choice(FINAL, final, final_step(run)))
        elif name in by_name:
            out.append(Choice(name, by_name[name], checkpoint_step(name)))
        elif any(p.name == name for p in found):
            raise CheckpointChoiceError(f"checkpoints: {name} of {run} is incomplete (no trainer_state.json: it "
                                        "was cut short)")
        else:
            offered = ", ".join(list(by_name) + ([FINAL] if final else []))
            raise CheckpointChoiceError(f"checkpoints: {name} is not a checkpoint of {run} (it has {offered})")
    unique = list({c.name: c for c in out}.values())
    for choice in unique:  # each is loaded in turn: a broken one would stop the eval after the ones before it
        problem = weights_problem(choice.folder) if models else adapter_problem(str(choice.folder), base, resized)
        if problem:
            raise CheckpointChoiceError(f"checkpoints: {choice.name} of {run} cannot be loaded: {problem}")
    return sorted(unique, key=lambda c: (c.name == FINAL, c.step if c.step is not None else -1))


def pick_for(spec) -> list[Choice]:
    """pick() for a spec: an adapter method's run is adapter_name_or_path, a full / freeze run is
    model_name_or_path itself."""
    models = not is_adapter(spec.finetuning_type)
    if not models and not spec.adapter_name_or_path and is_model_run(spec.model_name_or_path):
        raise CheckpointChoiceError(f"checkpoints: {spec.model_name_or_path} is a full-weights run: set its "
                                    "finetuning_type (full or freeze) to load each checkpoint as the model")
    return pick(spec.model_name_or_path if models else spec.adapter_name_or_path, spec.checkpoints, models,
                None if models else spec.model_name_or_path, bool(spec.resize_vocab or spec.new_special_tokens))
