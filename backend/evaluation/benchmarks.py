"""`tuneboard eval SPEC.yaml tasks=...`: lm-evaluation-harness benchmarks on the base model and the tuned one.

Reads top to bottom: the tasks (lm-eval task names, checked against lm-eval's index, and task YAML paths,
linked into a folder of their own that becomes lm-eval's include path, their relative data_files read from
the YAML's folder) are
built first, so an unknown task or a hub dataset that cannot be reached offline is one clear line before
any model loads -> the base model (model_name_or_path) through lm-eval's HFLM, in this process -> the
same model with adapter_name_or_path applied, when there is one (or, when adapter_name_or_path is a merged
export folder, that whole model) -> LM_EVAL_FILE in output_dir: per task and metric the base and tuned
values, their standard errors and the delta.

lm-eval is an optional extra (`pip install -e '.[lm-eval]'`, installed by `make setup`); it is imported
only here, in functions. A STOP file or SIGINT/SIGTERM ends the run after the model being scored
(lm-eval cannot be stopped in the middle of a task); what was finished is written.
"""
from __future__ import annotations

import difflib
import os
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path

from backend.training.adapters import apply_finetuning
from backend.core.benchmark_tasks import is_task_file, lm_eval_missing, split_tasks
from backend.training.callbacks import start_run
from backend.training.models import load_model, load_tokenizer, resolve_model
from backend.core.rundir import LM_EVAL_FILE, write_json_atomic


class BenchmarkError(ValueError):
    """A task that cannot run here, said in one line."""


