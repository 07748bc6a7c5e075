"""GRPO (online RL with reward functions): prompts -> completions sampled from the model -> rewards -> TRL's
GRPOTrainer.

Reads top to bottom: tokenizer/template -> prompt rows -> reward functions -> model (+adapter) -> trainer ->
train -> save.

Prompts: the conversations of any registered dataset, rendered by our template up to the assistant's turn
(the text and tokens `tuneboard chat` and `tuneboard eval` generate from). The row's last assistant turn, when
it has one, is not trained on: it is the row's `reference`, which field_f1 / exact_match / json_schema (and a
user's function, as the `reference` keyword) compare the completions with. A prompt longer than
cutoff_len - max_completion_length loses its oldest tokens.

Generation: transformers' generate inside TRL (num_generations samples per prompt, temperature, top_p, at most
max_completion_length tokens, ending at the template's end-of-turn token); use_vllm: TRL's vLLM engine,
colocated on the GPU. The batch counts completions, as in TRL: per_device_train_batch_size x
gradient_accumulation_steps completions per optimizer step, num_generations of each prompt.

Reference model (grpo_beta > 0, logged as kl): LoRA: no second model: a fresh adapter is disabled to get the
reference; a continued adapter (adapter_name_or_path: SFT -> GRPO) keeps a frozen copy of its starting
weights (TRL's "ref" adapter), so the reference is that SFT model. full / freeze: TRL loads a frozen copy of the
model. grpo_beta 0: no reference, no kl.

What a user sees besides the metrics: every logging step appends a sample of the latest completions with
their rewards to completions.jsonl (backend.core.rundir.COMPLETIONS_FILE) and puts the best one in the run log.

Rewards: the built-in and a user's functions (backend.core.rewards), and reward models (a folder in reward_funcs:
backend.evaluation.reward_score.RewardModelReward, loaded once, scoring each completion with its own template).
Stage rloo (backend/stages/rloo.py) is this module with TRL's RLOOTrainer: `train_online` is shared.
"""
from __future__ import annotations

import json

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from backend.training.adapters import _upcast_trainable
from backend.serving.engine import stop_token_ids
from backend.core.methods import method
from backend.core.rewards import RewardError, build_reward_funcs, load_schema, metric_name, split_names
from backend.evaluation.reward_score import RewardModelReward
from backend.core.rundir import COMPLETIONS_FILE
from backend.stages.base import (RunError, StageResult, adapter_is_identity, fit, load_rows, tokenizer_and_template,
                                 trainable_model)
from backend.stages.dpo import _without_ref_adapter_files

SAMPLES_PER_LOG = 8  # completions written to completions.jsonl per logging step


def run(spec, run_dir, stop) -> StageResult:
    return train_online(spec, run_dir, stop, trainer_base=GRPOTrainer, args_class=GRPOConfig, config=grpo_config(spec))


def train_online(spec, run_dir, stop, *, trainer_base, args_class, config: dict) -> StageResult:
    """An online RL stage (grpo, rloo): TRL's `trainer_base` generating from our prompts, scored by the spec's
    reward functions and reward models."""
    if spec.use_vllm and not torch.cuda.is_available():
        raise RunError("use_vllm: vLLM generation needs a GPU and torch sees none: leave use_vllm off to generate "
                       "with transformers")

    # 1. tokenizer and template
    resolved, tokenizer, template = tokenizer_and_template(spec, run_dir)

    # 2. prompts rendered by our template, each with its reference answer
    rows, prompt_ids = prompt_rows(spec, run_dir, load_rows(spec, run_dir, spec.dataset, spec.stage), template,
                                   tokenizer)

    # 3. reward functions and reward models (a user's file is imported here, before the model is loaded)
    reward_funcs = reward_functions(spec, run_dir)

    # 4. model and adapters; generation ends at the template's end of turn
    model = trainable_model(spec, run_dir, resolved)
    model.generation_config.eos_token_id = stop_token_ids(tokenizer, template)
    if spec.grpo_beta == 0:
        run_dir.log("reference model: none (grpo_beta 0)")
    elif method(spec.finetuning_type).adapter:
        run_dir.log("reference model: " + ("the adapter from " + spec.adapter_name_or_path + " (a frozen copy of its "
                                           "starting weights)" if spec.adapter_name_or_path else
                                           "the base model (the new adapter disabled; no copy in memory)"))
    else:
        run_dir.log(f"reference model: a frozen copy of {spec.model_name_or_path}")

    # 5. train, save, plot
    try:
        return fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=Dataset.from_list(rows),
                   trainer_class=online_trainer_class(trainer_base, spec, run_dir, prompt_ids), args_class=args_class,
                   config=config, reward_funcs=reward_funcs)
    except RewardError as exc:  # a user's reward function misbehaved: one line, no traceback
        raise RunError(str(exc)) from None


