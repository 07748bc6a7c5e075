"""Pre-training (continued causal-LM training on raw text): every token is trained.

Reads top to bottom: tokenizer -> text rows -> blocks of cutoff_len (packed unless packing: false)
-> model (+adapter) -> trainer -> train -> save.
"""
from __future__ import annotations

from backend.training.models import load_tokenizer, resolve_model
from backend.dataprep.preprocess import build_pt_dataset
from backend.stages.base import StageResult, batching, fit, train_and_eval_rows, trainable_model


def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer (no chat template: raw text, each document ends with the eos token)
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)

    # 2. dataset: documents split into blocks of cutoff_len, never mixed within a block
    train_examples, val_examples = train_and_eval_rows(spec, run_dir, "pt")
    add_bos = tokenizer.bos_token_id is not None and tokenizer.bos_token_id != tokenizer.eos_token_id
    encode = dict(tokenizer=tokenizer, cutoff_len=spec.cutoff_len, add_bos=add_bos, add_eos=True, log=run_dir.warn,
                  num_workers=spec.preprocessing_num_workers)
    train_rows, stats = build_pt_dataset(train_examples, **encode)
    run_dir.log(f"train blocks: {stats}")
    eval_rows = build_pt_dataset(val_examples, **encode)[0] if val_examples else None

    # 3. model and adapters; then the batches (padding-free where that is exact for this model)
    model = trainable_model(spec, run_dir, resolved, chunked_loss=True)
    train_rows, collator = batching(spec, run_dir, train_rows, tokenizer, model)

    # 4. train, save, plot
    return fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=train_rows,
               collator=collator, eval_dataset=eval_rows)
