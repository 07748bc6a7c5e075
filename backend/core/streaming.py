"""The rules of `streaming: true` (and `buffer_size`), beside the spec as eval_rules are: light, so validate and
the web UI check them without the data stack. The stream itself is backend/dataprep/stream.py. Each rule returns
(field, message, the fields involved).

A stream has no length: the run needs max_steps, a share of its rows (val_size below 1) is unknown before it is
read whole, and the keys that work on the whole tokenized dataset (the tokenized cache, tokenizer processes) have
nothing to work on: each is one line saying so, never a key accepted and ignored."""
from __future__ import annotations

from backend.core.refusals import REFUSED

STREAMED_STAGES = ("sft", "pt")  # the stages that read a stream (backend/stages/sft.py, pt.py)
DEFAULT_BUFFER = 16384  # LLaMA-Factory's default shuffle buffer


def stream_errors(spec) -> list[tuple[str, str, frozenset]]:
    errors: list[tuple[str, str, frozenset]] = []

    def refuse(field: str, reason: str, *involved: str) -> None:
        errors.append((field, f"{REFUSED} with streaming: {reason}", frozenset((field, "streaming") + involved)))

    if not spec.streaming:
        if spec.buffer_size != DEFAULT_BUFFER:
            errors.append(("buffer_size", f"{REFUSED}: buffer_size is the shuffle buffer of streaming: true; without "
                           "streaming the whole dataset is shuffled (set streaming: true or drop buffer_size)",
                           frozenset(("buffer_size", "streaming"))))
        return errors
    if spec.stage not in STREAMED_STAGES:
        errors.append(("streaming", f"{REFUSED}: stage {spec.stage} reads its rows into memory (streaming is "
                       f"implemented for stages {', '.join(STREAMED_STAGES)}): drop streaming or use max_samples",
                       frozenset(("streaming", "stage"))))
        return errors
    if spec.max_steps is None or spec.max_steps <= 0:
        errors.append(("max_steps", "must be set (> 0) with streaming: true: a stream has no length to count "
                       "epochs by, so max_steps says how many optimizer steps to train",
                       frozenset(("max_steps", "streaming"))))
    if spec.val_size and spec.val_size < 1:
        refuse("val_size", f"a share ({spec.val_size:g}) of a stream's rows is unknown before it is read whole: give "
               "val_size as a row count (the first rows of the stream are held out) or an eval_dataset")
    if spec.overwrite_cache:  # (tokenized_path with streaming: backend/core/tokenized.py says it)
        refuse("overwrite_cache", "the tokenized cache saves a whole tokenized dataset, and a stream is tokenized as "
               "the trainer reads it: drop overwrite_cache")
    if spec.preprocessing_num_workers and spec.preprocessing_num_workers > 1:
        refuse("preprocessing_num_workers", "a stream is tokenized row by row as the trainer reads it, in the "
               "training process: drop preprocessing_num_workers")
    if spec.preprocessing_batch_size != 1000:  # the field's default
        refuse("preprocessing_batch_size", "a stream is tokenized row by row as the trainer reads it, never in "
               "batches of rows: drop preprocessing_batch_size")
    return errors
