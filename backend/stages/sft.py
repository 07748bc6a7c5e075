"""Supervised fine-tuning: conversations -> templated tokens with assistant-only labels -> Trainer.

Reads top to bottom: tokenizer/template -> dataset -> model (+adapter) -> trainer -> train -> save.
"""
from __future__ import annotations

from backend.dataprep.preprocess import build_sft_dataset
from backend.dataprep.token_cache import tokenized_rows
from backend.stages.base import (StageResult, batching, fit, predict_held_out, task_metric_callback,
                                 tokenizer_and_template, train_and_eval_rows, trainable_model)


def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer and template
    resolved, tokenizer, template = tokenizer_and_template(spec, run_dir)

    # 2. dataset: templated rows, labels on the assistant's tokens only (from the tokenized cache when it fits;
    # streaming: read lazily and tokenized as the trainer reads it)
    train_rows, eval_rows, val_examples = (streamed(spec, run_dir, "sft", tokenizer, template) if spec.streaming
                                           else tokenized(spec, run_dir, tokenizer, template))
    scorer = task_metric_callback(spec, run_dir, stop, tokenizer, template, val_examples)  # eval_metric, else None

    # 3. model and adapters; then the batches (padding-free where that is exact for this model)
    model = trainable_model(spec, run_dir, resolved, chunked_loss=True)
    train_rows, collator = batching(spec, run_dir, train_rows, tokenizer, model)

    # 4. train (eval_metric scored at each save), save, plot
    result = fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=train_rows,
                 collator=collator, eval_dataset=eval_rows, task_metric=scorer)

    # 5. predictions on the held-out rows (do_predict), streamed to generated_predictions.jsonl
    return predict_held_out(spec, run_dir, result, model, tokenizer, template, val_examples)


def tokenized(spec, run_dir, tokenizer, template) -> tuple[list[dict], list[dict] | None, list[dict]]:
    """(train rows, eval rows or None, held-out examples): the tokenized cache's rows when its key matches, else
    the examples tokenized now (and cached: backend/dataprep/token_cache.py)."""
    encode = dict(
        template=template, tokenizer=tokenizer, cutoff_len=spec.cutoff_len,
        train_on_prompt=spec.train_on_prompt, mask_history=spec.mask_history,
        num_workers=spec.preprocessing_num_workers,
    )

    def tokenize(train_examples, val_examples, warn):
        train_rows, stats = build_sft_dataset(train_examples, log=warn, **encode)
        eval_rows = build_sft_dataset(val_examples, log=warn, **encode)[0] if val_examples else None
        return train_rows, eval_rows, f"train rows: {stats}"

    return tokenized_rows(spec, run_dir, "sft", tokenizer, template,
                          lambda log_to: train_and_eval_rows(spec, log_to, "sft"), tokenize,
                          need_examples=bool(spec.eval_metric or spec.do_predict))


def streamed(*args):
    """The stream of a `streaming: true` run (backend/dataprep/stream.py): (train stream, eval rows, held-out examples)."""
    from backend.dataprep.stream import streamed_rows  # heavy (datasets): a stage module's top stays light

    return streamed_rows(*args)
