"""The stage contract: the one place that knows which training stages exist.

Each stage is declared once here, in a light module (no torch) that the web UI imports too:
- `data`: the dataset kind it takes: "text" (pt), "plain" (conversations: sft), "ranking"
  (prompt + chosen + rejected), "kto" (conversations tagged desirable / undesirable), "prompts".
- `fields`: the stage-specific spec fields that apply to it (the form shows them for this stage only).
- `metrics`: the keys it logs besides loss / eval_loss (also logged with an `eval_` prefix when it
  evaluates); they land in trainer_log.jsonl and feed the plots named in `plots`.
- `implemented`: False = validate refuses the stage (with `reason`, when there is one) and the form does not
  offer it; its own fields are refused too.
- `shared_fields`: fields of every stage (not stage-specific) that this stage also reads, and the form shows for
  it though their group is not on the Train form (grpo samples with `temperature` and `top_p`).
- metric keys ending in `*` are prefixes: `rewards/*` logs every key that starts with `rewards/` (GRPO's
  per-function rewards/<name>/mean|std, named after the user's functions).
- `alias_of` + `pref_loss`: `stage: orpo` is `stage: dpo` with `pref_loss: orpo` (LLaMA-Factory has
  them as losses of dpo; the aliases keep older recipes running).
- `rules`: the stage's own validation rules (backend/stages/rules.py), run in this order by backend.core.spec after
  the rules of every stage; spec names no stage.
- flags other modules read instead of naming a stage: `is_reward_model` (it trains a score head: eval scores
  pairs, its run folder is a reward model), `packs_by_default` (packing is on unless the spec says),
  `generates` (it generates while it trains: use_vllm applies), `task_metric` (its rows are a prompt and one
  reference answer: eval_metric scores the answer generated at each save; `task_metric_refusal` says why not).
- `plots_when_logged`: plots shown only once the run has logged one of their keys (sft's task metric plot: only
  a run with an eval_metric logs it).

The heavy part (tokenizer -> rows -> model -> trainer) is `backend/stages/<module>.py` with
`run(spec, run_dir, stop) -> StageResult`; `backend.training.train` imports it through `stage_module()`.
Adding a stage = its module, its declaration below, and its locale key `train-stage.<id>`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from backend.core.metrics import TASK_METRICS, task_log_key
from backend.stages import rules
import importlib

DATA_KINDS = ("text", "plain", "ranking", "kto", "prompts")
NEEDED_COLUMN = {"kto": "kto_tag"}  # a dataset kind that needs a column of dataset_info.json's `columns`

# What TRL's DPOTrainer (sigmoid, hinge, ipo), ORPOTrainer (orpo: + nll_loss, log_odds_*) and CPOTrainer
# (simpo: + nll_loss) log; aux_loss for Mixture-of-Experts models only.
_PREF_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss",
                 "log_odds_ratio", "log_odds_chosen", "entropy", "mean_token_accuracy", "num_tokens", "aux_loss")


@dataclass(frozen=True)
class Stage:
    id: str
    title: str
    data: str
    fields: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    plots: tuple[tuple[str, tuple[str, ...]], ...] = ()
    implemented: bool = True
    alias_of: str | None = None
    pref_loss: str | None = None  # an alias's fixed preference loss
    reason: str | None = None  # why a stage is not implemented (validate says it)
    shared_fields: tuple[str, ...] = ()
    rules: tuple[Callable, ...] = ()  # rule(spec, stage, check_files) -> [(field, message, involved)]
    is_reward_model: bool = False
    packs_by_default: bool = False
    generates: bool = False
    task_metric: bool = False
    plots_when_logged: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """The module under backend/stages/ that trains it."""
        return self.alias_of or self.id

    def logged_keys(self) -> tuple[str, ...]:
        """Metric keys written to trainer_log.jsonl for this stage (train and eval_ variants)."""
        return self.metrics + tuple(f"eval_{k}" for k in self.metrics)

    @property
    def task_metric_refusal(self) -> str | None:
        """Why eval_metric (an answer generated at each save, scored against the row's reference) does not apply
        to this stage; None where it does."""
        if self.task_metric:
            return None
        why = "it trains a score head and generates no answer" if self.is_reward_model else _NO_REFERENCE[self.data]
        return (f"stage {self.id} has no eval_metric: {why}; score its adapter with `tuneboard eval` (stage sft) or "
                "the Evaluate tab")


# why a stage's rows give no reference answer to score a generated one against (Stage.task_metric_refusal)
_NO_REFERENCE = {
    "text": "its rows are plain text, with no prompt and reference answer",
    "plain": "its rows are not scored against a reference answer",
    "ranking": "its rows pair a chosen and a rejected answer (it learns a preference, not one reference answer)",
    "kto": "its rows are answers tagged desirable or undesirable, not reference answers",
    "prompts": "its rows are prompts without reference answers (its rewards are the live measure)",
}


_DPO_FIELDS = ("pref_loss", "pref_beta", "pref_ftx", "dpo_label_smoothing", "simpo_gamma", "ref_model")
_DPO_PLOTS = (("rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins")),
              ("accuracy", ("rewards/accuracies",)))
_DPO_RULES = (rules.whole_sequences, rules.preference)
# eval_metric at each save (eval_loss is drawn on the loss plot)
_TASK_PLOTS = (("task metric", tuple(task_log_key(m) for m in TASK_METRICS if task_log_key(m) != "eval_loss")),)

# the online RL stages (grpo, rloo): prompts, rewards from functions and reward models (backend/stages/grpo.py)
_ONLINE_FIELDS = ("reward_funcs", "reward_weights", "reward_schema", "reward_regex", "num_generations",
                  "max_completion_length", "grpo_beta", "grpo_epsilon", "use_vllm")
_ONLINE_PLOTS = (("reward", ("reward", "reward_std")), ("rewards per function", ("rewards/*/mean",)),
                 ("kl", ("kl",)), ("completion length", ("completions/mean_length", "completions/clipped_ratio")),
                 ("clip ratio", ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")))

STAGES: dict[str, Stage] = {s.id: s for s in (
    Stage("pt", "Pre-training", "text", packs_by_default=True),
    Stage("sft", "Supervised fine-tuning", "plain", task_metric=True, plots=_TASK_PLOTS,
          plots_when_logged=tuple(name for name, _ in _TASK_PLOTS)),
    Stage("rm", "Reward model", "ranking", is_reward_model=True, rules=(rules.whole_sequences, rules.no_prompt_loss),
          # TRL's RewardTrainer logs accuracy .. num_tokens; the rm stage adds the mean chosen / rejected scores
          metrics=("accuracy", "margin", "rewards/chosen", "rewards/rejected", "min_reward", "mean_reward",
                   "max_reward", "num_tokens"),
          plots=(("rewards", ("rewards/chosen", "rewards/rejected", "margin")), ("accuracy", ("accuracy",)))),
    Stage("dpo", "DPO", "ranking", fields=_DPO_FIELDS, metrics=_PREF_METRICS, plots=_DPO_PLOTS, rules=_DPO_RULES),
    Stage("orpo", "ORPO", "ranking", fields=("pref_beta",), metrics=_PREF_METRICS,
          plots=_DPO_PLOTS, alias_of="dpo", pref_loss="orpo", rules=_DPO_RULES),
    Stage("simpo", "SimPO", "ranking", fields=("pref_beta", "pref_ftx", "simpo_gamma"), metrics=_PREF_METRICS,
          plots=_DPO_PLOTS, alias_of="dpo", pref_loss="simpo", rules=_DPO_RULES),
    Stage("kto", "KTO", "kto", rules=(rules.kto_batches, rules.whole_sequences, rules.no_prompt_loss),
          fields=("pref_beta", "pref_ftx", "kto_chosen_weight", "kto_rejected_weight", "ref_model"),
          # exactly what TRL's KTOTrainer logs (aux_loss: Mixture-of-Experts models only)
          metrics=("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                   "logits/chosen", "logits/rejected", "kl", "entropy", "num_tokens", "aux_loss"),
          plots=(("rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins")), ("kl", ("kl",)))),
    Stage("kd", "Logit distillation", "plain", rules=(rules.kd,),
          fields=("teacher_model_name_or_path", "teacher_adapter", "teacher_quantization_bit", "kd_beta", "kd_lmbda",
                  "kd_temperature", "kd_alpha", "max_completion_length"),
          # backend/stages/kd.py logs the divergence to the teacher, the cross-entropy on the dataset's answers
          # (what kd_alpha mixes in; logged at any kd_alpha) and the share of steps on the student's own completions
          metrics=("kd_loss", "ce_loss", "on_policy"),
          plots=(("distillation", ("kd_loss", "ce_loss")), ("on-policy share", ("on_policy",)))),
    # written here (TRL has no PPO trainer): backend/stages/ppo.py logs these (reward: the raw score's mean); it
    # generates with transformers (rules.ppo refuses use_vllm)
    Stage("ppo", "PPO", "prompts", rules=(rules.ppo,), generates=True,
          fields=("ref_model", "reward_model", "reward_model_type", "reward_funcs", "reward_weights", "reward_schema",
                  "reward_regex", "max_completion_length", "ppo_epochs", "ppo_buffer_size", "ppo_target",
                  "ppo_score_norm", "ppo_whiten_rewards", "init_kl_coef", "adap_kl_ctrl", "gamma", "lam", "cliprange",
                  "cliprange_value", "vf_coef"),
          shared_fields=("temperature", "top_p"),
          metrics=("reward", "reward_std", "rewards/*", "kl", "kl_coef", "policy_loss", "value_loss", "clip_fraction",
                   "value_clip_fraction", "entropy", "approx_kl", "completions/mean_length",
                   "completions/clipped_ratio", "ppo/updates"),
          plots=(("reward", ("reward", "reward_std")), ("rewards per function", ("rewards/*/mean",)), ("kl", ("kl",)),
                 ("kl coefficient", ("kl_coef",)),
                 ("losses", ("policy_loss", "value_loss")), ("clip fraction", ("clip_fraction", "value_clip_fraction")),
                 ("entropy", ("entropy",)), ("approx kl", ("approx_kl",)),
                 ("completion length", ("completions/mean_length", "completions/clipped_ratio")))),
    Stage("grpo", "GRPO", "prompts", rules=(rules.grpo,), generates=True, fields=_ONLINE_FIELDS,
          shared_fields=("temperature", "top_p"),
          # what TRL's GRPOTrainer logs (kl only with grpo_beta > 0; rewards/<function>/mean|std per function)
          metrics=("reward", "reward_std", "rewards/*", "kl", "entropy", "frac_reward_zero_std",
                   "completions/mean_length", "completions/min_length", "completions/max_length",
                   "completions/clipped_ratio", "completions/mean_terminated_length", "clip_ratio/region_mean",
                   "clip_ratio/low_mean", "clip_ratio/high_mean", "num_tokens"),
          plots=_ONLINE_PLOTS),
    # stage grpo's run with TRL's RLOOTrainer (leave-one-out baseline): the same keys, rules and plots
    Stage("rloo", "RLOO", "prompts", rules=(rules.grpo,), generates=True, fields=_ONLINE_FIELDS,
          shared_fields=("temperature", "top_p"),
          # exactly what TRL's RLOOTrainer logs (kl only with grpo_beta > 0; aux_loss: Mixture-of-Experts only)
          metrics=("reward", "reward_std", "rewards/*", "kl", "entropy", "frac_reward_zero_std",
                   "completions/mean_length", "completions/min_length", "completions/max_length",
                   "completions/clipped_ratio", "completions/mean_terminated_length",
                   "completions/min_terminated_length", "completions/max_terminated_length", "clip_ratio/region_mean",
                   "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                   "num_tokens", "aux_loss"),
          plots=_ONLINE_PLOTS),
)}

STAGE_IDS: tuple[str, ...] = tuple(STAGES)
IMPLEMENTED: tuple[str, ...] = tuple(s.id for s in STAGES.values() if s.implemented)


def get_stage(stage_id: str) -> Stage:
    """The declaration of a stage id; KeyError names the known ones."""
    try:
        return STAGES[stage_id]
    except KeyError:
        raise KeyError(f"unknown stage {stage_id!r} (known: {', '.join(STAGE_IDS)})") from None


def stages_where(flag: str) -> tuple[str, ...]:
    """Implemented stages whose declaration sets this flag (for messages: 'only stage grpo generates ...')."""
    return tuple(s.id for s in STAGES.values() if getattr(s, flag) and s.implemented)


def stages_with_data(kind: str) -> tuple[str, ...]:
    """Implemented stages that take this dataset kind (for messages: 'use it with rm, dpo, ...')."""
    return tuple(s.id for s in STAGES.values() if s.data == kind and s.implemented)


def matches(key: str, pattern: str) -> bool:
    """Whether a logged key is a declared metric key; `*` in the pattern stands for any text."""
    if "*" not in pattern:
        return key == pattern
    head, _, tail = pattern.partition("*")
    return key.startswith(head) and key.endswith(tail) and len(key) >= len(head) + len(tail)


def stages_using_field(name: str) -> tuple[str, ...] | None:
    """The stages a stage-specific spec field applies to; None = a field of every stage."""
    using = tuple(s.id for s in STAGES.values() if name in s.fields)
    return using or None


REFERENCE_FREE_LOSSES = ("orpo", "simpo")  # preference losses that need no reference model


def uses_reference(stage_id: str, pref_loss: str | None = None) -> bool:
    """Whether a stage trains against a frozen reference model: the stages that take `ref_model`, unless
    their preference loss needs none (ORPO, SimPO). Read-only; the memory estimate uses it."""
    stage = get_stage(stage_id)
    return "ref_model" in stage.fields and (stage.pref_loss or pref_loss) not in REFERENCE_FREE_LOSSES


def pairwise(stage_id: str | None) -> bool:
    """Whether each row of the stage is a chosen + rejected pair (both go through the model: a micro-batch holds
    twice its rows' tokens). False for an unknown stage (validate names that one). The memory estimate and the
    checkpointing choice use it."""
    try:
        return get_stage(stage_id or "sft").data == "ranking"
    except KeyError:
        return False


def stage_module(stage_id: str):
    """The heavy module that trains this stage (imports torch): backend.stages.<module>."""

    return importlib.import_module(f"backend.stages.{get_stage(stage_id).module}")
