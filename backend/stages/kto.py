"""KTO: single answers tagged desirable / undesirable (kto_tag) -> TRL's KTOTrainer.

Reads top to bottom: tokenizer/template -> rows -> model (+adapter) -> reference model -> trainer -> train
-> save -> predictions on the held-out rows (do_predict).

Settings: pref_beta -> beta, kto_chosen_weight / kto_rejected_weight -> desirable_weight / undesirable_weight,
cutoff_len -> max_length. TRL's KTO has no SFT term, so pref_ftx > 0 is refused at validate (backend/stages/rules.py),
as is per_device_train_batch_size 1 (TRL's trainer refuses it: its KL estimate wants several rows a batch).

The KL rows are LLaMA-Factory's: each prompt paired with the previous row's answer in the dataset's order, in
chunks of preprocessing_batch_size rows (its preprocessing batches), fixed before training; so the rows are then
sampled as every stage samples them (shuffled by seed, or train_sampling_strategy), and a recipe trains on the same
batches with the same KL terms as in LLaMA-Factory. (TRL pairs neighbours within each batch and so reads the rows in
order, unshuffled.)

Reference model: one rule with DPO's, `stages.base.reference_model` (ref_model; for LoRA the policy training
starts from on the shared base weights, no second copy; for full / freeze a frozen copy of the base).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from accelerate.utils import is_peft_model
from datasets import Dataset
from transformers import Trainer
from trl import KTOConfig, KTOTrainer

from backend.training.adapters import _upcast_trainable
from backend.training.logprobs import install_on_trainer
from backend.dataprep.preference import build_kto_dataset
from backend.stages.base import (StageResult, adapter_is_identity, fit, predict_held_out, reference_model,
                                 tokenizer_and_template, train_and_eval_rows, trainable_model)


def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer and template
    resolved, tokenizer, template = tokenizer_and_template(spec, run_dir)

    # 2. dataset: prompt and answer tokens with the desirable / undesirable label
    train_examples, val_examples = train_and_eval_rows(spec, run_dir, spec.stage)
    encode = dict(template=template, tokenizer=tokenizer, cutoff_len=spec.cutoff_len, log=run_dir.warn,
                  num_workers=spec.preprocessing_num_workers)
    train_rows, stats = build_kto_dataset(train_examples, **encode)
    desirable = sum(r["label"] for r in train_rows)
    run_dir.log(f"train rows: {stats}; {desirable} desirable, {len(train_rows) - desirable} undesirable")
    if not desirable or desirable == len(train_rows):
        run_dir.warn("the training rows are all " + ("desirable" if desirable else "undesirable")
                     + ": KTO learns from both kinds (kto_tag true and false)")
    eval_rows = build_kto_dataset(val_examples, **encode)[0] if val_examples else None

    # 3. model and adapters, and the reference model
    model = trainable_model(spec, run_dir, resolved)
    ref_model = reference_model(spec, run_dir, resolved, model)

    # 4. train, save, plot
    result = fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=Dataset.from_list(train_rows),
                 eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
                 trainer_class=_kto_trainer_class(spec), args_class=KTOConfig,
                 config={"beta": spec.pref_beta, "desirable_weight": spec.kto_chosen_weight,
                         "undesirable_weight": spec.kto_rejected_weight, "max_length": spec.cutoff_len,
                         # what TRL's check wants; the sampler the spec asks for is _KTOTrainer._get_train_sampler's
                         "train_sampling_strategy": "sequential"},
                 ref_model=ref_model)

    # 5. predictions on the held-out rows (do_predict), streamed to generated_predictions.jsonl
    return predict_held_out(spec, run_dir, result, model, tokenizer, template, val_examples)


def _kto_trainer_class(spec):
    class _KTOTrainer(KTOTrainer):
        """TRL's KTOTrainer on our pre-tokenized rows, and with no copy of an adapter that is still the identity."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # TRL casts a quantized model's trainable weights to bf16 (the QLoRA paper's choice); we keep them
            # in fp32 as every stage does (backend.training.models: trained weights not in bf16 unless pure_bf16).
            _upcast_trainable(self.model, spec)
            # TRL's fused LM head -> ours (backend.training.logprobs): same numbers, answer tokens only, small tiles,
            # each batch's rows in one row without their padding (backend.training.shared_prompt.find_rows)
            self.run_log_lines = [install_on_trainer(self, ("log_probs", "entropy", "mean_logits"), rows=True)]
            # TRL copies a PeftModel's adapter as the reference ("ref"). A fresh LoRA adapter (B = 0) changes
            # nothing yet, so disabling it gives the same reference without the copy.
            model = self.accelerator.unwrap_model(self.model)
            if self.ref_model is None and is_peft_model(model) and "ref" in model.peft_config \
                    and adapter_is_identity(model):
                model.delete_adapter("ref")
                model.set_adapter("default")

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            # Our rows are already tokenized by our templates (backend.dataprep.preference): TRL's own preparation would
            # look for text prompt / completion columns and tokenize them with the tokenizer's chat template.
            # Keep the one step it adds to tokenized rows: the KL completions, each prompt paired with the
            # previous row's answer, as LLaMA-Factory pairs them (per preprocessing batch, not per training batch).
            if not self.calculate_KL:
                return dataset
            return dataset.map(kl_completions, batched=True, batch_size=spec.preprocessing_batch_size)

        def _get_train_sampler(self, train_dataset=None):
            # The KL pairs are fixed above, so the rows can be shuffled like any stage's (TRL reads them in order)
            asked, self.args.train_sampling_strategy = self.args.train_sampling_strategy, sampling(spec)
            try:
                return Trainer._get_train_sampler(self, train_dataset)
            finally:
                self.args.train_sampling_strategy = asked

        def _save(self, output_dir=None, state_dict=None):
            super()._save(output_dir, state_dict)
            # peft saves every adapter; the "ref" copy is training state only (the run folder and each
            # checkpoint hold one adapter: the trained one)
            ref = Path(output_dir or self.args.output_dir) / "ref"
            if (ref / "adapter_config.json").is_file():
                shutil.rmtree(ref)

    return _KTOTrainer


def kl_completions(batch: dict) -> dict:
    """A chunk of rows -> each row's KL completion: the previous row's answer (the first row takes the last's)."""
    batch["KL_completion_ids"] = [batch["completion_ids"][-1]] + batch["completion_ids"][:-1]
    return batch


def sampling(spec) -> str:
    """The order the training rows are read in: the spec's train_sampling_strategy, else shuffled ("random")."""
    return spec.passthrough.get("train_sampling_strategy", "random")
