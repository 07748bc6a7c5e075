"""Streaming datasets (`streaming: true`): the data files are read lazily by datasets' own streaming loaders
(json/jsonl, csv, parquet, arrow, text) into a `datasets.IterableDataset`, so memory holds the shuffle buffer and
the rows of the current batches, never the file: peak RSS does not grow with the dataset.

The stream: each dataset's file rows -> normalized examples (data.convert_row: the same schema checks and row
refusals as a loaded dataset); the datasets mixed (mix_strategy: concat, or datasets.interleave_datasets with
interleave_probs, seed and LLaMA-Factory's stopping strategies); the first val_size examples held out (a row count:
a share of a stream is unknown); the rest shuffled in a buffer of buffer_size examples (seeded; datasets reseeds it
each pass by the epoch: the buffer holds text, not token lists), then tokenized as the trainer reads it (the same
encoders as build_sft_dataset / build_pt_dataset: templating, label masks, cutoff) and, with packing, packed window
by window.

Resuming: the stream is a pure function of the files and the seed, so the Trainer's own resume (it reads the
batches of the steps already trained again and skips them: `skip_first_batches`) continues at the next unread row,
neither repeating nor skipping one. Bad rows are skipped and the first few named in the run log (a stream has no
end to count them at)."""
from __future__ import annotations

import csv
from pathlib import Path

import datasets

from backend.core import paths
from backend.core.dataset_info import DatasetError, resolve_dataset_dir, read_dataset_info
from backend.dataprep.data import (FILE_TYPES, MAX_REASONS, MIX_STRATEGIES, RowError, _check_stage, _data_files,
                                   _entry_spec, _fill_identity, _kind, _names, _required_columns, add_default_system,
                                   convert_row, load_examples)
from backend.dataprep.preprocess import build_pt_dataset, build_sft_dataset, encode_example, encode_text, pack_rows

TOKEN_COLUMNS = ["input_ids", "labels", "attention_mask"]
SOURCE = "_source"  # the dataset a streamed row came from (the collators read only the token columns)
EXAMPLE = "example"  # a normalized example (data.py's format) in the stream before tokenizing
JSON_CHUNK = 1 << 20  # bytes of a json/jsonl file read at a time
PACK_WINDOW = 256  # rows bin-packed together (pack_rows) as the stream passes: the packing's look-ahead


def open_stream(name: str, entry: dict, dataset_dir: Path, info_path: Path,
                stage: str) -> tuple[datasets.IterableDataset, list[str]]:
    """(the raw rows of one dataset_info.json entry, read lazily; their columns): the columns the stage needs are
    checked on the first row (one line naming the file and the column)."""
    spec = _entry_spec(name, entry)
    _check_stage(name, spec, stage)
    if entry.get("num_samples"):
        raise DatasetError(f"dataset '{name}': num_samples draws rows at random from the whole file, which a stream "
                           "cannot: drop num_samples or use max_samples (the first rows)")
    files = _data_files(name, entry, dataset_dir, info_path)
    builders = sorted({FILE_TYPES[p.suffix.lower()] for p in files})
    if len(builders) > 1:
        raise DatasetError(f"dataset '{name}': a streamed dataset's files must be of one type, got "
                           f"{', '.join(builders)}")
    kwargs = {}
    if builders[0] == "json":  # read 1 MB of text at a time (datasets' default, 10 MB, is held as text and Arrow)
        kwargs["chunksize"] = JSON_CHUNK
    if builders[0] == "csv":  # every cell as text, and a byte order mark not part of a column, as data.read_rows
        kwargs["encoding"] = "utf-8-sig"
        with files[0].open(encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f), [])
        kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in header})
    try:
        raw = datasets.load_dataset(builders[0], data_files=[str(p) for p in files], split=entry.get("split", "train"),
                                    streaming=True, cache_dir=str(paths.cache_dir() / "datasets"), **kwargs)
        first = next(iter(raw), None)
    except Exception as exc:  # datasets wraps parser errors in several exception types
        cause = exc.__cause__ or exc
        raise DatasetError(f"dataset '{name}': could not read {', '.join(map(str, files))}: "
                           f"{type(cause).__name__}: {cause}") from None
    if first is None:
        raise DatasetError(f"dataset '{name}': {', '.join(map(str, files))} has no rows")
    for key in _required_columns(spec, stage):
        col = spec.columns[key]
        if col not in first and not (_kind(stage) == "text" and key in ("response", "query")):
            raise DatasetError(f"dataset '{name}': {files[0]} has no column '{col}' (columns.{key}); "
                               f"its columns are: {', '.join(sorted(first))}")
    return raw, list(raw.column_names or first)