def grpo_config(spec) -> dict:
    """GRPOConfig's own keys from the spec (the rest of the config is the spec's TrainingArguments)."""
    return dict(num_generations=spec.num_generations, max_completion_length=spec.max_completion_length,
                beta=spec.grpo_beta, epsilon=spec.grpo_epsilon, temperature=spec.temperature, top_p=spec.top_p,
                reward_weights=[float(w) for w in split_names(spec.reward_weights)] or None, use_vllm=spec.use_vllm,
                vllm_mode="colocate", log_completions=False)


def reward_functions(spec, run_dir) -> list:
    """reward_funcs -> TRL's reward callables, in order (reward_weights weigh them): the built-ins, a user's
    functions (imported here) and reward models (loaded here, once, in eval mode). Logged with their weights."""
    def reward_model(path: str):
        run_dir.log(f"reward model {metric_name(path)}: loading {path}")
        try:
            return RewardModelReward(path, metric_name(path), batch_size=spec.per_device_train_batch_size,
                                     warn=run_dir.warn, trust_remote_code=spec.trust_remote_code)
        except ValueError as exc:  # not a reward model, or its base cannot be found: one line naming it
            raise RewardError(f"reward_funcs: {path}: {exc}") from None

    try:
        funcs = build_reward_funcs(spec.reward_funcs, max_completion_length=spec.max_completion_length,
                                   regex=spec.reward_regex, reward_model=reward_model)
    except RewardError as exc:
        raise RunError(str(exc)) from None
    weights = [float(w) for w in split_names(spec.reward_weights)] or [1.0] * len(funcs)
    run_dir.log("rewards: " + ", ".join(f"{name} x {w:g}" for name, w in zip(split_names(spec.reward_funcs), weights)))
    return funcs


