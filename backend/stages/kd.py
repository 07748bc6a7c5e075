"""Logit distillation: conversations -> our templated tokens -> the student learns the teacher's next-token
distributions (TRL's GKDTrainer, generalized knowledge distillation).

Reads top to bottom: tokenizer/template -> rows -> student (+adapter) -> teacher -> trainer -> train -> save
-> predictions on the held-out rows (do_predict).

Why GKDTrainer and not TRL's DistillationTrainer: DistillationTrainer trains on-policy only (the student
generates every completion from a prompt column); GKDTrainer (trl.experimental.gkd) trains on the dataset's own
answers (off-policy, the classic logit KD of the SFT data) or, a `lmbda` share of the steps, on the student's own
completions, with the same generalized JSD (`beta`). Settings: kd_beta -> beta (0 forward KL(teacher||student),
1 reverse KL, between: the generalized JSD), kd_lmbda -> lmbda, kd_temperature -> temperature,
max_completion_length -> max_new_tokens (on-policy sampling).

Ours, in the loss below: TRL 1.16's GKD loss leaves its temperature at 1 (only the sampling reads it); here both
distributions are divided by kd_temperature. kd_alpha mixes in the cross-entropy on the dataset's answers:
loss = (1 - kd_alpha) x divergence + kd_alpha x CE. Logged: kd_loss (the divergence), ce_loss (at any kd_alpha)
and on_policy (the share of steps on the student's own completions).

The teacher: teacher_model_name_or_path loaded by our loader (dtype as the student; teacher_quantization_bit:
bitsandbytes 4/8 bit), teacher_adapter on it, frozen. Its tokenizer must be the student's (validate compares
tokenizer.json files; here the loaded tokenizers, for a .gguf file or hub id).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from trl.experimental.gkd import GKDConfig, GKDTrainer

from backend.dataprep.preprocess import IGNORE_INDEX, PaddingCollator, build_sft_dataset
from backend.training import probe
from backend.stages.base import (RunError, StageResult, fit, predict_held_out, tokenizer_and_template,
                                 train_and_eval_rows, trainable_model)


def run(spec, run_dir, stop) -> StageResult:
    # 1. tokenizer and template
    resolved, tokenizer, template = tokenizer_and_template(spec, run_dir)

    # 2. dataset: templated rows, labels on the assistant's tokens only (the positions the divergence covers)
    train_examples, val_examples = train_and_eval_rows(spec, run_dir, "sft")
    encode = dict(template=template, tokenizer=tokenizer, cutoff_len=spec.cutoff_len,
                  train_on_prompt=spec.train_on_prompt, mask_history=spec.mask_history, log=run_dir.warn,
                  num_workers=spec.preprocessing_num_workers)
    train_rows, stats = build_sft_dataset(train_examples, **encode)
    run_dir.log(f"train rows: {stats}")
    if not train_rows:
        raise RunError("no training rows left after preprocessing (see the warnings above)")
    eval_rows = build_sft_dataset(val_examples, **encode)[0] if val_examples else None

    # 3. the student (+adapter) and the frozen teacher
    model = trainable_model(spec, run_dir, resolved)
    teacher = load_teacher(spec, run_dir, tokenizer)
    probe.record_teacher(teacher)  # a `tuneboard probe` child: the teacher's bytes, for its suggestions
    run_dir.log(f"distillation: kd_beta {spec.kd_beta:g} ({_divergence(spec.kd_beta)}), kd_lmbda {spec.kd_lmbda:g} "
                f"(on-policy share), kd_temperature {spec.kd_temperature:g}, kd_alpha {spec.kd_alpha:g} (cross-entropy)")

    # 4. train, save, plot
    result = fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=_dataset(train_rows),
                 collator=PromptCollator(tokenizer), eval_dataset=_dataset(eval_rows) if eval_rows else None,
                 trainer_class=_trainer_class(spec, len(tokenizer)), args_class=GKDConfig,
                 config={"beta": spec.kd_beta, "lmbda": spec.kd_lmbda, "temperature": spec.kd_temperature,
                         "max_new_tokens": spec.max_completion_length, "seq_kd": False,
                         "disable_dropout": False, "max_length": spec.cutoff_len},
                 teacher_model=teacher)

    # 5. predictions on the held-out rows (do_predict), streamed to generated_predictions.jsonl
    return predict_held_out(spec, run_dir, result, model, tokenizer, template, val_examples)


def _divergence(beta: float) -> str:
    return {0.0: "forward KL(teacher||student)", 1.0: "reverse KL(student||teacher)"}.get(
        beta, "generalized JSD" if beta != 0.5 else "JSD")


def _dataset(rows: list[dict]):
    from datasets import Dataset  # the Trainer's sampler and TRL's SFT parent take a datasets.Dataset

    return Dataset.from_list(rows)


def load_teacher(spec, run_dir, student_tokenizer):
    """The frozen teacher: teacher_model_name_or_path by our loader (the student's dtype, teacher_quantization_bit),
    teacher_adapter on it. RunError when its tokenizer is not the student's."""
    from backend.training.models import load_model, load_tokenizer, resolve_model  # heavy (torch, transformers)

    name = spec.teacher_model_name_or_path
    try:
        resolved = resolve_model(name)
    except (ValueError, FileNotFoundError) as exc:
        raise RunError(f"teacher_model_name_or_path: {exc}") from None
    if load_tokenizer(resolved).get_vocab() != student_tokenizer.get_vocab():
        raise RunError(f"teacher_model_name_or_path: the teacher {name} has another tokenizer than the student "
                       f"{spec.model_name_or_path}: logit distillation compares their next-token distributions token "
                       "by token, so both need the same vocabulary")
    settings = spec.model_copy(update={"model_name_or_path": name, "quantization_bit": spec.teacher_quantization_bit,
                                       "adapter_name_or_path": None, "new_special_tokens": None, "resize_vocab": False})
    teacher = load_model(settings, resolved, for_training=False, warn=run_dir.warn)
    if spec.teacher_adapter:
        from peft import PeftModel  # heavy: only a teacher with an adapter needs peft here

        teacher = PeftModel.from_pretrained(teacher, spec.teacher_adapter)
        if not spec.teacher_quantization_bit:
            teacher = teacher.merge_and_unload()  # one plain model: each forward skips the adapter's extra matmuls
    bits = f", {spec.teacher_quantization_bit}-bit" if spec.teacher_quantization_bit else ""
    run_dir.log(f"teacher: {name}" + (f" + adapter {spec.teacher_adapter}" if spec.teacher_adapter else "")
                + f" (a second model in memory{bits}, frozen)")
    return teacher.eval().requires_grad_(False)


class PromptCollator(PaddingCollator):
    """Our padded rows, plus each row's prompt (the tokens before its last trained answer) left-padded as TRL's
    GKD on-policy step wants them (`prompts`, `prompt_attention_mask`): the student completes those."""

    def __call__(self, features: list[dict]) -> dict:
        batch = super().__call__(features)
        prompts = [list(f["input_ids"])[:_last_answer_start(list(f.get("labels", f["input_ids"])))] for f in features]
        longest = max(len(p) for p in prompts)
        batch["prompts"] = torch.tensor([[self.pad_id] * (longest - len(p)) + p for p in prompts], dtype=torch.long)
        batch["prompt_attention_mask"] = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts],
                                                      dtype=torch.long)
        return batch


