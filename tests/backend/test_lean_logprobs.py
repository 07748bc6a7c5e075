"""backend.training.logprobs: DPO and KTO with the lean log-probability head (answer tokens only, small tiles) train
exactly as with TRL's fused head over every position (TUNEBOARD_CHUNKED_LOSS=0): same per-step losses, rewards,
logged metrics and gradient norms, on a tiny Llama, with tiles small enough that every batch spans several; and DPO
with each pair's prompt computed once (backend/training/shared_prompt.py) trains as with the pairs as two rows."""
from __future__ import annotations

import json

import pytest
import torch

from backend.core.spec import validate_spec

TOPICS = ["the sea", "a cat", "music", "trees", "the moon", "bread", "rain", "a bicycle"]


class _QuietRunDir:
    def log(self, message):
        pass

    warn = log


@pytest.fixture(scope="module")
def pairs(tiny_llama, tmp_path_factory):
    """8 pairs of different lengths, tokenized as stage dpo does (llama3 template)."""
    from backend.dataprep.data import load_examples
    from backend.dataprep.preference import build_preference_dataset
    from backend.dataprep.templates import get_template
    from backend.training.models import load_tokenizer, resolve_model

    folder = tmp_path_factory.mktemp("lean_pairs")
    rows = [{"instruction": f"Tell me something about {t}." + " Please." * i, "input": "",
             "chosen": f"Gladly! {t.capitalize()} is wonderful." + " Really." * (3 - i % 4), "rejected": "No."}
            for i, t in enumerate(TOPICS)]
    (folder / "pairs.json").write_text(json.dumps(rows), encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"pairs": {
        "file_name": "pairs.json", "ranking": True,
        "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}}}))
    tokenizer = load_tokenizer(resolve_model(str(tiny_llama)))
    examples, _ = load_examples("pairs", folder, stage="dpo")
    return build_preference_dataset(examples, get_template("llama3", tokenizer), tokenizer, 128)[0]


def _train(stage, tiny_llama, rows, tmp_path, lean: bool, monkeypatch, shared: bool = True, method: str = "lora"
           ) -> tuple[list[dict], list[str]]:
    """2 steps of the stage's own trainer on `rows`: (log_history, the trainer's run-log lines)."""
    from datasets import Dataset
    from transformers import set_seed
    from trl import KTOConfig

    from backend.stages import dpo, kto
    from backend.stages.base import reference_model, trainable_model, training_arguments
    from backend.training.models import load_tokenizer, resolve_model

    monkeypatch.setenv("TUNEBOARD_CHUNKED_LOSS", "1" if lean else "0")
    monkeypatch.setenv("TUNEBOARD_SHARED_PROMPT", "1" if shared else "0")
    spec = validate_spec({"model_name_or_path": str(tiny_llama), "stage": stage, "dataset": "unused",
                          "template": "llama3", "cutoff_len": 128, "lora_rank": 4, "per_device_train_batch_size": 4,
                          "max_steps": 2, "logging_steps": 1, "learning_rate": 1e-2, "lr_scheduler_type": "constant",
                          "save_strategy": "no", "report_to": "none", "finetuning_type": method},
                         check_files=False)
    set_seed(0)  # the same LoRA initialisation for both heads
    resolved = resolve_model(spec.model_name_or_path)
    model = trainable_model(spec, _QuietRunDir(), resolved)
    ref_model = reference_model(spec, _QuietRunDir(), resolved, model)  # full: a frozen copy; LoRA: None
    if stage == "dpo":
        trainer_class, args_class, config = dpo.trainer_for(spec, "sigmoid")
    else:
        trainer_class, args_class = kto._kto_trainer_class(spec), KTOConfig
        config = {"beta": spec.pref_beta, "max_length": spec.cutoff_len}
    args = training_arguments(spec, tmp_path / f"{stage}-{lean}-{shared}", has_eval=False, args_class=args_class,
                              extra=config)
    trainer = trainer_class(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=load_tokenizer(resolved))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], trainer.run_log_lines


@pytest.mark.parametrize("stage, method", [("dpo", "lora"), ("kto", "lora"), ("kto", "full")])
def test_lean_head_trains_as_trls_head(stage, method, tiny_llama, pairs, tmp_path, monkeypatch):
    """KTO's lean head also runs each padded batch as one row without padding (shared_prompt.find_rows), and the
    reference's rows and KL rows as one forward of pairs: TRL's head computes the padded rows in two reference
    forwards, so the same numbers show the packing changes nothing but the work."""
    from backend.training import logprobs, shared_prompt

    monkeypatch.setattr(logprobs, "TILE_TOKENS", 16)  # several tiles a batch, and tiles narrower than the vocabulary
    monkeypatch.setattr(logprobs, "TILE_VOCAB", 96)
    packed = []
    real = shared_prompt.packed_hidden
    monkeypatch.setattr(shared_prompt, "packed_hidden", lambda *a: packed.append(type(a[1]).__name__) or real(*a))
    rows = pairs if stage == "dpo" else [
        {"prompt_ids": r["prompt_ids"], "completion_ids": r[answer], "label": answer == "chosen_ids"}
        for r in pairs for answer in ("chosen_ids", "rejected_ids")]
    lean, lean_lines = _train(stage, tiny_llama, rows, tmp_path, True, monkeypatch, method=method)
    plain, plain_lines = _train(stage, tiny_llama, rows, tmp_path, False, monkeypatch, method=method)
    assert "answer tokens only" in lean_lines[0] and "TRL's fused head" in plain_lines[0]
    if stage == "kto":  # the two probes, then 3 forwards a micro-batch: the reference's rows and KL rows as one
        # forward of pairs sharing their prompts (kto.reference_log_probs), ...
        assert "a batch's rows in one row without padding" in lean_lines[0]
        assert "the reference's rows and KL rows in one forward, each prompt computed once" in lean_lines[0]
        probes = ["Rows", "Pairs"] if method == "lora" else ["Rows", "Rows", "Pairs"]  # full: the reference's own
        assert packed[:len(probes)] == probes and len(packed) >= len(probes) + 6, packed
        # then the batch's rows, keeping their prompts' keys and values, and the policy's KL rows continuing them
        assert "the policy's KL rows continue its rows' prompts" in lean_lines[0]
        assert packed[len(probes):] == ["Pairs", "Rows", "Continuations"] * ((len(packed) - len(probes)) // 3), packed
    assert len(lean) == len(plain) == 2
    assert abs(plain[1]["loss"] - plain[0]["loss"]) > 1e-3  # the first step moved the policy: step 2 tells heads apart
    for ours, theirs in zip(lean, plain):
        keys = [k for k in theirs if k.split("/")[0] in ("loss", "grad_norm", "rewards", "logps", "logits", "kl",
                                                           "entropy", "mean_token_accuracy")]
        assert "rewards/chosen" in keys or "rewards/chosen_sum" in keys
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), key


def test_dpo_pairs_sharing_their_prompt_train_as_two_rows(tiny_llama, pairs, tmp_path, monkeypatch):
    """Both packings (one row of pairs on the varlen SDPA; a padded row a pair with a 4D mask, where the varlen
    SDPA is not switched on) give the rows' losses, rewards and gradient norms."""
    from backend.training import logprobs, shared_prompt

    packed = []
    real = shared_prompt.packed_hidden
    monkeypatch.setattr(shared_prompt, "packed_hidden", lambda *a: packed.append(a[2]) or real(*a))
    one_row, one_row_lines = _train("dpo", tiny_llama, pairs, tmp_path / "a", True, monkeypatch, shared=True)
    assert "(the batch's pairs in one row without padding)" in one_row_lines[0]
    with monkeypatch.context() as patch:
        patch.setattr(logprobs, "use_varlen_attention", lambda model: "off for the test")
        padded, padded_lines = _train("dpo", tiny_llama, pairs, tmp_path / "b", True, monkeypatch, shared=True)
    assert "(a padded row a pair)" in padded_lines[0]
    assert packed.count("varlen") >= 5 and packed.count("bool") >= 5  # the probe + 2 steps x (policy + reference)
    calls = len(packed)
    rows, rows_lines = _train("dpo", tiny_llama, pairs, tmp_path / "c", True, monkeypatch, shared=False)
    assert "two rows (TUNEBOARD_SHARED_PROMPT=0)" in rows_lines[0] and len(packed) == calls
    assert abs(rows[1]["loss"] - rows[0]["loss"]) > 1e-3
    for shared in (one_row, padded):
        for ours, theirs in zip(shared, rows):
            keys = [k for k in theirs if k.split("/")[0] in ("loss", "grad_norm", "rewards", "logps", "logits",
                                                               "entropy", "mean_token_accuracy")]
            assert "rewards/chosen" in keys and "grad_norm" in keys
            for key in keys:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("checkpointing", [False, True])
def test_kto_kl_rows_continuing_the_rows_prompts_give_their_own_forwards_numbers(tiny_llama, checkpointing):
    """logprobs.PendingKL: a KTO batch's forward (with gradients, the layers checkpointed or not) keeps its rows'
    prompt keys and values, and the KL rows (each row's prompt, another row's answer) then run from their prompts'
    ends: the same summed log-probabilities, row by row, as the KL rows' own forward (the KL metric TRL logs is
    clamped at 0, so the training comparison above can miss an error)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from backend.training import logprobs, shared_prompt

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    lm = model.get_base_model()
    add_fused_lm_head(lm)
    assert logprobs.install_lean_logprobs(model) is None and logprobs.pack_rows(model) is None
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 300, (n,), generator=gen) for n in (6, 3, 9, 1)]
    answers = [torch.randint(5, 300, (n,), generator=gen) for n in (4, 7, 2, 5)]

    def padded(pieces):  # flush-left rows, their mask, and the answer mask
        width = max(len(p) + len(a) for p, a in pieces)
        ids, mask, answer = (torch.zeros(len(pieces), width, dtype=torch.long) for _ in range(3))
        for r, (p, a) in enumerate(pieces):
            ids[r, :len(p) + len(a)] = torch.cat([p, a])
            mask[r, :len(p) + len(a)] = 1
            answer[r, len(p):len(p) + len(a)] = 1
        return ids, mask, answer

    ids, mask, answer = padded(list(zip(prompts, answers)))
    kl_ids, kl_mask, kl_answer = padded(list(zip(prompts, answers[-1:] + answers[:-1])))  # the previous row's answer
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": answer, "KL_input_ids": kl_ids,
             "KL_attention_mask": kl_mask, "KL_completion_mask": kl_answer}
    kl_labels = kl_ids.masked_fill(kl_answer == 0, -100)
    with torch.no_grad():
        own = model(input_ids=kl_ids, attention_mask=kl_mask, labels=kl_labels, fused_lm_head=True).log_probs.sum(-1)

    packed = []
    real = shared_prompt.packed_hidden
    shared_prompt.packed_hidden = lambda *a: packed.append(type(a[1]).__name__) or real(*a)
    try:
        out = logprobs.kl_after_rows(model, batch)
        assert torch.isnan(out).all()  # nothing yet: the batch's forward fills it
        pending = lm._kl_pending
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(answer == 0, -100),
                     fused_lm_head=True).log_probs.sum()
        loss.backward()  # the checkpointed layers recompute: the kept keys and values are not taken again
    finally:
        shared_prompt.packed_hidden = real
    assert packed == ["Rows", "Continuations"] and pending.continued and not logprobs.kl_left_pending(model)
    assert torch.allclose(out, own, rtol=1e-5, atol=1e-5), (out, own)
    assert own.abs().min() > 1  # sums of several answer tokens' log-probabilities: a real comparison

    # KL rows that do not share their row's prompt take a forward of their own, with the same numbers
    kl_ids2 = kl_ids.clone()
    kl_ids2[0, 0] = kl_ids[0, 0] + 1
    batch2 = {**batch, "KL_input_ids": kl_ids2}
    with torch.no_grad():
        own2 = model(input_ids=kl_ids2, attention_mask=kl_mask, labels=kl_ids2.masked_fill(kl_answer == 0, -100),
                     fused_lm_head=True).log_probs.sum(-1)
        out2 = logprobs.kl_after_rows(model, batch2)
        pending = lm._kl_pending
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(answer == 0, -100), fused_lm_head=True)
    assert not pending.continued and torch.allclose(out2, own2, rtol=1e-5, atol=1e-5)
