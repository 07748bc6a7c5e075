"""Direct preference optimisation: ranking pairs -> our templated tokens -> TRL's preference trainers.

`stage: dpo` with `pref_loss` sigmoid | hinge | ipo trains against a reference model with TRL's DPOTrainer;
`pref_loss: orpo` (TRL's ORPOTrainer) and `pref_loss: simpo` (TRL's CPOTrainer, SimPO loss) need no reference
model. `stage: orpo` / `stage: simpo` are aliases with the loss fixed (backend/stages).

Reads top to bottom: tokenizer/template -> ranking rows -> model (+adapter) -> reference -> trainer -> save.

The reference model (sigmoid / hinge / ipo) follows one rule with KTO's, `stages.base.reference_model`:
`ref_model` when given; for LoRA no second model (the policy training starts from, on the shared base
weights: the base model, or an SFT adapter continued from an earlier run, as in the DPO paper); for full /
freeze a frozen second copy of the model (our loader, not TRL's, so dtype / GGUF folders match).

ORPO is TRL's ORPOTrainer as it is: its odds ratio compares our answer spans, and its SFT term covers the
prompt and the chosen answer (as the ORPO paper's code does; LLaMA-Factory's covers the answer only).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from trl import DPOConfig, DPOTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from backend.dataprep.preference import build_preference_dataset
from backend.stages import REFERENCE_FREE_LOSSES, get_stage
from backend.stages.base import (RunError, StageResult, fit, reference_model, tokenizer_and_template, train_and_eval_rows,
                                 trainable_model)
from backend.training.logprobs import install_on_trainer
import torch

REFERENCE_LOSSES = ("sigmoid", "hinge", "ipo")  # DPOTrainer, with a reference model; orpo / simpo need none


def preference_loss(spec) -> str:
    """The loss this run trains with: an alias stage's fixed one (orpo, simpo), else spec.pref_loss."""
    return get_stage(spec.stage).pref_loss or spec.pref_loss


def run(spec, run_dir, stop) -> StageResult:
    loss = preference_loss(spec)
    run_dir.log(f"preference loss: {loss} (beta {spec.pref_beta:g})")

    # 1. tokenizer and template
    resolved, tokenizer, template = tokenizer_and_template(spec, run_dir)

    # 2. dataset: prompt / chosen / rejected token ids, the answers being the template's trained spans
    train_examples, val_examples = train_and_eval_rows(spec, run_dir, spec.stage)
    encode = dict(template=template, tokenizer=tokenizer, cutoff_len=spec.cutoff_len, log=run_dir.warn,
                  num_workers=spec.preprocessing_num_workers)
    train_rows, stats = build_preference_dataset(train_examples, **encode)
    run_dir.log(f"train pairs: {stats}")
    eval_rows = build_preference_dataset(val_examples, **encode)[0] if val_examples else None

    # 3. model (+adapter) and the reference it is held to
    model = trainable_model(spec, run_dir, resolved)
    ref_model = preference_reference(spec, run_dir, resolved, model, loss)

    # 4. train, save, plot
    trainer_class, args_class, config = trainer_for(spec, loss)
    extra = {"ref_model": ref_model} if loss in REFERENCE_LOSSES else {}
    return fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=_dataset(train_rows),
               eval_dataset=_dataset(eval_rows) if eval_rows else None, trainer_class=trainer_class,
               args_class=args_class, config=config, **extra)


def _dataset(rows: list[dict]):
    from datasets import Dataset  # TRL's trainers map over a datasets.Dataset

    return Dataset.from_list(rows)


def preference_reference(spec, run_dir, resolved, policy, loss: str):
    """The frozen reference model (stages.base.reference_model), or None where none is kept: orpo / simpo
    need none, and LoRA keeps no second model."""
    if loss in REFERENCE_FREE_LOSSES:
        run_dir.log(f"reference model: none ({loss} is reference-free)")
        return None
    return reference_model(spec, run_dir, resolved, policy)


def trainer_for(spec, loss: str) -> tuple[type, type, dict]:
    """(trainer class, config class, the config's own keys) for this preference loss."""
    if loss in REFERENCE_LOSSES:
        loss_types, weights = dpo_loss_terms(loss, spec.pref_ftx, spec.dpo_label_smoothing)
        return _TokenizedDPOTrainer, DPOConfig, dict(
            beta=spec.pref_beta, loss_type=loss_types, loss_weights=weights,
            label_smoothing=spec.dpo_label_smoothing, max_length=spec.cutoff_len)
    if loss == "orpo":
        return _TokenizedORPOTrainer, ORPOConfig, dict(beta=spec.pref_beta, max_length=spec.cutoff_len)
    if loss == "simpo":
        return _TokenizedCPOTrainer, CPOConfig, dict(
            loss_type="simpo", beta=spec.pref_beta, simpo_gamma=spec.simpo_gamma, cpo_alpha=spec.pref_ftx,
            max_length=spec.cutoff_len)
    raise RunError(f"pref_loss: {loss!r} is not a loss of stage dpo (choose sigmoid, hinge, ipo, orpo, simpo)")


