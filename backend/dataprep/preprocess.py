"""Segments + tokenizer -> input_ids / labels; truncation; packing; collators.

Labels come from character offsets, never from ``input_ids != pad_id``: the rendered conversation
(``Template.render`` -> list of Segment(text, trained, role)) is joined and tokenized ONCE, and each
token is labelled by the segments its characters come from. Tokenizing once keeps the ids identical to
tokenizing the whole string (no merge artefacts where two segments meet), and the stop token stays
trained even where pad == eos (SmolLM2: both are ``<|im_end|>``).

Label rule for a token that straddles a segment boundary: it is trained if ANY of its characters lies in
a trained segment. Why not "only if it starts in a trained segment": with templates whose scaffold ends
in a space ("[/INST] ", "Assistant: "), SentencePiece/byte-level BPE merge that space into the first
word of the answer ("ĠHello", "▁Hello"); starting-char labelling would never train the first token of
every answer. Training such a token only teaches the model to emit text that belongs to its answer.
A zero-width token (offsets (i, i)) takes the label of the segment at i.

``num_trained`` counts the labels the loss can use: position 0 is never a prediction target (the model
shifts labels by one), so it is the number of non -100 labels after position 0. It is also exactly what
the HF Trainer counts as ``num_items_in_batch``.

Truncation to ``cutoff_len`` (see ``encode_example`` and ``encode_segments``):
1. message level (``encode_example``): while the rendered row is too long, drop the oldest exchanges
   (a user message and the assistant/tool messages after it) that come after the system prompt, and
   re-render, so the template formats the shorter conversation exactly as it would any other (BOS,
   folded system prompts, ...). The last exchange is never dropped.
2. token level (``encode_segments``), if the row is still too long: let A be the first token of the last
   answer (the last run of trained assistant segments: content, then its end-of-turn marker) and
   R = everything from A on. The prompt keeps
   ``max(cutoff_len - len(R), min(A, cutoff_len // 2))`` tokens: up to half of that budget from the start
   (BOS, system prompt: the tokens before the first user segment) and the rest from the END of the prompt,
   so the role header right before the answer survives; the middle of the prompt is cut. The response is
   then cut from the right to fit. So the beginning of the last answer is always kept, and a long answer
   keeps at least half the window. ``truncated`` is set whenever anything was cut. Truncation thus never
   removes every trained token; a row with ``num_trained == 0`` is one that trained nothing to begin with
   (e.g. an empty answer in a template without end-of-turn marker): the caller drops it and counts it.
   Rows the template refuses to render are skipped and counted by ``build_sft_dataset`` (one bad row
   must not end a run; all rows bad is an error naming the first few).

Packing (``pack_rows`` + ``PackedCollator``): whole rows are bin-packed into sequences of at most
``cutoff_len`` tokens; ``position_ids`` restart at 0 for every original row and the label at every row
start is -100 (the last token of row A must not learn to predict the first token of row B). The
collator flattens a batch into ONE row with ``position_ids`` and no ``attention_mask``: transformers 5
then detects the packed rows from the position_ids (``masking_utils.find_packed_sequence_indices``) and
builds a block-diagonal causal mask for sdpa/eager, and flash-attention derives ``cu_seqlens`` from them
(``modeling_flash_attention_utils._is_packed_sequence``; it needs batch size 1). That detection only runs
when the model holds no cache (``_preprocess_mask_arguments``: ``attention_mask is None and cache is
None``); a model with ``config.use_cache=True`` builds a DynamicCache in forward and then rows DO attend
to each other (measured: logit error ~0.17 on a tiny Llama). The Trainer sets ``config.use_cache`` from
``TrainingArguments.use_cache`` (False by default), but a recipe may set it, so the collator also passes
``use_cache=False`` with every batch.
"""
from __future__ import annotations

import bisect
from array import array
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from backend.core.supervise import die_with_parent
import signal
import multiprocessing
import os

IGNORE_INDEX = -100


@dataclass
class Encoded:
    """One tokenized row. ``labels[i]`` is ``input_ids[i]`` where trained, else -100."""

    input_ids: list[int]
    labels: list[int]
    truncated: bool = False
    num_trained: int = 0
    tokens: list[str] | None = None