class _Examples:
    """A batch of one dataset's file rows -> normalized examples (a batched map function, data.convert_row: the
    same schema checks as a loaded dataset); the rows it refuses are skipped, the first few named through `warn`."""

    def __init__(self, name: str, entry: dict, stage: str, *, identity: tuple[str, str], default_system: str | None,
                 skipped: "_Skipped"):
        self.name, self.spec, self.stage = name, _entry_spec(name, entry), stage
        self.identity, self.default_system, self.skipped = identity, default_system, skipped

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = {EXAMPLE: [], SOURCE: []}
        for number, values in zip(indices, zip(*batch.values())):
            try:
                example = _fill_identity(convert_row(dict(zip(batch, values)), self.spec, self.stage), *self.identity)
            except RowError as exc:
                self.skipped(f"dataset {self.name} row {number}", str(exc))
                continue
            example["_row"], example["_source"] = number, self.name
            out[EXAMPLE].append(add_default_system([example], self.default_system)[0])
            out[SOURCE].append(self.name)
        return out


class _Skipped:
    """Names the first MAX_REASONS skipped rows in the run log, each once (a stream is read again on resume and
    on each pass; it has no end to count them at)."""

    def __init__(self, warn):
        self.warn, self.named = warn, set()

    def __call__(self, row: str, reason: str) -> None:
        if len(self.named) < MAX_REASONS and row not in self.named:
            self.named.add(row)
            self.warn(f"streaming: {row} skipped: {reason}"
                      + (" (further skipped rows are not listed)" if len(self.named) == MAX_REASONS else ""))


def _tokens(encode, skipped: _Skipped):
    """A batch of examples -> token rows (a batched map function): the encoders of build_sft_dataset /
    build_pt_dataset; a row the template refuses, or left with no trained token, is skipped."""
    def tokenize(batch: dict) -> dict:
        out = {key: [] for key in TOKEN_COLUMNS + [SOURCE]}
        for example, source in zip(batch[EXAMPLE], batch[SOURCE]):
            where = f"dataset {source} row {example.get('_row')}"
            try:
                kept = [e for e in encode(example) if e.num_trained > 0]
            except ValueError as exc:
                skipped(where, str(exc))
                continue
            if not kept:
                skipped(where, "no trained token left (an empty text, or an answer cut away by cutoff_len)")
            for enc in kept:
                out["input_ids"].append(enc.input_ids)
                out["labels"].append(enc.labels)
                out["attention_mask"].append([1] * len(enc.input_ids))
                out[SOURCE].append(source)
        return out

    return tokenize


def encoder(spec, stage: str, tokenizer, template):
    """example -> [Encoded]: the encoders of build_sft_dataset (one row) and build_pt_dataset (blocks of
    cutoff_len, each document ending with eos)."""
    if stage == "pt":
        add_bos = tokenizer.bos_token_id is not None and tokenizer.bos_token_id != tokenizer.eos_token_id
        return lambda example: encode_text(example["text"], tokenizer, spec.cutoff_len, add_bos, True)
    return lambda example: [encode_example(example, template, tokenizer, spec.cutoff_len,
                                           train_on_prompt=spec.train_on_prompt, mask_history=spec.mask_history)]


def example_stream(spec, stage: str, skipped: _Skipped) -> datasets.IterableDataset:
    """The datasets of `spec.dataset` as normalized examples (column EXAMPLE, and SOURCE: the dataset's name),
    each read lazily, mixed by mix_strategy."""
    dataset_dir = resolve_dataset_dir(spec.resolved_dataset_dir())
    info = read_dataset_info(dataset_dir)
    parts = []
    for name in _names(spec.dataset):
        entry = info.entry(name)
        raw, columns = open_stream(name, entry, dataset_dir, dataset_dir / "dataset_info.json", stage)
        if spec.max_samples:
            raw = raw.take(spec.max_samples)
        examples = _Examples(name, entry, stage, identity=(spec.identity_name, spec.identity_author),
                             default_system=spec.default_system, skipped=skipped)
        parts.append(raw.map(examples, batched=True, batch_size=64, with_indices=True, remove_columns=columns))
    return mix_streams(parts, spec.mix_strategy, spec.interleave_probs, spec.seed)


def tokenize_stream(examples: datasets.IterableDataset, spec, stage: str, tokenizer, template,
                    skipped: _Skipped) -> datasets.IterableDataset:
    """Examples -> token rows (TOKEN_COLUMNS and SOURCE), tokenized as they are read."""
    return examples.map(_tokens(encoder(spec, stage, tokenizer, template), skipped), batched=True, batch_size=64,
                        remove_columns=[EXAMPLE, SOURCE])


