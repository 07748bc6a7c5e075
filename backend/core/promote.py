"""Promote: make a checkpoint-N the run's top-level adapter (or model weights for a full / freeze run), so
that everything that loads the run folder (Chat, Export, the API, "Continue with DPO") gets it; undo puts
the run's own final weights back. `tuneboard promote RUN_DIR checkpoint-N` / `--undo`, and the Runs tab.
Light (standard library + yaml): the web UI calls it directly.

Only the weight files move (adapter_model*.safetensors + adapter_config.json, or model*.safetensors /
pytorch_model*.bin + config.json + generation_config.json); tokenizer files and the template stay the run's.
The order keeps a loadable adapter at every moment:
1. the run's final files are hard-linked (or copied) into PROMOTION_KEEP_DIR, built under a temp name and
   renamed whole, once per promotion chain (a later promote keeps the first final);
2. the checkpoint's files are copied into a temp folder in the run dir (same file system), fsynced;
3. each is os.replace'd over the top-level one (weights first, config last): each name always holds a whole
   file, the old or the new;
4. promotion.json is written atomically (which checkpoint, where the final is, when, the history), a line
   goes to running_log.txt.
Undo moves the kept files back the same way and removes the then empty keep folder. A run resumed after a
promote saves new final weights over the promoted ones (promotion.json's size/mtime of each file tell): it no
longer counts as promoted, undo refuses, and the next promote keeps the new final (the older one moved aside)."""
from __future__ import annotations

import json
import os
import re
import shutil
from datetime import datetime
from pathlib import Path

import yaml

from backend.core.atomic import fsync_dir, read_json_dict, replace_path, write_json_atomic
from backend.core.methods import is_adapter
from backend.core.model_files import adapter_problem, weights_problem
from backend.core.rundir import (ACTIVE_STATES, CHECKPOINT_EVAL_FILE, CHECKPOINT_PREFIX, CHECKPOINT_SCORES_FILE,
                            LOG_FILE, PROMOTION_FILE, PROMOTION_KEEP_DIR, RUNNING_LOG, SPEC_FILE, checkpoint_step, checkpoints,
                            is_complete_checkpoint, now_iso, read_status, stamp, unique_dir)
import sys

ADAPTER_FILES = re.compile(r"^adapter_model.*\.(safetensors|bin)$|^adapter_config\.json$")
MODEL_FILES = re.compile(r"^(model|pytorch_model).*\.(safetensors|bin|json)$|^(config|generation_config)\.json$")
_STAGING = ".promote-staging"


class PromoteError(ValueError):
    """A refusal: one line saying why."""