def prompt_rows(spec, run_dir, examples: list[dict], template, tokenizer) -> tuple[list[dict], dict[str, list[int]]]:
    """Rows {prompt (the rendered text), reference, schema, conversation (the prompt turns as JSON, for a reward
    model's own template)} for the trainer, and the token ids of each prompt text (what is generated from). The
    last assistant turn of a row is its reference, not part of the prompt."""
    schema = json.dumps(load_schema(spec.reward_schema)) if spec.reward_schema else None
    room = spec.cutoff_len - spec.max_completion_length
    rows, ids_by_prompt, cut, skipped = [], {}, 0, 0
    for example in examples:
        messages = list(example["messages"])
        reference = None
        if messages and messages[-1]["role"] == "assistant":
            reference = messages.pop()["content"]
        if not any(m["role"] == "user" for m in messages):
            skipped += 1
            continue
        text = template.render_text(messages, example.get("tools"), add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > room:
            ids, cut = ids[len(ids) - room:], cut + 1
        ids_by_prompt.setdefault(text, ids)
        conversation = json.dumps({"messages": messages, "tools": example.get("tools")}, ensure_ascii=False)
        rows.append({"prompt": text, "reference": reference, "schema": schema, "conversation": conversation})
    if skipped:
        run_dir.warn(f"{skipped} rows have no user turn to prompt with: skipped")
    if cut:
        run_dir.warn(f"{cut} prompts are longer than cutoff_len - max_completion_length ({room} tokens): their oldest "
                     "tokens were cut")
    if not rows:
        raise RunError("no prompts left to train on (see the warnings above)")
    with_ref = sum(r["reference"] is not None for r in rows)
    run_dir.log(f"train prompts: {len(rows)} ({with_ref} with a reference answer), "
                f"{spec.num_generations} completions each per step")
    return rows, ids_by_prompt


def online_trainer_class(trainer_base, spec, run_dir, prompt_ids: dict[str, list[int]]):
    """TRL's GRPOTrainer or RLOOTrainer (`trainer_base`: the same hooks) generating from our prompt tokens, writing
    completions.jsonl, with no copy of an adapter that is still the identity."""

    class _OnlineTrainer(trainer_base):
        def __init__(self, *args, data_collator=None, **kwargs):  # GRPO batches raw rows: no collator
            super().__init__(*args, **kwargs)
            # TRL casts a quantized model's trainable weights to bf16; we keep them fp32 as every stage does.
            _upcast_trainable(self.model, spec)
            model = self.accelerator.unwrap_model(self.model)
            # TRL copies a PeftModel's adapter as the reference ("ref"); a fresh adapter (B = 0) changes nothing,
            # so disabling it gives the same reference without the copy.
            if "ref" in getattr(model, "peft_config", {}) and adapter_is_identity(model):
                model.delete_adapter("ref")
                model.set_adapter("default")

        def _tokenize_prompts(self, prompts):
            # our template's tokens, not the tokenizer's chat template (TRL would re-tokenize the text)
            return [prompt_ids[p] for p in prompts], None, {}

        def _track_num_input_tokens(self, inputs):
            pass  # TRL counts prompt + completion tokens itself when it generates

        def log(self, logs, start_time=None):
            if self.model.training and "loss" in logs:
                write_completions(run_dir, self.state.global_step, self._logs, self.reward_weights.tolist())
            super().log(logs, start_time)

        def _save(self, output_dir=None, state_dict=None):
            super()._save(output_dir, state_dict)
            _without_ref_adapter_files(output_dir or self.args.output_dir)

    return _OnlineTrainer


def write_completions(run_dir, step: int, logs: dict, weights: list[float]) -> None:
    """The latest completions (TRL's buffer of the last generation batch) -> completions.jsonl, and the best one
    of them into the run log."""
    prompts, completions = list(logs["prompt"]), list(logs["completion"])
    per_func = {name: list(values) for name, values in logs["rewards"].items()}
    if not completions:
        return
    records = []
    for i in range(max(0, len(completions) - SAMPLES_PER_LOG), len(completions)):
        rewards = {name: _finite(values[i]) for name, values in per_func.items() if i < len(values)}
        total = sum(w * v for w, v in zip(weights, rewards.values()) if v is not None)
        records.append({"step": step, "prompt": prompts[i], "completion": completions[i], "reward": total,
                        "rewards": rewards})
    log_completions(run_dir, records)


def log_completions(run_dir, records: list[dict]) -> None:
    """Completion records ({step, prompt, completion, reward, ...}) appended to completions.jsonl (the writing rank
    only), and the best one into the run log: the online RL stages' (grpo, rloo, ppo) sample table."""
    if not records:
        return
    if getattr(run_dir, "writer", True):
        with open(run_dir.path / COMPLETIONS_FILE, "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    best = max(records, key=lambda r: r["reward"])
    shown = " ".join(best["completion"].split())
    run_dir.log(f"completion (reward {best['reward']:.3g}): {shown[:200]}{'…' if len(shown) > 200 else ''}")


def _finite(value) -> float | None:
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None
