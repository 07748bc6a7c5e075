"""Supervised fine-tuning: conversations -> templated tokens with assistant-only labels -> Trainer.

Reads top to bottom: tokenizer/template -> dataset -> model (+adapter) -> trainer -> train -> save.
"""
from __future__ import annotations

from backend.data import load_examples, split_train_val
from backend.models import apply_finetuning, count_parameters, describe_model, load_model, load_tokenizer, resolve_model
from backend.preprocess import PackedCollator, PaddingCollator, build_sft_dataset, pack_rows
from backend.resolve import pick_template
from backend.train import RunError, StageResult, fit


def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer and template
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer, warn=run_dir.warn)
    run_dir.log(f"template: {template.name}")

    # 2. dataset
    examples, report = load_examples(
        spec.dataset, spec.resolved_dataset_dir(), stage="sft", max_samples=spec.max_samples,
        identity_name=spec.identity_name, identity_author=spec.identity_author, seed=spec.seed,
    )
    for line in report.summary_lines():
        run_dir.log(line)
    train_examples, val_examples = split_train_val(examples, spec.val_size, spec.seed)
    if spec.eval_dataset:
        val_examples, eval_report = load_examples(
            spec.eval_dataset, spec.resolved_dataset_dir(), stage="sft", max_samples=spec.max_samples,
            identity_name=spec.identity_name, identity_author=spec.identity_author, seed=spec.seed,
        )
        for line in eval_report.summary_lines():
            run_dir.log(line)
    encode = dict(
        template=template, tokenizer=tokenizer, cutoff_len=spec.cutoff_len,
        train_on_prompt=spec.train_on_prompt, mask_history=spec.mask_history, log=run_dir.warn,
    )
    train_rows, stats = build_sft_dataset(train_examples, **encode)
    run_dir.log(f"train rows: {stats}")
    if len(train_rows) == 0:
        raise RunError("no training rows left after preprocessing (see the warnings above)")
    eval_rows = build_sft_dataset(val_examples, **encode)[0] if val_examples else None
    if spec.resolved_packing:
        train_rows = pack_rows(train_rows, spec.cutoff_len)
        run_dir.log(f"packed into {len(train_rows)} sequences of <= {spec.cutoff_len} tokens")
        collator = PackedCollator()
    else:
        collator = PaddingCollator(tokenizer)

    # 3. model and adapters
    model = load_model(spec, resolved, for_training=True, warn=run_dir.warn)
    run_dir.log(f"model: {describe_model(model)}")
    model = apply_finetuning(model, spec, warn=run_dir.warn)
    trainable, total = count_parameters(model)
    run_dir.log(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)")

    # 4. train, save, plot
    result = fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=train_rows,
                 collator=collator, eval_dataset=eval_rows)

    # 5. predictions on the held-out rows (do_predict), streamed to generated_predictions.jsonl
    if spec.do_predict and val_examples and not result.stopped:
        from backend.evaluate import predict

        run_dir.log(f"predicting {len(val_examples)} held-out rows -> generated_predictions.jsonl")
        model.eval()
        result.metrics.update(predict(model, tokenizer, template, val_examples,
                                      run_dir.path / "generated_predictions.jsonl", spec))
    return result