def _is_adapter_run(run_dir: Path) -> bool:
    """The run's finetuning_type (run_spec.yaml) decides; without a spec, an adapter_config.json does."""
    try:
        spec = yaml.safe_load((run_dir / SPEC_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        spec = None
    if isinstance(spec, dict):
        return is_adapter(spec.get("finetuning_type"))
    return (run_dir / "adapter_config.json").is_file()


def weight_files(folder: Path, adapter: bool) -> list[str]:
    """The weight file names in `folder`, config files last (replaced last)."""
    pattern = ADAPTER_FILES if adapter else MODEL_FILES
    names = [p.name for p in folder.iterdir() if p.is_file() and pattern.match(p.name)] if folder.is_dir() else []
    return sorted(names, key=lambda n: (n.endswith(".json"), n))


def read_promotion(run_dir: str | Path) -> dict:
    return read_json_dict(Path(run_dir) / PROMOTION_FILE)


def _fingerprint(folder: Path, names: list[str]) -> dict:
    return {n: [(folder / n).stat().st_size, (folder / n).stat().st_mtime_ns] for n in names}


def _changed_since(run_dir: Path, record: dict) -> bool:
    """Whether the record names a promoted checkpoint but the top-level files are no longer the ones it
    put there (size and mtime): a resumed run saved its own final weights over them."""
    files = record.get("files")
    if not record.get("checkpoint") or not isinstance(files, dict):
        return False
    try:
        return _fingerprint(run_dir, list(files)) != {n: list(v) for n, v in files.items()}
    except (OSError, TypeError, ValueError):
        return True


def promoted_checkpoint(run_dir: str | Path | None) -> str | None:
    """The checkpoint-N whose weights are the run's top-level ones now, or None (no promotion, undone, or the
    top-level files changed since: a resumed run saved its own final weights over them)."""
    if not run_dir:
        return None
    run_dir = Path(run_dir).expanduser()
    record = read_promotion(run_dir)
    return None if _changed_since(run_dir, record) else record.get("checkpoint") or None


def _log(run_dir: Path, message: str) -> None:
    try:
        with open(run_dir / RUNNING_LOG, "a", encoding="utf-8") as log:
            log.write(f"[{datetime.now().strftime('%H:%M:%S')}] {message}\n")
    except OSError:
        pass


def _copy_synced(src: Path, dst: Path) -> None:
    shutil.copy2(src, dst)
    with open(dst, "rb+") as fh:
        os.fsync(fh.fileno())


def _link_or_copy(src: Path, dst: Path) -> None:
    """dst holds src's bytes: a hard link (the same file, free) or, where links fail, a synced copy."""
    try:
        os.link(src, dst)
    except OSError:
        _copy_synced(src, dst)


def _check_idle(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise PromoteError(f"{run_dir}: no such run folder")
    state = read_status(run_dir).get("state")
    if state in ACTIVE_STATES:
        raise PromoteError(f"{run_dir.name}: the run is still {state}; promote a checkpoint once it has ended")


def _replace_top(run_dir: Path, source: Path, names: list[str], stale: list[str]) -> None:
    """Move `names` from `source` to the top level (each name replaced atomically), then remove `stale`
    top-level weight files the new set does not have (a copy of each is kept or sits in a checkpoint)."""
    for name in names:
        replace_path(source / name, run_dir / name)
    for name in stale:
        (run_dir / name).unlink(missing_ok=True)
    fsync_dir(run_dir)


def promote(run_dir: str | Path, checkpoint: str) -> dict:
    """Make `checkpoint` (checkpoint-N or N) the run's top-level weights. Returns the promotion record;
    raises PromoteError (one line) when it cannot."""
    run_dir = Path(run_dir).expanduser()
    _check_idle(run_dir)
    found = checkpoints(run_dir)
    if not found:
        raise PromoteError(f"{run_dir.name}: the run folder has no checkpoints (checkpoint-N folders) to promote")
    if not (run_dir / SPEC_FILE).is_file() and not any(is_complete_checkpoint(p) for p in found):
        # e.g. the output_dir of `tuneboard eval checkpoints=...`: a checkpoint-N folder of answers per adapter
        evaluated = read_json_dict(run_dir / CHECKPOINT_EVAL_FILE).get("run")
        raise PromoteError(f"{run_dir}: not a training run (no {SPEC_FILE}, no complete checkpoint-N folder)"
                           + (f": it holds the checkpoint evaluation of {evaluated}: promote in that run folder"
                              if evaluated else ""))
    given = Path(str(checkpoint).strip()).expanduser()
    name = given.name
    name = f"{CHECKPOINT_PREFIX}{name}" if name.isdigit() else name
    folder = run_dir / name
    if len(given.parts) > 1 and given.parent.resolve() != run_dir.resolve():
        raise PromoteError(f"{checkpoint}: not a checkpoint of {run_dir} (a run promotes its own checkpoint-N)")
    if checkpoint_step(name) is None or not folder.is_dir():
        raise PromoteError(f"{name}: no such checkpoint in {run_dir.name} (it has: "
                           f"{', '.join(p.name for p in found)})")
    if not is_complete_checkpoint(folder):
        raise PromoteError(f"{name}: incomplete checkpoint (no trainer_state.json: it was cut short)")
    adapter = _is_adapter_run(run_dir)
    names = weight_files(folder, adapter)
    if not any(not n.endswith(".json") for n in names):
        what = "adapter" if adapter else "model"
        raise PromoteError(f"{name}: holds no {what} weights to promote")
    broken = adapter_problem(str(folder)) if adapter else weights_problem(folder)
    if broken:  # promoted, it would become the run's adapter for Chat, Export and the API, which refuse it
        raise PromoteError(f"{name}: cannot be promoted: {broken}")
    keep = run_dir / PROMOTION_KEEP_DIR
    record = read_promotion(run_dir)
    previous = promoted_checkpoint(run_dir)
    if keep.is_dir() and _changed_since(run_dir, record):  # the top level is a newer final (a resumed run):
        aside = unique_dir(run_dir / f"{PROMOTION_KEEP_DIR}-{stamp()}")  # the older final stays, beside it
        replace_path(keep, aside)
        _log(run_dir, f"PROMOTE: the run saved new final weights since {record['checkpoint']} was promoted; "
                      f"the final kept then is now in {aside.name}/")
    if not keep.is_dir():  # 1. the run's own final weights, kept whole before anything is replaced
        final = weight_files(run_dir, adapter)
        temp = run_dir / f"{PROMOTION_KEEP_DIR}.tmp"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir()
        for n in final:
            _link_or_copy(run_dir / n, temp / n)
        fsync_dir(temp)
        replace_path(temp, keep)
    staging = run_dir / _STAGING  # 2. the checkpoint's files, copied next to their destination
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for n in names:
        _copy_synced(folder / n, staging / n)
    stale = [n for n in weight_files(run_dir, adapter) if n not in names]
    _replace_top(run_dir, staging, names, stale)  # 3.
    shutil.rmtree(staging, ignore_errors=True)
    when = now_iso()
    history = list(record.get("history") or [])
    history.append({"action": "promote", "checkpoint": name, "step": checkpoint_step(name), "at": when,
                    "replaced": previous or "final"})
    record = {"checkpoint": name, "step": checkpoint_step(name), "promoted_at": when,
              "final_kept_in": PROMOTION_KEEP_DIR, "kind": "adapter" if adapter else "model",
              "files": _fingerprint(run_dir, names), "history": history}
    write_json_atomic(run_dir / PROMOTION_FILE, record, mkdir=False)  # 4.
    _log(run_dir, f"PROMOTE: {name} is now the run's {'adapter' if adapter else 'model'} "
                  f"({', '.join(names)}); the earlier final files are kept in {PROMOTION_KEEP_DIR}/")
    return record


def undo(run_dir: str | Path) -> dict:
    """Put the run's own final weights (kept by the first promote) back at the top level, byte for byte.
    Returns the promotion record; raises PromoteError when there is nothing to undo."""
    run_dir = Path(run_dir).expanduser()
    _check_idle(run_dir)
    keep = run_dir / PROMOTION_KEEP_DIR
    if not keep.is_dir():
        raise PromoteError(f"{run_dir.name}: nothing to undo (no checkpoint was promoted)")
    record = read_promotion(run_dir)
    if _changed_since(run_dir, record):
        raise PromoteError(f"{run_dir.name}: nothing to undo: the run saved new final weights after "
                           f"{record['checkpoint']} was promoted (the earlier final stays in {PROMOTION_KEEP_DIR}/)")
    adapter = _is_adapter_run(run_dir)
    names = sorted((p.name for p in keep.iterdir() if p.is_file()), key=lambda n: (n.endswith(".json"), n))
    stale = [n for n in weight_files(run_dir, adapter) if n not in names]
    was = record.get("checkpoint")
    _replace_top(run_dir, keep, names, stale)
    shutil.rmtree(keep)  # empty now: its files are the top-level ones again
    history = list(record.get("history") or [])
    history.append({"action": "undo", "checkpoint": was, "at": now_iso()})
    record = {"checkpoint": None, "step": None, "undone_at": now_iso(), "final_kept_in": None,
              "kind": "adapter" if adapter else "model", "history": history}
    write_json_atomic(run_dir / PROMOTION_FILE, record, mkdir=False)
    _log(run_dir, f"PROMOTE UNDONE: the run's own final {'adapter' if adapter else 'model'} is back "
                  f"(was {was or 'a checkpoint'})")
    return record


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> the training loss logged at that step (trainer_log.jsonl)."""
    out: dict[int, float] = {}
    try:
        lines = (run_dir / LOG_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("loss"), (int, float)):
            out[row["step"]] = float(row["loss"])
    return out


def checkpoint_rows(run_dir: str | Path | None) -> tuple[list[dict], str | None]:
    """One dict per checkpoint-N: step, checkpoint, loss at that step, the task metric's value when the run
    scored its saves (checkpoint_scores.json), complete, adapter (whether it is the run's adapter now), best.
    Also the metric's name (None without scores)."""
    if not run_dir:
        return [], None
    run_dir = Path(run_dir).expanduser()
    losses = _losses(run_dir)
    scores = read_json_dict(run_dir / CHECKPOINT_SCORES_FILE)
    by_name = {str(s.get("checkpoint")): s.get("value") for s in scores.get("scores") or [] if isinstance(s, dict)}
    best = (scores.get("best") or {}).get("checkpoint") if isinstance(scores.get("best"), dict) else None
    current = promoted_checkpoint(run_dir)
    rows = []
    for folder in checkpoints(run_dir):
        step = checkpoint_step(folder)
        rows.append({"step": step, "checkpoint": folder.name, "loss": losses.get(step),
                     "metric": by_name.get(folder.name), "complete": is_complete_checkpoint(folder),
                     "adapter": folder.name == current, "best": folder.name == best})
    return rows, scores.get("metric") if scores else None


USAGE = """usage: tuneboard promote RUN_DIR checkpoint-N    make checkpoint-N the run's adapter (or model weights)
       tuneboard promote RUN_DIR --undo            put the run's own final adapter back

The earlier final files are kept in RUN_DIR/{keep}/ and the change is recorded in RUN_DIR/{file}.
""".format(keep=PROMOTION_KEEP_DIR, file=PROMOTION_FILE)


def main(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    undoing = "--undo" in args
    rest = [a for a in args if a != "--undo"]
    if len(rest) != (1 if undoing else 2):
        print(f"error: expected RUN_DIR and checkpoint-N, or RUN_DIR --undo\n\n{USAGE}", file=sys.stderr, end="")
        return 2
    try:
        record = undo(rest[0]) if undoing else promote(rest[0], rest[1])
    except PromoteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {rest[0]}: {exc}", file=sys.stderr)
        return 1
    if undoing:
        print(f"undone: {rest[0]} has its own final weights again")
    else:
        print(f"promoted: {record['checkpoint']} is now the {record['kind']} of {rest[0]}")
    return 0
