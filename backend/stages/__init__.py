"""The stage contract: the one place that knows which training stages exist.

Each stage is declared once here, in a light module (no torch) that the web UI imports too:
- `data`: the dataset kind it takes: "text" (pt), "plain" (conversations: sft), "ranking"
  (prompt + chosen + rejected), "kto" (conversations tagged desirable / undesirable), "prompts".
- `fields`: the stage-specific spec fields that apply to it (the form shows them for this stage only); the fields
  themselves are declared below in the stage family's keys class (`STAGE_KEYS`, which RunSpec inherits).
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
  reference answer: eval_metric scores the answer generated at each save; `task_metric_refusal` says why not),
  `token_loss` (its loss is the Trainer's cross-entropy over the answer tokens: label_smoothing_factor applies).
- `bf16_by_default`: bf16 left unset trains in bf16 on a CPU with native bf16 matmul (with a method that says the
  same): the stages where bf16 was measured to learn like fp32 (bench/README.md, 2026-12-04); the others stay fp32
  unless `bf16: true`.
- `plots_when_logged`: plots shown only once the run has logged one of their keys (sft's task metric plot: only
  a run with an eval_metric logs it).

The heavy part (tokenizer -> rows -> model -> trainer) is `backend/stages/<module>.py` with
`run(spec, run_dir, stop) -> StageResult`; `backend.training.train` imports it through `stage_module()`.
Adding a stage = its module, its declaration below (with a keys class in `STAGE_KEYS` for keys of its own), and its
locale key `train-stage.<id>`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

from pydantic import field_validator

from backend.core.metrics import TASK_METRICS, task_log_key
from backend.core.spec_keys import Keys, spec_key as _f
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
    token_loss: bool = False
    plots_when_logged: tuple[str, ...] = ()
    bf16_by_default: bool = False
    # its trainer is TRL's, which switches an adapter's activation checkpointing under DeepSpeed ZeRO-3 to torch's
    # reentrant form (trl issue 2514); that form keeps no outputs selectively (backend/core/checkpointing.py)
    zero3_adapter_reentrant: bool = True

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


DEFAULT_STAGE = "sft"


# ---------------------------------------------------------------- the stages' own spec keys (RunSpec inherits them)
class PreferenceKeys(Keys):
    """dpo (and its aliases orpo, simpo) and kto; ref_model serves ppo too."""
    pref_loss: Literal["sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"] = _f("sigmoid", "Preference loss for DPO-style stages.", "method")
    pref_beta: float = _f(0.1, "Beta of the preference loss (strength of the reference-model constraint).", "method", ge=0)
    pref_ftx: float = _f(0.0, "Weight of the SFT loss added to the preference loss.", "method", ge=0)
    simpo_gamma: float = _f(0.5, "Target reward margin of the SimPO loss.", "method")
    dpo_label_smoothing: float = _f(0.0, "Robust DPO label smoothing, between 0 and 0.5.", "method", ge=0, le=0.5)
    kto_chosen_weight: float = _f(1.0, "KTO loss weight of desirable examples.", "method", ge=0)
    kto_rejected_weight: float = _f(1.0, "KTO loss weight of undesirable examples.", "method", ge=0)
    ref_model: Optional[str] = _f(None, "Reference model for DPO/KTO/PPO (default: the model itself).", "method")

    @field_validator("pref_loss")
    @classmethod
    def _available_pref_loss(cls, value: str) -> str:
        if value == "kto_pair":
            raise ValueError("kto_pair is not available (TRL dropped it from its DPO trainer): use stage: kto "
                             "with a dataset that has a kto_tag column")
        return value


class PpoKeys(Keys):
    reward_model: Optional[str] = _f(None, "PPO: the reward model scoring each response: a stage rm run folder, a sequence-classification model folder, or with reward_model_type api the scoring endpoint's URL (http://host:port).", "method")
    reward_model_type: Literal["lora", "full", "api"] = _f("lora", "PPO: how the reward model is stored: lora (an rm run's adapter with its score head), full (a sequence-classification folder) or api (an OpenAI-compatible scoring endpoint, e.g. tuneboard api --reward-model: POST /v1/score/evaluation).", "method")
    reward_model_api_key_env: Optional[str] = _f(None, "PPO with reward_model_type api: the environment variable that holds the scoring endpoint's API key (sent as Authorization: Bearer); a key is never a spec key.", "method")
    reward_model_api_key_file: Optional[str] = _f(None, "PPO with reward_model_type api: a file whose first line is the scoring endpoint's API key (instead of reward_model_api_key_env).", "method")
    ppo_epochs: int = _f(4, "PPO optimisation epochs per batch.", "method", ge=1)
    ppo_buffer_size: int = _f(1, "Mini-batches in the PPO experience buffer.", "method", ge=1)
    ppo_target: float = _f(6.0, "Target KL for adaptive KL control in PPO.", "method", gt=0)
    ppo_score_norm: bool = _f(False, "Normalise PPO rewards.", "method")
    ppo_whiten_rewards: bool = _f(False, "Whiten PPO rewards before computing advantages.", "method")
    init_kl_coef: float = _f(0.2, "PPO: the starting weight of the per-token KL penalty to the reference model.", "method", ge=0)
    adap_kl_ctrl: bool = _f(True, "PPO: adapt the KL weight towards ppo_target (false: keep init_kl_coef fixed).", "method")
    gamma: float = _f(1.0, "PPO: discount of later token rewards in the advantages (GAE).", "method", ge=0, le=1)
    lam: float = _f(0.95, "PPO: GAE lambda, between bias (0) and variance (1) of the advantages.", "method", ge=0, le=1)
    cliprange: float = _f(0.2, "PPO: clipping range of the policy ratio.", "method", gt=0)
    cliprange_value: float = _f(0.2, "PPO: clipping range of the value head's change per update.", "method", gt=0)
    vf_coef: float = _f(0.1, "PPO: weight of the value loss beside the policy loss.", "method", ge=0)


class OnlineKeys(Keys):
    """grpo and rloo; ppo takes the reward keys, ppo and kd max_completion_length."""

    comma_keys = ("reward_funcs", "reward_weights")
    reward_funcs: Optional[str] = _f(None, "GRPO / RLOO reward functions, comma-separated: json_valid, json_schema, field_f1, exact_match, length_penalty, format_regex, your own module:function / path/to/file.py:function, or a reward model folder (a stage rm run's output_dir).", "method")
    reward_weights: Optional[str] = _f(None, "GRPO: one weight per reward function, comma-separated (default: 1 each).", "method")
    reward_schema: Optional[str] = _f(None, "GRPO json_schema reward: a JSON Schema file (.json) or inline JSON (default: each row's own, inferred from its reference answer).", "method")
    reward_regex: Optional[str] = _f(None, "GRPO format_regex reward: the regular expression a whole completion must match (default: one JSON object).", "method")
    num_generations: int = _f(4, "GRPO: completions sampled per prompt (each is scored against the others of its group).", "method", ge=2)
    max_completion_length: int = _f(128, "GRPO: most tokens generated per completion.", "method", ge=1)
    grpo_beta: float = _f(0.04, "GRPO: KL penalty against the starting model; 0 = no reference model (and no kl curve).", "method", ge=0)
    grpo_epsilon: float = _f(0.2, "GRPO: clipping range of the policy ratio, as in PPO.", "method", gt=0)
    use_vllm: bool = _f(False, "GRPO: generate the completions with vLLM (needs the vllm package and a GPU).", "method")


class KdKeys(Keys):
    teacher_model_name_or_path: Optional[str] = _f(None, "KD: the teacher model whose next-token distributions the student learns (a local folder, .gguf file or cached hub id; same tokenizer as the student).", "method")
    teacher_adapter: Optional[str] = _f(None, "KD: an adapter folder loaded on the teacher model (e.g. an SFT run of it).", "method")
    teacher_quantization_bit: Optional[Literal[4, 8]] = _f(None, "KD: load the teacher in 4 or 8 bits (bitsandbytes) to save memory.", "method")
    kd_beta: float = _f(0.0, "KD: the divergence, a generalized JSD: 0 = forward KL(teacher||student), 1 = reverse KL, 0.5 = JSD.", "method", ge=0, le=1)
    kd_lmbda: float = _f(0.0, "KD: share of steps trained on the student's own completions (on-policy, generated) instead of the dataset's answers.", "method", ge=0, le=1)
    kd_temperature: float = _f(1.0, "KD: softmax temperature of both distributions in the loss (and of the on-policy sampling).", "method", gt=0)
    kd_alpha: float = _f(0.0, "KD: weight of the cross-entropy on the dataset's answers mixed into the loss: (1 - alpha) x divergence + alpha x CE.", "method", ge=0, le=1)


# The stage families' keys, in their order within a group (RunSpec puts each class among its group's keys: one group
# per class); which stages a key applies to is each Stage's `fields` below.
STAGE_KEYS: tuple[type[Keys], ...] = (PreferenceKeys, PpoKeys, OnlineKeys, KdKeys)


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
    Stage("pt", "Pre-training", "text", packs_by_default=True, bf16_by_default=True, zero3_adapter_reentrant=False,
          token_loss=True),
    Stage("sft", "Supervised fine-tuning", "plain", task_metric=True, plots=_TASK_PLOTS, bf16_by_default=True,
          token_loss=True,
          plots_when_logged=tuple(name for name, _ in _TASK_PLOTS), zero3_adapter_reentrant=False),
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
    Stage("ppo", "PPO", "prompts", rules=(rules.ppo,), generates=True, zero3_adapter_reentrant=False,
          fields=("ref_model", "reward_model", "reward_model_type", "reward_model_api_key_env",
                  "reward_model_api_key_file", "reward_funcs", "reward_weights", "reward_schema",
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
        return get_stage(stage_id or DEFAULT_STAGE).data == "ranking"
    except KeyError:
        return False


def zero3_adapter_reentrant(stage_id: str | None) -> bool:
    """Whether the stage's trainer makes an adapter's checkpointing reentrant under DeepSpeed ZeRO-3 (Stage field);
    False for an unknown stage."""
    try:
        return get_stage(stage_id or DEFAULT_STAGE).zero3_adapter_reentrant
    except KeyError:
        return False


def stage_module(stage_id: str):
    """The heavy module that trains this stage (imports torch): backend.stages.<module>."""

    return importlib.import_module(f"backend.stages.{get_stage(stage_id).module}")