def _last_answer_start(labels: list[int]) -> int:
    """Index of the first token of the last trained span (the whole row when nothing is trained)."""
    start = len(labels)
    for i in range(len(labels) - 1, -1, -1):
        if labels[i] != IGNORE_INDEX:
            start = i
        elif start != len(labels):
            break
    return max(start, 1)


def kd_terms(student_logits, teacher_logits, labels, *, beta: float, temperature: float):
    """(divergence, cross-entropy): the generalized JSD between the two next-token distributions (TRL's GKD
    formula, both divided by the temperature) and the student's cross-entropy on the labels, each a mean over
    the trained positions. Logits are [batch, seq, vocab] aligned with labels (shifted here)."""
    student, teacher, targets = student_logits[:, :-1], teacher_logits[:, :-1], labels[:, 1:]
    mask = targets != IGNORE_INDEX
    student, teacher = student[mask].float(), teacher[mask].float()  # the trained positions, in fp32 (bf16 runs)
    divergence = GKDTrainer.generalized_jsd_loss(student.unsqueeze(0), teacher.unsqueeze(0), beta=beta,
                                                 temperature=temperature, reduction="sum")
    count = mask.sum().clamp_min(1)
    ce = F.cross_entropy(student, targets[mask], reduction="sum")
    return divergence / count, ce / count


def _trainer_class(spec, vocab: int):
    class _KDTrainer(GKDTrainer):
        """TRL's GKDTrainer on our tokenized rows, with the temperature in the loss, kd_alpha's cross-entropy and
        the distillation metrics logged."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            student = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            with torch.no_grad():
                teacher = self.teacher_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            # tokens past the tokenizer's (padded embedding rows) are never targets: compare the real vocabulary
            divergence, ce = kd_terms(student.logits[..., :vocab], teacher.logits[..., :vocab], inputs["labels"],
                                      beta=spec.kd_beta, temperature=spec.kd_temperature)
            loss = (1 - spec.kd_alpha) * divergence + spec.kd_alpha * ce
            mode = "train" if model.training else "eval"
            self._metrics[mode]["kd_loss"].append(self.accelerator.gather(divergence.detach()).mean().item())
            self._metrics[mode]["ce_loss"].append(self.accelerator.gather(ce.detach()).mean().item())
            if mode == "train":
                self._metrics[mode]["on_policy"].append(float(self._on_policy))
            return (loss, student) if return_outputs else loss

        def training_step(self, model, inputs, num_items_in_batch=None):
            # GKD's own step, but on-policy only when a draw falls below lmbda (kd_lmbda 0: never generates), and
            # the loss a mean over this batch's trained tokens (an on-policy batch has other tokens than the
            # Trainer counted): the Trainer divides it by the accumulation steps when num_items_in_batch is None
            self._on_policy = random.random() < self.lmbda
            if self._on_policy:
                from trl.models.utils import unwrap_model_for_generation  # heavy: only on-policy steps generate

                with unwrap_model_for_generation(model, self.accelerator, generation_kwargs=self.generation_kwargs,
                                                 gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
                                                 ) as unwrapped:
                    ids, mask, labels = self.generate_on_policy_outputs(unwrapped, inputs, self.generation_config)
                inputs = {**inputs, "input_ids": ids, "attention_mask": mask, "labels": labels}
            return super(GKDTrainer, self).training_step(model, inputs, None)

    return _KDTrainer