def token_stream(spec, stage: str, tokenizer, template, warn=print) -> datasets.IterableDataset:
    """The mixed datasets' token rows in stream order (no head held out, no shuffle): what the mix produces."""
    skipped = _Skipped(warn)
    return tokenize_stream(example_stream(spec, stage, skipped), spec, stage, tokenizer, template, skipped)


def mix_streams(parts: list, strategy: str = "concat", probs=None, seed: int = 42):
    """Several streams -> one: concat one after the other, or datasets.interleave_datasets with stopping
    strategy first_exhausted (interleave_under) / all_exhausted (interleave_over), round robin or, with
    `probs`, a seeded random draw of the next dataset: the library's semantics, as data.mix_datasets."""
    if len(parts) == 1:
        return parts[0]
    if strategy == "concat":
        return datasets.concatenate_datasets(parts)
    if isinstance(probs, str):
        probs = [float(p) for p in probs.split(",") if p.strip()]
    return datasets.interleave_datasets(parts, probabilities=list(probs) if probs else None, seed=seed,
                                        stopping_strategy=MIX_STRATEGIES[strategy])


def pack_stream(rows: datasets.IterableDataset, cutoff_len: int) -> datasets.IterableDataset:
    """Packing on the stream: each window of PACK_WINDOW rows is bin-packed by pack_rows (the same sequences,
    position_ids and row-start labels as a loaded dataset's packing, within the window)."""
    def pack(batch: dict) -> dict:
        packed = pack_rows([{"input_ids": i, "labels": la} for i, la in zip(batch["input_ids"], batch["labels"])],
                           cutoff_len)
        return {key: [p[key] for p in packed] for key in ("input_ids", "labels", "position_ids")}

    return rows.map(pack, batched=True, batch_size=PACK_WINDOW, remove_columns=TOKEN_COLUMNS + [SOURCE])


def streamed_rows(spec, run_dir, stage: str, tokenizer, template=None):
    """(train stream, eval rows or None, held-out examples) for a streaming sft/pt run, the shape of the
    stages' tokenized(): the first val_size examples of the stream held out (or eval_dataset, read into memory) and
    tokenized as a loaded dataset; the rest shuffled in a buffer of buffer_size examples (text: compact, so the
    buffer's memory is that of the rows' text), then tokenized as the trainer reads it."""
    skipped = _Skipped(run_dir.warn)
    examples = example_stream(spec, stage, skipped)
    if next(iter(examples), None) is None:  # every row refused: say so now, not after max_steps of empty passes
        raise DatasetError(f"streaming: no usable rows in dataset {spec.dataset} (see the skipped rows above)")
    head = int(spec.val_size) if spec.val_size >= 1 else 0
    val_examples = [r[EXAMPLE] for r in examples.take(head)] if head else []
    if head:
        examples = examples.skip(head)
    if spec.eval_dataset:
        val_examples, report = load_examples(
            spec.eval_dataset, spec.resolved_dataset_dir(), stage=stage, max_samples=spec.max_samples,
            identity_name=spec.identity_name, identity_author=spec.identity_author, seed=spec.seed,
            default_system=spec.default_system, mix_strategy=spec.mix_strategy, interleave_probs=spec.interleave_probs)
        for line in report.summary_lines():
            run_dir.log(line)
    eval_rows = None
    if val_examples and stage == "pt":
        add_bos = tokenizer.bos_token_id is not None and tokenizer.bos_token_id != tokenizer.eos_token_id
        eval_rows = build_pt_dataset(val_examples, tokenizer, spec.cutoff_len, add_bos=add_bos, log=run_dir.warn)[0]
    elif val_examples:
        eval_rows = build_sft_dataset(val_examples, template, tokenizer, spec.cutoff_len,
                                      train_on_prompt=spec.train_on_prompt, mask_history=spec.mask_history,
                                      log=run_dir.warn)[0]
    shuffled = examples.shuffle(seed=spec.seed, buffer_size=spec.buffer_size)
    train = tokenize_stream(shuffled, spec, stage, tokenizer, template, skipped)
    run_dir.log(f"streaming: dataset {spec.dataset} read lazily ({spec.mix_strategy}"
                + (f", probabilities {spec.interleave_probs}" if spec.interleave_probs else "")
                + f"), shuffled in a buffer of {spec.buffer_size} rows (seed {spec.seed}), tokenized as read, "
                f"{spec.max_steps} steps" + (f"; the first {head} rows held out for evaluation" if head else ""))
    return train, eval_rows, val_examples