def dpo_loss_terms(loss: str, ftx: float, label_smoothing: float) -> tuple[list[str], list[float]]:
    """DPOConfig's loss_type / loss_weights for our pref_loss, pref_ftx and dpo_label_smoothing.

    dpo_label_smoothing is LLaMA-Factory's conservative DPO (cDPO): (1-e)*L(d) + e*L(-d) with
    L(d) = -log sigmoid(beta*d). TRL 1.16's sigmoid loss has no smoothing and its "robust" loss is
    R = ((1-e)*L(d) - e*L(-d)) / (1-2e), so cDPO = 2(1-e)*sigmoid - (1-2e)*robust, exactly, from TRL's own terms.
    pref_ftx adds TRL's "sft" term (mean NLL of the chosen answers' tokens) with that weight."""
    if label_smoothing and loss != "sigmoid":
        raise RunError(f"dpo_label_smoothing applies to pref_loss sigmoid only (got {loss})")
    if label_smoothing:
        types, weights = ["sigmoid", "robust"], [2 * (1 - label_smoothing), -(1 - 2 * label_smoothing)]
    else:
        types, weights = [loss], [1.0]
    if ftx:
        types, weights = types + ["sft"], weights + [ftx]
    return types, weights


# -- TRL's trainers fed with our tokens ----------------------------------------------------------
# Our rows are already tokenized by our templates (backend/dataprep/preference.py). The trainers below change
# only the step where TRL would tokenize text itself, so the tokens it trains on are exactly ours.

def _without_ref_adapter_files(output_dir) -> None:
    """TRL's "ref" adapter (the frozen starting copy) is saved next to ours as ref/: it is training state
    only, and a run folder holds one adapter, the trained one."""
    ref = Path(output_dir) / "ref"
    if (ref / "adapter_config.json").is_file():
        shutil.rmtree(ref)


class _TokenizedDPOTrainer(DPOTrainer):
    """DPOTrainer taking rows {prompt_ids, chosen_ids, rejected_ids} as they are."""

    def __init__(self, *args, model, **kwargs):
        dtypes = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
        super().__init__(*args, model=model, **kwargs)
        # TRL casts a quantized model's trainable weights to bf16 (the QLoRA paper's choice); keep the dtype
        # our loader gave them (fp32 unless pure_bf16), as every stage does.
        for name, param in self.model.named_parameters():
            if name in dtypes and param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])
        # TRL's fused LM head -> ours: the same log-probabilities and logged metrics, answer tokens only, small tiles
        outputs = ("log_probs", "entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if self.use_weighting else ())
        self.run_log_lines = [install_on_trainer(self, outputs, pairs=True)]

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # TRL's version extracts a prompt from text and tokenizes it with the tokenizer's chat template;
        # ours are final token ids already, fitted to cutoff_len.
        return dataset

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        _without_ref_adapter_files(output_dir or self.args.output_dir)


def _paired_features(row: dict) -> dict:
    """Our row -> the columns TRL's ORPO / CPO collator pads (labels -100 on the prompt)."""
    prompt, chosen, rejected = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
    features = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        features[f"{name}_input_ids"] = prompt + answer
        features[f"{name}_attention_mask"] = [1] * (len(prompt) + len(answer))
        features[f"{name}_labels"] = [-100] * len(prompt) + answer
    return features


def _count_pair_tokens(trainer, inputs) -> None:
    """A pair batch has no input_ids for the Trainer to count tokens/s by: count both sequences' real tokens."""
    if trainer.args.include_num_input_tokens_seen == "no":
        return

    seen = inputs["chosen_attention_mask"].sum() + inputs["rejected_attention_mask"].sum()
    seen = torch.as_tensor(seen, device=trainer.args.device, dtype=torch.int64)
    trainer.state.num_input_tokens_seen += trainer.accelerator.gather(seen).sum().item()


class _TokenizedORPOTrainer(ORPOTrainer):
    def tokenize_row(self, feature, model=None):  # ours are token ids already
        return _paired_features(feature)

    def _track_num_input_tokens(self, inputs):
        _count_pair_tokens(self, inputs)


class _TokenizedCPOTrainer(CPOTrainer):
    def tokenize_row(self, feature, model=None):  # ours are token ids already
        return _paired_features(feature)

    def _track_num_input_tokens(self, inputs):
        _count_pair_tokens(self, inputs)
