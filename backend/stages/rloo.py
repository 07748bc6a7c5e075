"""RLOO (REINFORCE Leave-One-Out: online RL with reward functions): prompts -> completions sampled from the model ->
rewards -> TRL's RLOOTrainer.

The same run as stage grpo (backend/stages/grpo.py, `train_online`: prompts rendered by our template with their
reference answers, the built-in / user reward functions and reward models, weighted by reward_weights, LoRA's
reference without a copy, completions.jsonl); what differs is the advantage: each completion's reward minus the
mean reward of the other num_generations - 1 completions of its prompt (RLOO's baseline), where GRPO divides by
the group's spread. The keys are GRPO's: num_generations, max_completion_length, temperature, top_p, grpo_beta
(the KL coefficient against the reference; 0 = no reference model), grpo_epsilon (the clip range), use_vllm.
"""
from __future__ import annotations

from trl import RLOOConfig, RLOOTrainer

from backend.stages.base import StageResult
from backend.stages.grpo import grpo_config, train_online


def run(spec, run_dir, stop) -> StageResult:
    return train_online(spec, run_dir, stop, trainer_base=RLOOTrainer, args_class=RLOOConfig, config=rloo_config(spec))


def rloo_config(spec) -> dict:
    """RLOOConfig's own keys from the spec: GRPO's, under the same names (RLOOConfig has each of them)."""
    return grpo_config(spec)