def merged_model(path) -> bool:
    """A whole model folder (a merged `tuneboard export`), not an adapter."""
    folder = Path(str(path or "")).expanduser()
    return (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file()


def _limit(value):
    """lm-eval's limit: a count when it is a whole number >= 1, else a fraction of each task."""
    if value is None:
        return None
    return int(value) if value >= 1 and float(value).is_integer() else float(value)


def _local_task(path: Path) -> dict:
    """A task YAML as the config dict lm-eval builds it from, its relative data_files made absolute
    (relative to the YAML's folder, so the task runs from any working directory)."""
    # optional dependency (the lm-eval extra); its YAML loader resolves `include:` and `!function`
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path)
    except Exception as exc:  # noqa: BLE001 - a broken YAML, an include that is missing: say which file
        raise BenchmarkError(f"tasks: {path}: not a readable lm-eval task file ({exc})") from None
    if "task" not in config:
        raise BenchmarkError(f"tasks: {path}: no `task:` name in it (lm-eval's task format)")
    kwargs = dict(config.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")

    def absolute(name):
        p = Path(str(name)).expanduser()
        return str(p if p.is_absolute() or "://" in str(name) else (path.parent / p).resolve())

    if isinstance(files, dict):
        kwargs["data_files"] = {k: [absolute(v) for v in vs] if isinstance(vs, list) else absolute(vs)
                                for k, vs in files.items()}
    elif isinstance(files, list):
        kwargs["data_files"] = [absolute(v) for v in files]
    elif files:
        kwargs["data_files"] = absolute(files)
    if kwargs:
        config["dataset_kwargs"] = kwargs
    return config


def _unreachable(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, ConnectionError) or any(w in text for w in ("OfflineMode", "Couldn't reach", "offline"))


def include_folder(paths: list[Path]) -> Path:
    """A new temporary folder holding a link to each task YAML and nothing else: lm-eval's include path. lm-eval
    reads every **/*.yaml under an include path, so the YAML's own folder would have it read a TuneBoard run beside
    it (run_spec.yaml's `task: null` stopped the eval: "'<' not supported between 'NoneType' and 'str'") or, for a
    task file at a repository's root, the whole tree. Its YAML loader resolves the link first, so `include:`,
    `!function` and relative paths are still read from the file's real folder."""
    folder = Path(tempfile.mkdtemp(prefix="tuneboard-lm-eval-tasks-"))
    for i, path in enumerate(paths):
        os.symlink(path, folder / f"{i}-{path.name}")
    return folder


def build_tasks(tasks: list[str], log=print):
    """(the lm-eval task specs, a TaskManager that knows them), each task built once to check it: one
    BenchmarkError line for an unknown name, a missing or broken YAML, or a dataset that cannot be loaded."""
    # optional dependency (the lm-eval extra), heavy: imported when a benchmark runs
    from lm_eval.tasks import TaskManager

    files = {t: Path(t).expanduser().resolve() for t in tasks if is_task_file(t)}
    for task, path in files.items():
        if not path.is_file():
            raise BenchmarkError(f"tasks: {task}: no such task file")
    folder = include_folder(list(dict.fromkeys(files.values()))) if files else None
    manager = TaskManager(include_path=str(folder) if folder else None)
    if folder:  # lm-eval reads the entries' files again when it builds them: the folder lives as long as the manager
        weakref.finalize(manager, shutil.rmtree, folder, ignore_errors=True)
    known = set(manager.all_tasks)
    specs = []
    for task in tasks:
        if task in files:
            specs.append(_local_task(files[task]))
            continue
        if task not in known:
            near = difflib.get_close_matches(task, sorted(known), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise BenchmarkError(f"tasks: {task}: not an lm-eval task name{hint}; give a task name from "
                                 "`lm-eval ls tasks` or the path to a task YAML file")
        specs.append(task)
    for task, spec in zip(tasks, specs):
        log(f"task {task}: loading its data")
        try:
            manager.load([spec])
        except Exception as exc:  # noqa: BLE001 - datasets / lm-eval raise many kinds: one line each
            if _unreachable(exc):
                raise BenchmarkError(
                    f"tasks: {task}: its dataset is on the Hugging Face hub, which cannot be reached here (offline): "
                    "run it once where the hub is reachable, with HF_HUB_OFFLINE=0 (it is cached then), or give a "
                    "task YAML over local files (like data/lm_eval_tasks/tuneboard_mc.yaml)") from None
            raise BenchmarkError(f"tasks: {task}: lm-eval cannot build it ({type(exc).__name__}: {exc})") from None
    return specs, manager


def score(model, tokenizer, specs, manager, *, num_fewshot, limit, batch_size: int) -> dict:
    """lm-eval's results on one loaded model: {task: {metric: (value, stderr)}} plus the n-shot used."""
    # optional dependency (the lm-eval extra), heavy: imported when a benchmark runs
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM  # optional dependency: imported only where it is used

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=specs, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
                          log_samples=False, bootstrap_iters=1000)
    return {"results": out["results"], "n-shot": out.get("n-shot", {}), "n-samples": out.get("n-samples", {})}


def table(scores: dict[str, dict]) -> list[dict]:
    """Rows {task, metric, n, base, base_stderr, tuned, tuned_stderr, delta} from {'base'|'tuned': score()}."""
    rows, first = [], next(iter(scores.values()))
    for task, values in first["results"].items():
        for key, value in values.items():
            metric, comma, _filter = key.partition(",")  # lm-eval's "acc,none": metric, filter
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            row = {"task": task, "metric": metric, "filter": _filter or None,
                   "n": (first["n-samples"].get(task) or {}).get("effective"),
                   "num_fewshot": first["n-shot"].get(task)}
            for name, s in scores.items():
                got = s["results"].get(task, {})
                row[name] = got.get(key)
                stderr = got.get(f"{metric}_stderr,{_filter}" if _filter else f"{metric}_stderr")
                row[f"{name}_stderr"] = stderr if isinstance(stderr, (int, float)) else None
            if isinstance(row.get("base"), (int, float)) and isinstance(row.get("tuned"), (int, float)):
                row["delta"] = row["tuned"] - row["base"]
            rows.append(row)
    return rows


def run(spec, out: Path) -> int:
    """The benchmark run of `tuneboard eval` (spec.tasks set); the exit code. Never raises."""
    missing = lm_eval_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    if (out / LM_EVAL_FILE).exists() and not spec.overwrite_output_dir:
        print(f"error: output_dir {out} already holds benchmark results ({LM_EVAL_FILE}); pick another output_dir "
              "or set overwrite_output_dir: true", file=sys.stderr)
        return 1
    run_dir, switch = start_run(out)
    started = time.time()
    tasks = split_tasks(spec.tasks)
    models = ["base", "tuned"] if spec.adapter_name_or_path else ["base"]
    results = {"model": spec.model_name_or_path, "adapter": spec.adapter_name_or_path, "tasks": tasks,
               "num_fewshot": spec.num_fewshot, "limit": spec.limit, "models": models}
    try:
        specs, manager = build_tasks(tasks, log=run_dir.log)
        run_dir.update_status(total_steps=len(models), step=0)
        resolved = resolve_model(spec.model_name_or_path)
        tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)
        model = load_model(spec, resolved, for_training=False, warn=run_dir.warn)
        model.eval()
        scores: dict[str, dict] = {}
        for i, name in enumerate(models):
            if switch.reason:
                break
            if name == "tuned" and merged_model(spec.adapter_name_or_path):  # a merged export: its own weights
                del model
                merged = spec.model_copy(update={"model_name_or_path": spec.adapter_name_or_path,
                                                 "adapter_name_or_path": None})
                resolved = resolve_model(spec.adapter_name_or_path)
                tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)
                model = load_model(merged, resolved, for_training=False, warn=run_dir.warn)
                model.eval()
            elif name == "tuned":  # the base was scored first: the adapter may be merged into its weights
                model = apply_finetuning(model, spec, for_training=False, warn=run_dir.warn)
                model.eval()
            run_dir.log(f"lm-eval on the {name} model: {', '.join(tasks)}")
            scores[name] = score(model, tokenizer, specs, manager, num_fewshot=spec.num_fewshot,
                                 limit=_limit(spec.limit), batch_size=spec.per_device_eval_batch_size)
            run_dir.update_status(step=i + 1)
        results["rows"] = table(scores) if scores else []
        for row in results["rows"]:
            run_dir.log(f"{row['task']} {row['metric']}: " + ", ".join(
                f"{m} {row[m]:.4f}" for m in models if isinstance(row.get(m), (int, float))))
        if switch.reason:
            results["stopped"] = switch.reason
        results["seconds"] = round(time.time() - started, 1)
        write_json_atomic(out / LM_EVAL_FILE, results)
    except Exception as exc:  # noqa: BLE001 - the status says why
        return run_dir.fail(exc)
    run_dir.log(f"wrote {out / LM_EVAL_FILE}")
    return run_dir.end(switch.reason)
