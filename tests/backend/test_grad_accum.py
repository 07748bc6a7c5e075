"""Gradient accumulation is token-weighted: through the real HF Trainer, (batch 8, GA 1), (batch 1, GA 8),
a padding-free packed batch of the same 8 rows and padding-free batches (batch 2, GA 4) give the same loss and
gradient norm, and that loss is the mean over every trained token of the 8 rows (not a mean of per-row or
per-micro-batch means)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from backend.dataprep.preprocess import IGNORE_INDEX, PackedCollator, PaddingCollator, PaddingFreeCollator, pack_rows

VOCAB = 97


def make_rows() -> list[dict]:
    """8 rows of very different lengths and trained-token counts (so an unweighted mean would differ)."""
    rng = random.Random(3)
    rows = []
    for prompt, answer in [(3, 1), (20, 30), (5, 2), (12, 40), (2, 3), (30, 5), (8, 8), (4, 25)]:
        ids = [rng.randrange(1, VOCAB) for _ in range(prompt + answer)]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:],
                     "attention_mask": [1] * len(ids)})
    return rows


@pytest.fixture(scope="module")
def initial_state():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, attn_implementation="sdpa",
                         initializer_range=0.5)  # peaked logits: per-token losses differ a lot between rows
    model = LlamaForCausalLM(config)
    return config, {k: v.clone() for k, v in model.state_dict().items()}


def train_one_step(initial_state, tmp_path, rows, collator, batch_size, grad_accum, lora=False, varlen=False) -> dict:
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    config, state = initial_state
    model = LlamaForCausalLM(copy.deepcopy(config))  # the varlen run switches its config's attention
    model.load_state_dict(state)
    if lora:  # the default fine-tuning method: the Trainer looks through the peft wrapper
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # same LoRA init in every run
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights="gaussian"))
    if varlen:  # one causal SDPA per row, rows from the collator's cu_seq_lens (backend.training.attention)
        from backend.training.attention import use_varlen_attention

        assert use_varlen_attention(model) is None
    args = TrainingArguments(
        output_dir=str(tmp_path / f"bs{batch_size}_ga{grad_accum}_{len(rows)}"), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, max_steps=1, learning_rate=1e-6, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, lr_scheduler_type="constant",
        dataloader_drop_last=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
    assert trainer.model_accepts_loss_kwargs  # what makes the Trainer pass num_items_in_batch
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "loss" in h]
    return logged


def per_row_losses(initial_state, rows) -> list[tuple[float, int]]:
    """(summed token loss, trained tokens) per row, each row run alone."""
    from transformers import LlamaForCausalLM

    config, state = initial_state
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(state)
    out = []
    with torch.no_grad():
        for r in rows:
            n = sum(1 for x in r["labels"][1:] if x != IGNORE_INDEX)
            loss = model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]]),
                         num_items_in_batch=1).loss
            out.append((loss.item(), n))
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ga_is_token_weighted(initial_state, tmp_path, lora):
    rows = make_rows()
    per_row = per_row_losses(initial_state, rows)
    token_mean = sum(s for s, _ in per_row) / sum(n for _, n in per_row)
    mean_of_means = sum(s / n for s, n in per_row) / len(per_row)
    # on these rows an unweighted mean is clearly distinguishable from the token mean
    assert abs(mean_of_means - token_mean) > 1e-2 * token_mean

    padding = PaddingCollator(0)
    one_batch = train_one_step(initial_state, tmp_path, rows, padding, 8, 1, lora)
    accumulated = train_one_step(initial_state, tmp_path, rows, padding, 1, 8, lora)
    two_by_four = train_one_step(initial_state, tmp_path, rows, padding, 2, 4, lora)
    packed_rows = pack_rows(rows, 64)
    packed = train_one_step(initial_state, tmp_path, packed_rows, PackedCollator(), 1, len(packed_rows), lora)
    padding_free = train_one_step(initial_state, tmp_path, rows, PaddingFreeCollator(), 2, 4, lora)
    varlen = train_one_step(initial_state, tmp_path, rows, PaddingFreeCollator(flash_attn_kwargs=True), 2, 4, lora,
                            varlen=True)

    for run in (one_batch, accumulated, two_by_four, packed, padding_free, varlen):
        assert run["loss"] == pytest.approx(token_mean, rel=1e-4)
        assert run["grad_norm"] == pytest.approx(one_batch["grad_norm"], rel=1e-4)
