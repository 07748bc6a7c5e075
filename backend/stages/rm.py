"""Reward model: ranking pairs -> a one-output score head on the base model -> TRL's RewardTrainer
(pairwise loss -log sigmoid(score(prompt + chosen) - score(prompt + rejected))).

Reads top to bottom: tokenizer/template -> pairs -> model with a score head (+adapter) -> trainer -> train
-> save -> scores of the held-out pairs (do_predict).

What a run saves and how it reloads (backend.evaluation.reward_score.load_reward_model; `tuneboard eval` with stage rm, and PPO's
`reward_model`, go through it):
- lora: the adapter (task_type SEQ_CLS) with the trained score head inside it (peft modules_to_save), on the
  run's base model (run_spec.yaml's model_name_or_path);
- full / freeze: a sequence-classification model folder (config.json: ...ForSequenceClassification,
  num_labels 1, pad_token_id).
The score of a sequence is the head's output at its last token that is not the pad token (transformers'
rule), so the model config carries the tokenizer's pad token, here and when reloaded.
"""
from __future__ import annotations

import torch
from datasets import Dataset
from transformers import set_seed
from trl import RewardConfig, RewardTrainer

from backend.training.adapters import _upcast_trainable
from backend.training.models import load_tokenizer, resolve_model
from backend.dataprep.preference import build_preference_dataset
from backend.dataprep.resolve import pick_template
from backend.evaluation.reward_score import encode_pairs, pair_metrics, score_pairs, sequences, set_pad_token, write_scores
from backend.core.rundir import PREDICTIONS_FILE
from backend.stages.base import StageResult, fit, train_and_eval_rows, trainable_model



def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer and template
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer, warn=run_dir.warn)
    run_dir.log(f"template: {template.name}")

    # 2. dataset: prompt + chosen and prompt + rejected, each one sequence to score
    train_examples, val_examples = train_and_eval_rows(spec, run_dir, spec.stage)
    encode = dict(template=template, tokenizer=tokenizer, cutoff_len=spec.cutoff_len, log=run_dir.warn)
    train_rows, stats = build_preference_dataset(train_examples, **encode)
    run_dir.log(f"train pairs: {stats}")
    held_out = encode_pairs(val_examples, **encode)  # (example, row): do_predict names each pair's source row
    eval_rows = [row for _, row in held_out] or None

    # 3. model: the base with a new one-output score head (seeded: its initial weights are random)
    set_seed(spec.seed)
    model = trainable_model(spec, run_dir, resolved, reward_head=True)
    set_pad_token(model, tokenizer)

    # 4. train, save, plot
    result = fit(spec, run_dir, stop, model=model, tokenizer=tokenizer,
                 train_dataset=Dataset.from_list([sequences(r) for r in train_rows]),
                 eval_dataset=Dataset.from_list([sequences(r) for r in eval_rows]) if eval_rows else None,
                 trainer_class=_reward_trainer_class(spec), args_class=RewardConfig,
                 config={"max_length": spec.cutoff_len})

    # 5. scores of the held-out pairs (do_predict), one line per pair, and their accuracy / margin
    if spec.do_predict and eval_rows and not result.stopped:
        run_dir.log(f"scoring {len(eval_rows)} held-out pairs -> {PREDICTIONS_FILE}")
        model.eval()
        scores = score_pairs(model, tokenizer, eval_rows, spec.per_device_eval_batch_size)
        write_scores(run_dir.path / PREDICTIONS_FILE, [example for example, _ in held_out], scores)
        result.metrics.update({f"predict_{k}": v for k, v in pair_metrics(scores).items()})
    return result


def _reward_trainer_class(spec):
    class _RewardTrainer(RewardTrainer):
        """TRL's RewardTrainer (it logs accuracy, margin, min/mean/max_reward), plus the mean score of the
        chosen and of the rejected answers (rewards/chosen, rewards/rejected), as the DPO stages name them."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # TRL casts a quantized model's trainable weights to bf16 (the QLoRA paper's choice); we keep them
            # in fp32 as every stage does (backend.training.models), and the score head must match the fp32 hidden
            # states it reads (a bf16 head fails on them where no autocast runs, e.g. on CPU).
            _upcast_trainable(self.model, spec)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
            chosen, rejected = torch.chunk(outputs.logits.detach().squeeze(-1), chunks=2)
            mode = "train" if self.model.training else "eval"
            for key, scores in (("rewards/chosen", chosen), ("rewards/rejected", rejected)):
                self._metrics[mode][key].append(self.accelerator.gather_for_metrics(scores.mean()).mean().item())
            return (loss, outputs) if return_outputs else loss

    return _RewardTrainer