def count_trained(labels: Sequence[int]) -> int:
    """Labels the loss can use: non -100 after position 0 (position 0 is never predicted)."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def _check_cutoff(cutoff_len: int | None) -> None:
    if cutoff_len is not None and (not isinstance(cutoff_len, int) or cutoff_len < 2):
        raise ValueError(f"cutoff_len must be an integer >= 2 (or None for no limit), got {cutoff_len!r}")


# --------------------------------------------------------------------------------------------------
# segments -> ids / labels
# --------------------------------------------------------------------------------------------------


@dataclass
class _Tokenized:
    input_ids: list[int]
    trained: list[bool]
    segment_of: list[int]  # index (into the non-empty segments) of the segment each token starts in


def _tokenize_with_offsets(segments: Sequence[Any], tokenizer) -> _Tokenized:
    """Tokenize the joined text once and label tokens by char offsets (fast tokenizers)."""
    text = "".join(s.text for s in segments)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        enc = backend.encode(text, add_special_tokens=False)  # what tokenizer(text) runs, without its per-call wrapping
        ids, offsets = enc.ids, enc.offsets
    else:  # a tokenizer.json with truncation/padding of its own: transformers turns them off for the call
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    starts: list[int] = []
    pos = 0
    for seg in segments:
        starts.append(pos)
        pos += len(seg.text)
    last = len(segments) - 1
    # per token, in numpy (a Python loop over the tokens was most of the preprocessing time): the segment its first
    # and its last character lie in, and whether any segment from the first to the last is trained (a prefix sum)
    bounds = np.asarray(starts)
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    first_seg = np.clip(np.searchsorted(bounds, spans[:, 0], side="right") - 1, 0, last)
    last_seg = np.minimum(np.maximum(np.searchsorted(bounds, spans[:, 1] - 1, side="right") - 1, first_seg), last)
    trained_so_far = np.concatenate(([0], np.cumsum([bool(s.trained) for s in segments])))
    trained = trained_so_far[last_seg + 1] - trained_so_far[first_seg] > 0
    return _Tokenized(ids, trained.tolist(), first_seg.tolist())


def _tokenize_per_segment(segments: Sequence[Any], tokenizer) -> _Tokenized:
    """Fallback for slow tokenizers (no offsets): each segment is tokenized on its own and the ids are
    concatenated. Ids may then differ slightly from tokenizing the whole string where two segments meet."""
    ids: list[int] = []
    trained: list[bool] = []
    segment_of: list[int] = []
    for idx, seg in enumerate(segments):
        seg_ids = tokenizer.encode(seg.text, add_special_tokens=False)
        ids.extend(seg_ids)
        trained.extend([bool(seg.trained)] * len(seg_ids))
        segment_of.extend([idx] * len(seg_ids))
    return _Tokenized(ids, trained, segment_of)


def _truncate(tok: _Tokenized, segments: Sequence[Any], cutoff_len: int) -> tuple[list[int], list[bool]]:
    """Token-level truncation; see the module docstring (step 2)."""
    ids, trained, seg_of = tok.input_ids, tok.trained, tok.segment_of
    n = len(ids)
    answer_seg = _last_index(segments, lambda s: s.role == "assistant" and s.trained)
    if answer_seg is None:
        answer_seg = _last_index(segments, lambda s: s.trained and s.role != "bos")
    if answer_seg is None:  # nothing trained anyway: keep the start
        return ids[:cutoff_len], trained[:cutoff_len]
    # the answer may be several trained assistant segments (content, then the end-of-turn marker)
    while answer_seg > 0 and segments[answer_seg - 1].role == segments[answer_seg].role and segments[answer_seg - 1].trained:
        answer_seg -= 1
    # first token carrying text of the answer segment (it may start in the scaffold before it)
    answer_start = next((i for i in range(n) if seg_of[i] >= answer_seg), n)
    prev = answer_start - 1
    if prev >= 0 and trained[prev] and not segments[seg_of[prev]].trained:
        answer_start = prev  # a token that starts in the scaffold but carries the answer's first characters
    response_len = n - answer_start
    prompt_budget = max(cutoff_len - response_len, min(answer_start, cutoff_len // 2))
    if prompt_budget >= answer_start:
        keep = list(range(answer_start))
    else:
        first_user = next((i for i in range(answer_start) if segments[seg_of[i]].role == "user"), 0)
        head = min(first_user, prompt_budget // 2)
        tail = prompt_budget - head
        keep = list(range(head)) + list(range(answer_start - tail, answer_start))
    room = cutoff_len - len(keep)
    keep += list(range(answer_start, min(n, answer_start + room)))
    return [ids[i] for i in keep], [trained[i] for i in keep]


def _last_index(items: Sequence[Any], pred: Callable[[Any], bool]) -> int | None:
    for i in range(len(items) - 1, -1, -1):
        if pred(items[i]):
            return i
    return None


def encode_segments(segments: Sequence[Any], tokenizer, cutoff_len: int | None, *,
                    return_tokens: bool = False) -> Encoded:
    """Rendered segments (objects with ``text``, ``trained``, ``role``) -> ids and labels.

    Tokenizes the joined text once with ``add_special_tokens=False`` (BOS, when the family uses one, is
    already text in the first segment; special tokens written as text are recognised by fast
    tokenizers). Slow tokenizers (no offset mapping) fall back to per-segment tokenization.
    ``cutoff_len=None`` means no limit.
    """
    _check_cutoff(cutoff_len)
    segments = [s for s in segments if s.text]
    if not segments:
        return Encoded([], [], False, 0, [] if return_tokens else None)
    if getattr(tokenizer, "is_fast", False):
        tok = _tokenize_with_offsets(segments, tokenizer)
    else:
        tok = _tokenize_per_segment(segments, tokenizer)
    truncated = cutoff_len is not None and len(tok.input_ids) > cutoff_len
    if truncated:
        ids, trained = _truncate(tok, segments, cutoff_len)
    else:
        ids, trained = tok.input_ids, tok.trained
    labels = [i if t else IGNORE_INDEX for i, t in zip(ids, trained)]
    tokens = tokenizer.convert_ids_to_tokens(ids) if return_tokens else None
    return Encoded(list(ids), labels, truncated, count_trained(labels), tokens)


# --------------------------------------------------------------------------------------------------
# examples -> rows
# --------------------------------------------------------------------------------------------------


def _row_name(example: dict) -> str:
    return f"{example.get('_source', 'dataset')} row {example.get('_row', '?')}"


def _split_exchanges(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """Leading system messages, then exchanges: each starts at a user message that follows a non-user one."""
    k = 0
    while k < len(messages) and messages[k].get("role") == "system":
        k += 1
    system, exchanges = messages[:k], []
    for msg in messages[k:]:
        starts_new = msg.get("role") == "user" and (not exchanges or exchanges[-1][-1].get("role") != "user")
        if starts_new or not exchanges:
            exchanges.append([msg])
        else:
            exchanges[-1].append(msg)
    return system, exchanges


def encode_example(example: dict, template, tokenizer, cutoff_len: int | None, *,
                   train_on_prompt: bool = False, mask_history: bool = False,
                   return_tokens: bool = False) -> Encoded:
    """A normalized SFT example -> Encoded, with the truncation rule of the module docstring."""
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{_row_name(example)}: 'messages' must be a non-empty list of messages")
    tools = example.get("tools")

    def encode(msgs: list[dict]) -> Encoded:
        try:
            segments = template.render(msgs, tools=tools, train_on_prompt=train_on_prompt,
                                       mask_history=mask_history)
        except ValueError as exc:
            raise ValueError(f"{_row_name(example)}: {exc}") from exc
        return encode_segments(segments, tokenizer, cutoff_len, return_tokens=return_tokens)

    enc = encode(messages)
    if not enc.truncated:
        return enc
    system, exchanges = _split_exchanges(messages)
    for first_kept in range(1, len(exchanges)):
        shorter = system + [m for ex in exchanges[first_kept:] for m in ex]
        candidate = encode(shorter)
        if candidate.num_trained == 0:
            break
        fits = not candidate.truncated  # True: no token-level cut was needed any more
        candidate.truncated = True
        enc = candidate
        if fits:
            break
    return enc


def encode_text(text: str, tokenizer, cutoff_len: int | None, add_bos: bool, add_eos: bool) -> list[Encoded]:
    """A pre-training text -> chunks of at most cutoff_len tokens, every token trained.

    Long texts are split into consecutive blocks (standard causal-LM grouping, per document, so no block
    mixes two documents) instead of being cut; a final block of a single token has nothing to predict and
    is left out."""
    _check_cutoff(cutoff_len)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if add_bos:
        if tokenizer.bos_token_id is None:
            raise ValueError("add_bos=True but the tokenizer has no bos_token")
        ids = [tokenizer.bos_token_id] + ids
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("add_eos=True but the tokenizer has no eos_token")
        ids = ids + [tokenizer.eos_token_id]
    size = cutoff_len or max(len(ids), 1)
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    return [Encoded(list(c), list(c), False, len(c) - 1) for c in chunks if len(c) >= 2]


# --------------------------------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------------------------------


@dataclass
class Stats:
    """What preprocessing did to a dataset, for the log and status.json warnings."""

    rows_in: int = 0
    rows: int = 0
    truncated: int = 0
    dropped: int = 0
    dropped_ids: list[str] = field(default_factory=list)  # first few "<source> row <n>"
    truncated_ids: list[str] = field(default_factory=list)  # first few "<source> row <n>" longer than cutoff_len
    failed: int = 0  # rows the template refused (e.g. a conversation that does not end with an answer)
    failed_reasons: list[str] = field(default_factory=list)  # first few "<source> row <n>: <error>"
    total_tokens: int = 0
    trained_tokens: int = 0
    cutoff_len: int | None = None
    workers: int = 1  # processes that tokenized (preprocessing_num_workers)

    MAX_IDS = 5

    def merge(self, other: "Stats") -> None:
        """Add another slice's counts (the first few ids/reasons stay the first few overall)."""
        for name in ("rows_in", "rows", "truncated", "dropped", "failed", "total_tokens", "trained_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.dropped_ids = (self.dropped_ids + other.dropped_ids)[: self.MAX_IDS]
        self.truncated_ids = (self.truncated_ids + other.truncated_ids)[: self.MAX_IDS]
        self.failed_reasons = (self.failed_reasons + other.failed_reasons)[: self.MAX_IDS]

    def __str__(self) -> str:
        return (f"{self.rows} rows from {self.rows_in} ({self.truncated} truncated, {self.dropped} dropped, "
                f"{self.failed} skipped), {self.total_tokens:,} tokens, {self.trained_tokens:,} trained"
                + (f", tokenized in {self.workers} processes" if self.workers > 1 else ""))

    def warnings(self) -> list[str]:
        lines = []
        if self.failed:
            more = "; ..." if self.failed > len(self.failed_reasons) else ""
            lines.append(f"{self.failed} rows could not be rendered and were skipped: "
                         f"{'; '.join(self.failed_reasons)}{more}")
        if self.truncated:
            more = ", ..." if self.truncated > len(self.truncated_ids) else ""
            rows = f": {', '.join(self.truncated_ids)}{more}" if self.truncated_ids else ""
            lines.append(f"{self.truncated} rows truncated to cutoff_len={self.cutoff_len}{rows}")
        if self.dropped:
            more = ", ..." if self.dropped > len(self.dropped_ids) else ""
            lines.append(f"{self.dropped} rows left with no trained token were dropped: "
                         f"{', '.join(self.dropped_ids)}{more}")
        return lines


def _row(enc: Encoded) -> dict:
    return {"input_ids": enc.input_ids, "labels": enc.labels, "attention_mask": [1] * len(enc.input_ids)}


def _finish(rows: list[dict], stats: Stats, log: Callable[[str], Any] | None, what: str) -> tuple[list[dict], Stats]:
    stats.rows = len(rows)
    for line in stats.warnings():
        if log is not None:
            log(line)
    if not rows:
        examples = stats.failed_reasons + stats.dropped_ids
        raise ValueError(f"no usable rows in the {what} dataset: all {stats.rows_in} rows were dropped or skipped "
                         f"({'; '.join(examples[:Stats.MAX_IDS])}{'; ...' if len(examples) > Stats.MAX_IDS else ''})")
    return rows, stats


def build_sft_dataset(examples: Iterable[dict], template, tokenizer, cutoff_len: int | None, *,
                      train_on_prompt: bool = False, mask_history: bool = False,
                      log: Callable[[str], Any] | None = None, num_workers: int | None = None) -> tuple[list[dict], Stats]:
    """Normalized examples -> rows {input_ids, labels, attention_mask} (a list: the HF Trainer takes any
    sized sequence, and ``pack_rows`` works on it directly), plus Stats. Rows with no trained token left
    are dropped and counted; one warning line per kind goes to ``log``. Every row dropped -> ValueError.
    num_workers > 1 tokenizes in that many processes (see in_workers): the same rows, in the same order."""
    rows, stats = in_workers(_sft_rows, list(examples), num_workers, template=template, tokenizer=tokenizer,
                             cutoff_len=cutoff_len, train_on_prompt=train_on_prompt, mask_history=mask_history)
    return _finish(rows, stats, log, "sft")


def _sft_rows(examples: list[dict], template, tokenizer, cutoff_len: int | None, *, train_on_prompt: bool,
              mask_history: bool) -> tuple[list[dict], Stats]:
    stats = Stats(cutoff_len=cutoff_len)
    rows: list[dict] = []
    for example in examples:
        stats.rows_in += 1
        try:
            enc = encode_example(example, template, tokenizer, cutoff_len,
                                 train_on_prompt=train_on_prompt, mask_history=mask_history)
        except ValueError as exc:  # one bad conversation must not end the run; all bad -> error below
            stats.failed += 1
            if len(stats.failed_reasons) < Stats.MAX_IDS:
                stats.failed_reasons.append(str(exc))
            continue
        stats.truncated += enc.truncated
        if enc.truncated and len(stats.truncated_ids) < Stats.MAX_IDS:
            stats.truncated_ids.append(_row_name(example))
        if enc.num_trained == 0:
            stats.dropped += 1
            if len(stats.dropped_ids) < Stats.MAX_IDS:
                stats.dropped_ids.append(_row_name(example))
            continue
        stats.total_tokens += len(enc.input_ids)
        stats.trained_tokens += enc.num_trained
        rows.append(_row(enc))
    return rows, stats


def build_pt_dataset(examples: Iterable[dict], tokenizer, cutoff_len: int | None, *,
                     add_bos: bool = False, add_eos: bool = True,
                     log: Callable[[str], Any] | None = None, num_workers: int | None = None) -> tuple[list[dict], Stats]:
    """Pre-training rows ({"text": ...}) -> blocks of at most cutoff_len tokens (see ``encode_text``).
    ``Stats.truncated`` stays 0 (long texts are chunked, not cut); empty texts are dropped and counted.
    num_workers as in build_sft_dataset."""
    rows, stats = in_workers(_pt_rows, list(examples), num_workers, tokenizer=tokenizer, cutoff_len=cutoff_len,
                             add_bos=add_bos, add_eos=add_eos)
    return _finish(rows, stats, log, "pt")


def _pt_rows(examples: list[dict], tokenizer, cutoff_len: int | None, *, add_bos: bool,
             add_eos: bool) -> tuple[list[dict], Stats]:
    stats = Stats(cutoff_len=cutoff_len)
    rows: list[dict] = []
    for example in examples:
        stats.rows_in += 1
        text = example.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{_row_name(example)}: a pre-training row needs a 'text' string")
        chunks = encode_text(text, tokenizer, cutoff_len, add_bos, add_eos)
        if not chunks:
            stats.dropped += 1
            if len(stats.dropped_ids) < Stats.MAX_IDS:
                stats.dropped_ids.append(_row_name(example))
            continue
        for enc in chunks:
            stats.total_tokens += len(enc.input_ids)
            stats.trained_tokens += enc.num_trained
            rows.append(_row(enc))
    return rows, stats


# --------------------------------------------------------------------------------------------------
# preprocessing_num_workers
# --------------------------------------------------------------------------------------------------

_FORKED: tuple | None = None  # (build, examples, batch size, kwargs), inherited by the forked workers (nothing is pickled in)
DEFAULT_BATCH_SIZE = 1000  # preprocessing_batch_size's default (LLaMA-Factory's too)


@dataclass
class _Tokenizing:
    batch_size: int = DEFAULT_BATCH_SIZE
    report: Callable[[int, int], Any] | None = None


_SETTINGS = _Tokenizing()
_ARROW_DIR: list = []  # the folder of the innermost rows_in_arrow block (see there), if any


@contextmanager
def rows_in_arrow(folder):
    """Inside this block every in_workers call writes its tokenized rows to an Arrow file in `folder` (datasets'
    ArrowWriter), batch by batch as they come back from the tokenizer processes, and returns them as a
    memory-mapped datasets.Dataset instead of a list: no process ever holds every row as Python objects (~56 bytes
    a token; Arrow: 8 per column). The tokenized cache (token_cache.tokenized_rows) tokenizes inside it; the
    files stay until the caller has saved or dropped the dataset (the caller owns the folder)."""
    _ARROW_DIR.append(Path(folder))
    try:
        yield
    finally:
        _ARROW_DIR.pop()


def _as_table(rows: list[dict]):
    """A batch's rows as one Arrow table (the same column types datasets infers from the lists: list<int64>)."""
    import pyarrow as pa  # heavy: loaded on use (rows_in_arrow), so importing this module stays light

    return pa.table({key: [row[key] for row in rows] for key in rows[0]}) if rows else None


class _ArrowRows:
    """Where in_workers puts the batches inside rows_in_arrow: one ArrowWriter file, returned memory-mapped."""

    def __init__(self, folder: Path):
        from datasets.arrow_writer import ArrowWriter  # heavy: loaded on use, see _as_table

        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rows-{len(list(folder.glob('rows-*.arrow')))}.arrow"
        self.writer, self.count = ArrowWriter(path=str(self.path)), 0

    def extend(self, table) -> None:
        if table is not None and table.num_rows:
            self.writer.write_table(table)
            self.count += table.num_rows

    def result(self):
        import datasets  # heavy: see _as_table

        self.writer.finalize()
        self.writer.close()
        return datasets.Dataset.from_file(str(self.path)) if self.count else []


@contextmanager
def tokenizing(batch_size: int | None = None, report: Callable[[int, int], Any] | None = None):
    """Inside this block every in_workers call (every stage's build_*_dataset) hands out its rows `batch_size` at a
    time (preprocessing_batch_size) and calls report(rows done, rows in all) at its start and after each batch, in
    the order the batches finish (a training run: RunDir.tokenizing_progress, the Train tab's tokenizing bar).
    The stages' build functions take no such arguments: a run sets them once, around its stage."""
    global _SETTINGS

    before = _SETTINGS
    _SETTINGS = _Tokenizing(int(batch_size or DEFAULT_BATCH_SIZE), report)
    try:
        yield
    finally:
        _SETTINGS = before


def _tokenizer_process_init() -> None:
    """First thing in each forked tokenizer process: SIGTERM kills it again, and it dies with the run.

    A fork inherits the run's signal handlers (backend.training.callbacks.StopSwitch: SIGTERM/SIGINT set a flag and
    return). Pool.terminate() (what leaving a `with Pool` block does) takes the task queue's read lock to drain
    it, then ends the workers still waiting on that lock with SIGTERM: a worker with the inherited handler
    swallowed the signal and waited forever, and the run hung in the pool's join (here: a rank of every
    2-process run). in_workers now ends the pool with close() + join() (each worker reads its end-of-work
    sentinel), and terminate()s only after an error; this reset covers a worker started after the signal came.
    SIGINT is ignored: Ctrl-C reaches the whole process group, and the run decides. PR_SET_PDEATHSIG: a killed
    run leaves no tokenizer process behind (each holds the queue's write end, so none would ever see EOF)."""

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def _run_batch(k: int) -> tuple[list[dict], Stats]:
    build, examples, size, kwargs = _FORKED
    rows, stats = build(examples[k * size:(k + 1) * size], **kwargs)
    return [_packed(row) for row in rows], stats


_SENT: tuple | None = None  # (build, kwargs), sent once to each spawned tokenizer process (rows_in_arrow)


def _spawned_process_init(build: Callable, kwargs: dict) -> None:
    global _SENT

    _tokenizer_process_init()
    _SENT = (build, kwargs)


def _run_sent_batch(examples: list[dict]) -> tuple[Any, Stats]:
    build, kwargs = _SENT
    rows, stats = build(examples, **kwargs)
    return _as_table(rows), stats


def _drain(pool, run: Callable, tasks: Iterable, take: Callable) -> None:
    """take(result) of each task, in order, as it finishes; then the pool ends (see _tokenizer_process_init)."""
    try:
        for part in pool.imap(run, tasks):
            take(part)
        pool.close()  # each worker reads its end-of-work sentinel and exits: no SIGTERM (terminate) to race
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _packed(row: dict) -> dict:
    """A row's lists of ints as arrays, for the trip back from a worker: pickled as one block of bytes each
    instead of an object per token (a list of ints comes back as new int objects, its labels no longer sharing
    the input_ids' ints)."""
    out = {}
    for key, value in row.items():
        out[key] = value
        if isinstance(value, list) and value and type(value[0]) is int:
            try:
                out[key] = array("q", value)
            except (TypeError, OverflowError):  # not all ints: sent as it is
                pass
    return out


def _unpacked(row: dict) -> dict:
    """The row _packed sent, as lists again: the labels share the input_ids' int objects and the one IGNORE_INDEX
    (about 8 bytes a label instead of 36; a row of a tokenizing process then weighs what the same row made here does)."""
    out = {key: value.tolist() if isinstance(value, array) else value for key, value in row.items()}
    ids, labels = out.get("input_ids"), out.get("labels")
    if isinstance(ids, list) and isinstance(labels, list) and len(ids) == len(labels):
        out["labels"] = [i if label == i else IGNORE_INDEX if label == IGNORE_INDEX else label
                         for i, label in zip(ids, labels)]
    return out


def in_workers(build: Callable[..., tuple[list[dict], Stats]], examples: list[dict], num_workers: int | None,
               **kwargs) -> tuple[list[dict], Stats]:
    """build(examples, **kwargs) -> (rows, stats), run on consecutive batches of the examples (the tokenizing
    block's batch size, see tokenizing()) in num_workers forked processes (preprocessing_num_workers), the results
    joined in order: the rows are exactly those of one process. Fork means the tokenizer and template are
    inherited, not pickled; each batch's rows come back as soon as it is done, so no process ever holds more than
    its batch besides the rows joined here. At most one worker per CPU and per example (batches are smaller when
    there are fewer rows than workers x batch size, so each worker gets some); with one, or where fork does not
    exist, the batches run here. Stats.workers says how many processes tokenized. Inside a rows_in_arrow block the
    processes are spawned instead (build and kwargs must pickle: the stages' build_* functions do), each batch comes
    back as an Arrow table and is written to the block's Arrow file at once, and the rows are returned as a
    memory-mapped datasets.Dataset (the same rows, in the same order)."""
    global _FORKED

    workers = min(int(num_workers or 1), os.cpu_count() or 1, max(len(examples), 1))
    size = max(1, min(_SETTINGS.batch_size, -(-len(examples) // workers)))  # a few rows: still one batch per worker
    batches = -(-len(examples) // size)
    report = _SETTINGS.report or (lambda done, total: None)
    arrow = _ArrowRows(_ARROW_DIR[-1]) if _ARROW_DIR and examples else None
    rows: Any = arrow if arrow is not None else []
    stats: Stats | None = None

    def take(part: tuple[Any, Stats]) -> None:
        nonlocal stats
        rows.extend(part[0])
        if stats is None:
            stats = part[1]
        else:
            stats.merge(part[1])
        report(stats.rows_in, len(examples))

    report(0, len(examples))
    if workers < 2 or (arrow is None and "fork" not in multiprocessing.get_all_start_methods()):
        for k in range(batches):
            part_rows, part_stats = build(examples[k * size:(k + 1) * size], **kwargs)
            take((_as_table(part_rows) if arrow is not None else part_rows, part_stats))
        workers = 1
    elif arrow is not None:
        # Arrow rows: the tokenizer processes are spawned, not forked. A fork starts with every page of the run (torch,
        # the tokenizer, all the examples: 680 MiB each at 200,000 alpaca rows, counted again per process); a spawned
        # one holds what tokenizing needs (~110 MiB): build and its kwargs (tokenizer, template) are sent once, each
        # batch's examples with the batch, and the rows come back as Arrow tables.
        # A ProcessPoolExecutor, not a Pool: a process that dies (killed, out of memory, a script that spawns
        # without an `if __name__ == "__main__"` guard) is a BrokenProcessPool error here, where a Pool waits forever.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_spawned_process_init, initargs=(build, kwargs)) as pool:
            in_flight: deque = deque()  # at most 2 batches a process sent ahead: not every example copied at once
            try:
                for k in range(batches):
                    in_flight.append(pool.submit(_run_sent_batch, examples[k * size:(k + 1) * size]))
                    if len(in_flight) >= 2 * workers:
                        take(in_flight.popleft().result())
                while in_flight:
                    take(in_flight.popleft().result())
            except BrokenProcessPool as exc:
                raise RuntimeError(f"a tokenizer process ended unexpectedly ({exc}): killed, or out of memory? "
                                   "preprocessing_num_workers: 1 tokenizes in the run's own process") from exc
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    else:
        _FORKED = (build, examples, size, kwargs)
        try:
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_tokenizer_process_init)
            _drain(pool, _run_batch, range(batches),
                   lambda part: take(([_unpacked(row) for row in part[0]], part[1])))
        finally:
            _FORKED = None
    if stats is None:
        return build([], **kwargs)
    stats.workers = workers
    return (arrow.result() if arrow is not None else rows), stats


# --------------------------------------------------------------------------------------------------
# packing and collators
# --------------------------------------------------------------------------------------------------


def pack_rows(rows: Sequence[dict], cutoff_len: int) -> list[dict]:
    """Best-fit-decreasing bin packing of whole rows into sequences of <= cutoff_len tokens.

    Each packed row has ``input_ids``, ``labels`` (-100 at every original row start) and
    ``position_ids`` (restarting at 0 per original row). Longest rows are placed first, each into the
    fullest sequence that still has room (a sorted list + bisect: O(n log n)). Deterministic."""
    _check_cutoff(cutoff_len)
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]["input_ids"]), i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for i in order:
        length = len(rows[i]["input_ids"])
        if length > cutoff_len:
            raise ValueError(f"row {i} has {length} tokens, more than cutoff_len={cutoff_len}; truncate before packing")
        if length == 0:
            continue
        k = bisect.bisect_left(free, (length, -1))
        if k < len(free):
            room, b = free.pop(k)
            bins[b].append(i)
            bisect.insort(free, (room - length, b))
        else:
            bins.append([i])
            bisect.insort(free, (cutoff_len - length, len(bins) - 1))
    packed = []
    for members in bins:
        input_ids, labels, position_ids = [], [], []
        for i in members:
            ids = list(rows[i]["input_ids"])
            input_ids += ids
            labels += [IGNORE_INDEX] + list(rows[i]["labels"])[1:]
            position_ids += list(range(len(ids)))
        packed.append({"input_ids": input_ids, "labels": labels, "position_ids": position_ids})
    return packed


def _pad_id(tokenizer_or_id) -> int:
    if isinstance(tokenizer_or_id, int):
        return tokenizer_or_id
    pad = tokenizer_or_id.pad_token_id
    if pad is None:
        pad = tokenizer_or_id.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad_token nor an eos_token to pad with")
    return pad


class PaddingCollator:
    """Right-pads a batch: input_ids with the pad id, labels with -100, attention_mask 0.
    Labels are padded with -100 (not derived from pad ids), so pad == eos never masks a real stop token."""

    def __init__(self, tokenizer_or_pad_id, pad_to_multiple_of: int | None = None):
        self.pad_id = _pad_id(tokenizer_or_pad_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict:
        import torch  # heavy: loaded on use, so importing this module stays light

        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            longest = (longest + m - 1) // m * m
        input_ids, labels, attention = [], [], []
        for f in features:
            ids = list(f["input_ids"])
            pad = longest - len(ids)
            input_ids.append(ids + [self.pad_id] * pad)
            labels.append(list(f.get("labels", ids)) + [IGNORE_INDEX] * pad)
            attention.append(list(f.get("attention_mask", [1] * len(ids))) + [0] * pad)
        return {"input_ids": torch.tensor(input_ids, dtype=torch.long),
                "labels": torch.tensor(labels, dtype=torch.long),
                "attention_mask": torch.tensor(attention, dtype=torch.long)}


class PackedCollator:
    """Padding-free batches: every row of the batch (packed rows from ``pack_rows``, or plain rows) is
    concatenated into ONE row of shape [1, total] with position_ids and no attention_mask.

    Not transformers' ``DataCollatorWithFlattening``: that one rebuilds position_ids as 0..len-1 per
    feature, which would glue together the rows already packed inside one feature; this one keeps each
    feature's own position_ids. It also sets the label at every row start to -100 (as the library does)
    and passes ``use_cache=False`` (see the module docstring: with a cache, transformers skips the
    packed-sequence mask). ``flash_attn_kwargs=True`` adds cu_seq_lens_q/k and max_length_q/k so
    flash-attention need not derive them from position_ids."""

    def __init__(self, flash_attn_kwargs: bool = False):
        self.flash_attn_kwargs = flash_attn_kwargs

    def __call__(self, features: list[dict]) -> dict:
        import torch  # heavy: loaded on use, so importing this module stays light

        input_ids, labels, position_ids = [], [], []
        for f in features:
            ids = list(f["input_ids"])
            pos = list(f["position_ids"]) if "position_ids" in f else list(range(len(ids)))
            lab = list(f.get("labels", ids))
            lab = [IGNORE_INDEX if p == 0 else label for p, label in zip(pos, lab)]
            input_ids += ids
            labels += lab
            position_ids += pos
        if not input_ids:
            raise ValueError("PackedCollator received a batch where every row is empty")
        batch = {"input_ids": torch.tensor([input_ids], dtype=torch.long),
                 "labels": torch.tensor([labels], dtype=torch.long),
                 "position_ids": torch.tensor([position_ids], dtype=torch.long),
                 "use_cache": False}
        if self.flash_attn_kwargs:
            starts = [i for i, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
            cu = torch.tensor(starts, dtype=torch.int32)
            longest = max(b - a for a, b in zip(starts, starts[1:]))
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return batch


class PaddingFreeCollator(PackedCollator):
    """Padding-free batches of plain rows: the rows the sampler put in one batch are concatenated into ONE
    row [1, sum of lengths] with position_ids restarting at 0 per row and no attention across rows (the
    block-diagonal mask of ``PackedCollator``), so no pad token is ever computed. Unlike packing, the same
    rows share a step as with ``PaddingCollator``, and loss, num_items_in_batch and gradients are those
    of the padded batch: the label at each row start is -100 and no label crosses a row boundary, which
    is exactly what the padded batch's shift leaves out. Only exact where the model's attention honours
    the packed position_ids (``backend.training.models.padding_free_problem`` checks it on the model itself)."""

