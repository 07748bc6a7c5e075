"""The tokenized cache (`tokenized_path`, `overwrite_cache`): a run's tokenized rows saved once, in datasets'
own Arrow format (save_to_disk), and loaded by later runs of the same data, so they start at once.

Where: `tokenized_path` when the spec sets it (one cache, replaced when its key no longer matches), else
<saves>/.cache/tokenized/<key>/ (one folder per key; the newest KEEP are kept). A folder holds train/, eval/
(when there are held-out rows) and meta.json (written last: a folder without it is no cache).

The key is everything preprocessing reads: the stage; the dataset names, dataset_dir, each entry of
dataset_info.json and its files (size, modification time, and a content hash up to tokenized.HASH_LIMIT bytes); the row
choices (max_samples, val_size, seed, mix_strategy, interleave_probs, identity_name/author, default_system);
the template (its name, its file or the tokenizer's chat template, and a probe conversation rendered with it);
the tokenizer (its whole vocabulary and special tokens, as the fast tokenizer serializes them); cutoff_len,
train_on_prompt and mask_history. preprocessing_num_workers gives the same rows and is not part of it;
packing neither: the cache holds the rows before packing (batching packs them per run).

A cache whose key differs is never used: the run re-tokenizes and its log says what changed ("cutoff_len 64
-> 128"). Entries with no local file (hub datasets) are not cached by default: nothing here can tell when
their data changes. In a run of several processes only rank 0 (the RunDir writer) writes; the other ranks
load a cache that is complete (meta.json present) or tokenize themselves, as they would without a cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from backend.core import paths
from backend.core.dataset_info import read_dataset_info, resolve_dataset_dir
from backend.core.tokenized import META, data_files, file_state, folder_problem
from backend.dataprep.preprocess import rows_in_arrow

CACHE_VERSION = 1
KEEP = 8  # default caches kept under <saves>/.cache/tokenized (the newest)
SAVE_BATCH = 10_000  # rows converted to Arrow at a time when the cache is saved
PROBE = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
         {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]


def default_root() -> Path:
    return paths.saves_dir() / ".cache" / "tokenized"


# ------------------------------------------------------------------------------------------ the key
def _digest(data: Any) -> str:
    text = data if isinstance(data, (str, bytes)) else json.dumps(data, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def _template_state(template, tokenizer) -> dict:
    name = getattr(template, "name", type(template).__name__)
    file = Path(paths.TEMPLATES_DIR) / f"{name}.yaml"
    probe = []
    for flags in ({}, {"train_on_prompt": True}, {"mask_history": True}):
        try:
            probe.append([(s.text, s.trained, s.role) for s in template.render(PROBE, **flags)])
        except ValueError as exc:  # e.g. a template with no system role
            probe.append(str(exc))
    return {"name": name, "file": _digest(file.read_bytes()) if file.is_file() else None,
            "chat_template": _digest(str(getattr(tokenizer, "chat_template", None) or "")), "probe": _digest(probe)}


def _tokenizer_state(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        vocab = backend.to_str()
    else:  # a slow tokenizer: its vocabulary
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, len(tokenizer),
               getattr(tokenizer, "add_bos_token", None), getattr(tokenizer, "add_eos_token", None)]
    return _digest(vocab + json.dumps(special, default=str))


def cache_key(spec, stage: str, tokenizer, template=None) -> tuple[dict, str | None]:
    """(the key as named parts, why there is no default cache or None). Parts compare one by one for the log."""
    dataset_dir = resolve_dataset_dir(spec.dataset_dir)
    info = read_dataset_info(dataset_dir)
    parts: dict[str, Any] = {
        "version": CACHE_VERSION, "stage": stage, "dataset": spec.dataset, "eval_dataset": spec.eval_dataset,
        "dataset_dir": str(dataset_dir), "cutoff_len": spec.cutoff_len, "train_on_prompt": spec.train_on_prompt,
        "mask_history": spec.mask_history, "max_samples": spec.max_samples, "val_size": spec.val_size,
        "seed": spec.seed, "mix_strategy": spec.mix_strategy, "interleave_probs": spec.interleave_probs,
        "identity_name": spec.identity_name, "identity_author": spec.identity_author,
        "default_system": spec.default_system, "new_special_tokens": spec.new_special_tokens,
        "enable_thinking": spec.enable_thinking, "tokenizer": _tokenizer_state(tokenizer),
    }
    if template is not None:
        parts["template"] = _template_state(template, tokenizer)
    no_default = None
    names = [n for field in (spec.dataset, spec.eval_dataset) for n in (field or "").split(",") if n.strip()]
    for name in dict.fromkeys(n.strip() for n in names):
        entry = info.raw.get(name)
        parts[f"dataset {name} entry"] = entry
        files = data_files(entry or {}, dataset_dir)
        if files is None:
            no_default = no_default or f"dataset {name} has no local file (its data can change unseen)"
            continue
        for path in files:
            parts[f"file {path}"] = file_state(path)
    return parts, no_default


def key_id(parts: dict) -> str:
    return _digest(parts)


def differences(old: dict, new: dict) -> list[str]:
    """What changed between two keys, one short phrase each."""
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if name.startswith("file "):
            out.append(f"{name[5:]} " + ("is new" if a is None else "is gone" if b is None else "changed"))
        elif isinstance(a, (dict, list)) or isinstance(b, (dict, list)) or name == "tokenizer" \
                or len(repr(a)) + len(repr(b)) > 60:
            out.append(f"{name} changed")
        else:
            out.append(f"{name} {a!r} -> {b!r}")
    return out


# ------------------------------------------------------------------------------------------ folders
def read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("version") == CACHE_VERSION else None


def _newest_of_same_data(root: Path, parts: dict) -> dict | None:
    """The newest default cache of the same datasets (to say why it does not fit)."""
    same = ("stage", "dataset", "eval_dataset", "dataset_dir")
    found = []
    for meta_file in root.glob(f"*/{META}") if root.is_dir() else []:
        meta = read_meta(meta_file.parent)
        if meta and all(meta["parts"].get(k) == parts.get(k) for k in same):
            found.append((meta.get("created", 0), meta))
    return max(found, key=lambda x: x[0])[1] if found else None


def save(folder: Path, train_rows: list[dict], eval_rows: list[dict] | None, meta: dict) -> None:
    """train/ and eval/ with save_to_disk, then meta.json, in a staging folder renamed into place."""
    import datasets  # heavy: pyarrow; this module's top stays light for validate

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.saving-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the run log says what happened, in one line
    try:
        _save_rows(train_rows, staging / "train")
        if eval_rows:
            _save_rows(eval_rows, staging / "eval")
        (staging / META).write_text(json.dumps(meta, indent=1, ensure_ascii=False, default=str), encoding="utf-8")
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        if folder.exists():
            folder.rename(old)
        staging.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()


def _save_rows(rows, folder: Path) -> None:
    """save_to_disk of the rows: a datasets.Dataset (what tokenizing inside preprocess.rows_in_arrow returns) as it
    is; a list converted to Arrow SAVE_BATCH rows at a time into a file that is then memory-mapped (Dataset.from_list
    converts every row at once: at 100,000 rows 3.6x the memory and twice the time)."""
    import datasets  # heavy: pyarrow; this module's top stays light for validate
    from datasets.arrow_writer import ArrowWriter  # heavy: as above

    if isinstance(rows, datasets.Dataset):
        rows.save_to_disk(str(folder))
        return
    if not rows:
        datasets.Dataset.from_list([]).save_to_disk(str(folder))
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    rows_file = folder.parent / f"{folder.name}.rows.arrow"
    try:
        with ArrowWriter(path=str(rows_file)) as writer:
            for start in range(0, len(rows), SAVE_BATCH):
                batch = rows[start:start + SAVE_BATCH]
                writer.write_batch({key: [row.get(key) for row in batch] for key in batch[0]})
            writer.finalize()
        datasets.Dataset.from_file(str(rows_file)).save_to_disk(str(folder))
    finally:
        rows_file.unlink(missing_ok=True)


def load(folder: Path):
    """(train, eval or None) as datasets.Dataset, memory-mapped from the cache's Arrow files: the Trainer reads its
    rows from there (a row is read when a batch needs it), never a list of every row in memory."""
    import datasets  # heavy: pyarrow; this module's top stays light for validate

    train = datasets.load_from_disk(str(folder / "train"))
    eval_rows = datasets.load_from_disk(str(folder / "eval")) if (folder / "eval").is_dir() else None
    return train, eval_rows


def prune(root: Path, keep: int = KEEP) -> None:
    metas = sorted(root.glob(f"*/{META}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for meta in metas[keep:]:
        shutil.rmtree(meta.parent, ignore_errors=True)


# ------------------------------------------------------------------------------------------ a run's rows
class _Recorder:
    """Forwards log/warn to the run folder and keeps the lines, so a cache hit can show them again."""

    def __init__(self, run_dir):
        self.run_dir, self.lines, self.warnings = run_dir, [], []

    def log(self, message: str) -> None:
        self.lines.append(message)
        self.run_dir.log(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        self.run_dir.warn(message)


def tokenized_rows(spec, run_dir, stage: str, tokenizer, template,
                   load_examples: Callable[[Any], tuple[list, list]],
                   tokenize: Callable[[list, list, Callable], tuple[list, list | None, str]],
                   need_examples: bool = False) -> tuple[Any, Any, list]:
    """(train rows, eval rows or None, held-out examples): from the cache when its key matches, else
    load_examples(log_target) -> (train examples, held-out examples) and tokenize(train, held_out, warn) ->
    (train rows, eval rows, stats line), saved for the next run. need_examples: the held-out examples are
    needed after tokenizing (eval_metric, do_predict), so they are loaded even on a hit. Rows from the cache (a hit,
    or tokenized and saved now) are datasets.Dataset memory-mapped from its Arrow files; lists where no cache is
    written (streaming, no local file, a rank other than 0)."""
    if getattr(spec, "streaming", False):  # a stream is tokenized as it is read (validate refuses tokenized_path)
        train_examples, held_out = load_examples(run_dir)
        train, eval_rows, stats = tokenize(train_examples, held_out, run_dir.warn)
        run_dir.log(stats)
        return train, eval_rows, held_out
    parts, no_default = cache_key(spec, stage, tokenizer, template)
    key = key_id(parts)
    if spec.tokenized_path:
        folder = Path(spec.tokenized_path).expanduser()
        problem = folder_problem(folder)
        if problem:
            raise ValueError(f"tokenized_path: {problem}")
    elif no_default:
        folder = None
        run_dir.log(f"tokenized cache: not used ({no_default}); set tokenized_path to keep one anyway")
    else:
        folder = default_root() / key
    meta = read_meta(folder) if folder is not None else None
    if folder is not None and meta and meta.get("key") == key and not spec.overwrite_cache:
        started = time.time()
        train, eval_rows = load(folder)
        run_dir.log(f"loaded the tokenized dataset from {folder} (key {key}) in {time.time() - started:.1f} s: "
                    f"{len(train)} train rows" + (f", {len(eval_rows)} eval rows" if eval_rows else ""))
        held_out: list = []
        if need_examples:
            _, held_out = load_examples(run_dir)
        else:
            for line in meta.get("lines", []):
                run_dir.log(line)
        for message in meta.get("warnings", []):
            run_dir.warn(message)
        run_dir.log(meta.get("stats", ""))
        return train, eval_rows, held_out
    if folder is not None:
        if spec.overwrite_cache:
            why = "overwrite_cache is true"
        elif meta:
            why = f"the cache in {folder} was made for other data or settings: " + "; ".join(
                differences(meta["parts"], parts) or ["its key differs"])
        elif spec.tokenized_path:
            why = f"no tokenized cache in {folder} yet"
        else:
            older = _newest_of_same_data(default_root(), parts)
            why = ("the newest cache of these datasets differs: " + "; ".join(differences(older["parts"], parts))
                   if older else "no tokenized cache of these datasets yet")
        run_dir.log(f"tokenizing (key {key}): {why}")
    recorder = _Recorder(run_dir)
    train_examples, held_out = load_examples(recorder)
    if folder is None or not run_dir.writer:  # no cache written (rank 0 alone writes): the rows as lists, as before
        train, eval_rows, stats = tokenize(train_examples, held_out, recorder.warn)
        run_dir.log(stats)
        return train, eval_rows, held_out
    # each tokenized batch goes to an Arrow file as it comes (preprocess.rows_in_arrow), the cache is saved from those
    # files, and the run trains on the saved cache, memory-mapped: the same path a second run takes
    spill = folder.parent / f".{folder.name}.rows-{os.getpid()}"
    shutil.rmtree(spill, ignore_errors=True)
    try:
        with rows_in_arrow(spill):
            train, eval_rows, stats = tokenize(train_examples, held_out, recorder.warn)
        del train_examples  # tokenized: the examples need not stay in memory while the rows are saved and trained on
        run_dir.log(stats)
        meta = {"version": CACHE_VERSION, "key": key, "parts": parts, "created": time.time(), "stats": stats,
                "lines": recorder.lines, "warnings": recorder.warnings}
        save(folder, train, eval_rows, meta)
        del train, eval_rows  # the spilled files' datasets: the run reads the saved cache instead
        train, eval_rows = load(folder)
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    run_dir.log(f"saved the tokenized dataset to {folder} (key {key})")
    if not spec.tokenized_path:
        prune(default_root())
    return train, eval_rows, held_out
