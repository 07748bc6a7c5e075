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

import contextlib
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from datasets import Dataset
from transformers import Trainer
from trl import KTOConfig, KTOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from backend.training.adapters import _upcast_trainable
from backend.training.logprobs import install_on_trainer, kl_after_rows, kl_left_pending
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


# what TRL's KTO collator gives for text rows (anything more, e.g. images, takes TRL's two reference forwards)
KTO_BATCH_KEYS = {"input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask",
                  "KL_completion_mask", "label"}
REFERENCE_KEYS = {"ref_logps", "ref_KL_logps"}  # what _compute_loss adds from reference_log_probs


def _kto_trainer_class(spec):
    class _KTOTrainer(KTOTrainer):
        """TRL's KTOTrainer on our pre-tokenized rows, and with no copy of an adapter that is still the identity."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # TRL casts a quantized model's trainable weights to bf16 (the QLoRA paper's choice); we keep them
            # in fp32 as every stage does (backend.training.models: trained weights not in bf16 unless pure_bf16).
            _upcast_trainable(self.model, spec)
            # TRL's fused LM head -> ours (backend.training.logprobs): same numbers, answer tokens only, small tiles,
            # each batch's rows in one row without their padding (backend.training.shared_prompt.find_rows), and
            # the reference's rows and KL rows as pairs sharing their prompts (reference_log_probs)
            self.run_log_lines = [install_on_trainer(self, ("log_probs", "entropy", "mean_logits"), pairs=True,
                                                     rows=True)]
            # TRL copies a PeftModel's adapter as the reference ("ref"). A fresh LoRA adapter (B = 0) changes
            # nothing yet, so disabling it gives the same reference without the copy.
            model = self.accelerator.unwrap_model(self.model)
            if self.ref_model is None and is_peft_model(model) and "ref" in model.peft_config \
                    and adapter_is_identity(model):
                model.delete_adapter("ref")
                model.set_adapter("default")

        def _compute_loss(self, model, inputs, return_outputs):
            # TRL runs the reference twice a batch, on the rows and on their KL rows; each KL row is its row's prompt
            # with another row's answer, so one forward of the pairs computes each prompt once for both, and TRL's
            # own path for reference log-probabilities a batch carries (precompute_ref_log_probs) takes the sums.
            reference = None if self.precompute_ref_logps else reference_log_probs(self, inputs)
            policy = self.accelerator.unwrap_model(self.model)
            try:
                if reference is None:
                    result = super()._compute_loss(model, inputs, return_outputs)
                else:
                    self.precompute_ref_logps = True
                    result = super()._compute_loss(model, {**inputs, "ref_logps": reference[0],
                                                           "ref_KL_logps": reference[1]}, return_outputs)
            except BaseException:
                kl_left_pending(policy)  # the error that stopped the batch is the one to see
                raise
            finally:
                self.precompute_ref_logps = False
            if kl_left_pending(policy):
                raise RuntimeError("KTO: the batch's KL rows were asked for but its forward did not compute them")
            return result

        def _compute_kl_logps(self, model, batch):
            # The policy's KL rows (no gradient) are computed right after the batch's own forward, which keeps its
            # rows' prompt keys and values: each KL row then runs from its prompt's end (logprobs.PendingKL). The
            # reference's (asked inside no_grad) and anything but KTO's text rows take TRL's forward.
            if self.calculate_KL and torch.is_grad_enabled() and not set(batch) - KTO_BATCH_KEYS - REFERENCE_KEYS:
                out = kl_after_rows(self.accelerator.unwrap_model(self.model), batch)
                if out is not None:
                    return out
            return super()._compute_kl_logps(model, batch)

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


def reference_log_probs(trainer, inputs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference's summed answer log-probabilities of a KTO batch's rows and of their KL rows, from ONE forward of
    [rows; KL rows] that the lean head packs as pairs sharing each prompt (backend/training/shared_prompt.py
    find_pairs: the same numbers as two forwards); None where that does not apply: no KL rows, a batch with more
    than text rows (images), or a reference whose head does not pack pairs (logprobs.share_prompts did not switch
    it on: TUNEBOARD_SHARED_PROMPT=0, or its probe failed)."""
    if not trainer.calculate_KL or set(inputs) - KTO_BATCH_KEYS:
        return None
    reference = trainer.ref_model if trainer.ref_model is not None else trainer.model
    unwrapped = trainer.accelerator.unwrap_model(reference)
    lm = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    if not getattr(lm, "_shared_prompt", None):
        return None
    device = trainer.accelerator.device
    width = max(inputs["input_ids"].shape[1], inputs["KL_input_ids"].shape[1])
    ids, mask, answer = (
        torch.cat([F.pad(inputs[prefix + key].to(device), (0, width - inputs[prefix + key].shape[1]))
                   for prefix in ("", "KL_")])
        for key in ("input_ids", "attention_mask", "completion_mask"))
    adapter = contextlib.nullcontext()
    if trainer.ref_model is None and is_peft_model(unwrapped):
        adapter = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs), \
            adapter:
        sums = reference(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(answer == 0, -100),
                         fused_lm_head=True, use_cache=False).log_probs.sum(-1)
    rows = inputs["input_ids"].shape[0]
    return sums[:rows], sums[rows:]


def kl_completions(batch: dict) -> dict:
    """A chunk of rows -> each row's KL completion: the previous row's answer (the first row takes the last's)."""
    batch["KL_completion_ids"] = [batch["completion_ids"][-1]] + batch["completion_ids"][:-1]
    return batch


def sampling(spec) -> str:
    """The order the training rows are read in: the spec's train_sampling_strategy, else shuffled ("random")."""
    return spec.passthrough.get("train_sampling_strategy", "random")
