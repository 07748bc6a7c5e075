"""Pre-training (continued causal-LM training on raw text): every token is trained.

Reads top to bottom: tokenizer -> text rows -> blocks of cutoff_len (packed unless packing: false)
-> model (+adapter) -> trainer -> train -> save.
"""
from __future__ import annotations

from backend.training.models import load_tokenizer, resolve_model
from backend.dataprep.preprocess import build_pt_dataset
from backend.dataprep.token_cache import tokenized_rows
from backend.stages.base import StageResult, batching, fit, train_and_eval_rows, trainable_model


def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer (no chat template: raw text, each document ends with the eos token)
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)

    # 2. dataset: documents split into blocks of cutoff_len, never mixed within a block (from the tokenized cache
    # when it fits; streaming: read lazily and tokenized as the trainer reads it)
    train_rows, eval_rows, _ = (streamed(spec, run_dir, "pt", tokenizer) if spec.streaming
                                else tokenized(spec, run_dir, tokenizer))

    # 3. model and adapters; then the batches (padding-free where that is exact for this model)
    model = trainable_model(spec, run_dir, resolved, chunked_loss=True)
    train_rows, collator = batching(spec, run_dir, train_rows, tokenizer, model)

    # 4. train, save, plot
    return fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=train_rows,
               collator=collator, eval_dataset=eval_rows)


def tokenized(spec, run_dir, tokenizer) -> tuple[list[dict], list[dict] | None, list[dict]]:
    """(train blocks, eval blocks or None, []): the tokenized cache's blocks when its key matches, else the texts
    tokenized now (and cached: backend/dataprep/token_cache.py). Each document ends with the eos token."""
    add_bos = tokenizer.bos_token_id is not None and tokenizer.bos_token_id != tokenizer.eos_token_id
    encode = dict(tokenizer=tokenizer, cutoff_len=spec.cutoff_len, add_bos=add_bos, add_eos=True,
                  num_workers=spec.preprocessing_num_workers)

    def tokenize(train_examples, val_examples, warn):
        train_rows, stats = build_pt_dataset(train_examples, log=warn, **encode)
        eval_rows = build_pt_dataset(val_examples, log=warn, **encode)[0] if val_examples else None
        return train_rows, eval_rows, f"train blocks: {stats}"

    return tokenized_rows(spec, run_dir, "pt", tokenizer, None,
                          lambda log_to: train_and_eval_rows(spec, log_to, "pt"), tokenize)


def streamed(*args):
    """The stream of a `streaming: true` run (backend/dataprep/stream.py): (train stream, eval rows, held-out examples)."""
    from backend.dataprep.stream import streamed_rows  # heavy (datasets): a stage module's top stays light

    return streamed_rows(*args)
