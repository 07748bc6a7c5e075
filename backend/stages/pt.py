"""Pre-training (continued causal-LM training on raw text): every token is trained.

Reads top to bottom: tokenizer -> text rows -> blocks of cutoff_len (packed unless packing: false)
-> model (+adapter) -> trainer -> train -> save.
"""
from __future__ import annotations

from backend.data import load_examples, split_train_val
from backend.models import apply_finetuning, count_parameters, describe_model, load_model, load_tokenizer, resolve_model
from backend.preprocess import PackedCollator, PaddingCollator, build_pt_dataset, pack_rows
from backend.train import RunError, StageResult, fit


def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer (no chat template: raw text, one document ends with the eos token)
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)

    # 2. dataset
    examples, report = load_examples(
        spec.dataset, spec.resolved_dataset_dir(), stage="pt", max_samples=spec.max_samples,
        identity_name=spec.identity_name, identity_author=spec.identity_author, seed=spec.seed,
    )
    for line in report.summary_lines():
        run_dir.log(line)
    train_examples, val_examples = split_train_val(examples, spec.val_size, spec.seed)
    add_bos = tokenizer.bos_token_id is not None and tokenizer.bos_token_id != tokenizer.eos_token_id
    encode = dict(tokenizer=tokenizer, cutoff_len=spec.cutoff_len, add_bos=add_bos, add_eos=True, log=run_dir.warn)
    train_rows, stats = build_pt_dataset(train_examples, **encode)
    run_dir.log(f"train blocks: {stats}")
    if not train_rows:
        raise RunError("no training text left after preprocessing (see the warnings above)")
    eval_rows = build_pt_dataset(val_examples, **encode)[0] if val_examples else None
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
    return fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=train_rows,
               collator=collator, eval_dataset=eval_rows)
