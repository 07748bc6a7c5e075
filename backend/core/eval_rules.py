"""The rules of the evaluation keys, beside the spec as each stage's rules are beside its stage: eval_metric
scored at each save and metric_for_best_model (backend/evaluation/task_metric.py), the judge's keys
(backend/evaluation/judge.py), checkpoints= (backend/evaluation/checkpoint_eval.py). backend.core.spec calls them
from its cross-field check; each returns (field, message, the fields involved) as the spec's own rules do."""
from __future__ import annotations

from backend.core import teacher_access
from backend.core.checkpoint_pick import CheckpointChoiceError, pick_for
from backend.core.launch import uses_fsdp, zero_stage
from backend.core.refusals import REFUSED
from backend.stages import get_stage

JUDGE_KEYS = ("judge_url", "judge_model", "judge_api_key_env", "judge_api_key_file", "judge_max_requests",
              "judge_against")


def judge_errors(spec) -> list[tuple[str, str, frozenset]]:
    """do_judge and the judge_* keys (backend/evaluation/judge.py): a judge needs its URL and model; judge keys without
    a judge to use them are refused."""
    errors: list[tuple[str, str, frozenset]] = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field,) + involved)))

    wanted = spec.do_judge or getattr(spec, "eval_metric", None) == "judge"
    if not wanted:
        defaults = {k: type(spec).model_fields[k].default for k in JUDGE_KEYS}
        for key in JUDGE_KEYS:
            if key in spec.model_fields_set and getattr(spec, key) != defaults[key]:
                err(key, "only used by a judge: set do_judge: true (tuneboard eval) or eval_metric: judge", "do_judge")
        return errors
    who = "do_judge" if spec.do_judge else "eval_metric"
    if not spec.judge_url:
        err(who, "needs judge_url: the base URL of an OpenAI-compatible endpoint (e.g. https://api.openai.com/v1)",
            "judge_url")
    elif not spec.judge_url.startswith(("http://", "https://")):
        err("judge_url", "give an http(s):// base URL (e.g. http://127.0.0.1:8000/v1)")
    elif not spec.judge_model:
        err("judge_model", "required with judge_url: the model name the endpoint serves", "judge_url")
    elif teacher_access.restricted():  # a process the web UI started: the endpoints and keys its operator allows
        for refused in teacher_access.check_teacher(spec.judge_url, spec.judge_api_key_env, spec.judge_api_key_file,
                                                    "judge", url_field="judge_url"):
            err(refused.field, refused.english(), "judge_url")
    if spec.do_judge and get_stage(spec.stage).is_reward_model:
        err("do_judge", "a reward model scores answers, it writes none for a judge to compare", "stage")
    elif spec.do_judge and spec.judge_against == "base" and not spec.adapter_name_or_path:
        err("do_judge", "judge_against base compares the tuned model with the base: set adapter_name_or_path (or "
            "judge_against: reference to compare with the rows' answers)", "adapter_name_or_path", "judge_against")
    return errors


def task_metric_errors(spec, has_eval_data: bool, check_files: bool) -> list[tuple[str, str, frozenset]]:
    """eval_metric (scored at each save on held-out rows) and metric_for_best_model."""
    errors: list[tuple[str, str, frozenset]] = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field,) + involved)))

    best, task = spec.metric_for_best_model, spec.eval_metric
    if best is not None and not spec.load_best_model_at_end and spec.save_strategy != "best":
        err("metric_for_best_model", "only used with load_best_model_at_end: true (it names the metric that picks "
            "the best checkpoint) or save_strategy best (it saves when the metric improves)", "load_best_model_at_end",
            "save_strategy")
    elif best is not None and not spec.best_by_task_metric and spec.eval_strategy == "no":
        err("metric_for_best_model", f"{best!r} is never measured: "
            + (f"name the eval_metric ({task}), the one scored at each save, or " if task else "")
            + "set eval_strategy (steps or epoch) for eval_loss and the eval_ metrics", "eval_metric", "eval_strategy")
    if not task:
        if spec.eval_samples != type(spec).model_fields["eval_samples"].default:
            err("eval_samples", f"{REFUSED}: eval_samples is the number of held-out rows eval_metric scores at each "
                "save, and eval_metric is not set: set eval_metric (e.g. json_field_f1), or drop eval_samples",
                "eval_metric")
        return errors
    refusal = get_stage(spec.stage).task_metric_refusal
    if refusal:
        err("eval_metric", f"{REFUSED}: {refusal}", "stage")
        return errors
    if not has_eval_data:
        err("eval_metric", "scores held-out rows at each save: set val_size (e.g. 0.1) or an eval_dataset",
            "val_size", "eval_dataset")
    if spec.save_strategy == "no":
        err("eval_metric", "is scored at each checkpoint save: save_strategy is no (set steps or epoch)",
            "save_strategy")
    if uses_fsdp(spec) or (check_files and zero_stage(spec) == 3):
        err("eval_metric", f"{REFUSED} with sharded weights ({'FSDP' if uses_fsdp(spec) else 'DeepSpeed ZeRO-3'}): "
            "rank 0 generates alone at each save and would need every rank's shard; use DDP or ZeRO-2, or score "
            "the checkpoints afterwards with `tuneboard eval`", "deepspeed", "accelerate_config")
    if task == "eval_loss" and spec.eval_strategy != "no":
        err("eval_metric", "eval_strategy already logs eval_loss (over every held-out row): drop eval_metric "
            "eval_loss, or set eval_strategy no to score eval_samples rows at each save instead", "eval_strategy")
    return errors


def checkpoint_errors(spec, check_files: bool) -> list[tuple[str, str, frozenset]]:
    """checkpoints (tuneboard eval of a training run's checkpoints, backend/evaluation/checkpoint_eval.py): the loss and
    prediction metrics of each adapter of one run folder; the names it gives exist (checkpoint_pick)."""
    if not spec.checkpoints:
        return []
    involved = frozenset({"checkpoints", "adapter_name_or_path", "model_name_or_path", "finetuning_type"})
    tasks = getattr(spec, "tasks", None)  # the lm-eval benchmarks' key (backend/evaluation/benchmarks.py)
    if tasks or spec.do_judge:
        other = "tasks" if tasks else "do_judge"
        return [("checkpoints", f"scores the loss and the predictions of each checkpoint; {other} runs on one adapter: "
                 f"set adapter_name_or_path to one checkpoint-N folder for {other}", involved | {other})]
    if get_stage(spec.stage).is_reward_model:
        return [("checkpoints", "a reward model's checkpoints score pairs: evaluate one at a time (stage rm, "
                 "adapter_name_or_path=<run>/checkpoint-N)", involved | {"stage"})]
    if check_files:
        try:
            pick_for(spec)
        except CheckpointChoiceError as exc:
            return [("checkpoints", str(exc).removeprefix("checkpoints: "), involved)]
    return []


# the keys of a training run `tuneboard eval` never reads, and what it does instead (eval_command_errors)
_WHILE_TRAINING = ("sets when a training run evaluates its held-out rows; `tuneboard eval` evaluates them once, "
                   "when it runs: drop it")
EVAL_IGNORES = {
    "eval_metric": "is the metric a training run scores at each checkpoint save; `tuneboard eval` computes every "
                   "answer metric at once (eval_loss, perplexity, bleu-4, rouge, exact_match, and json_valid / "
                   "json_field_f1 for JSON answers): drop it (for an LLM judge set do_judge=true with judge_url and "
                   "judge_model)",
    "eval_samples": "is the number of held-out rows eval_metric scores at each save of a training run; `tuneboard "
                    "eval` evaluates every held-out row: drop it, or set max_samples to use fewer rows",
    "load_best_model_at_end": "picks a training run's final adapter among its checkpoints; `tuneboard eval` trains "
                              "nothing: drop it (checkpoints=all scores each checkpoint of a run)",
    "metric_for_best_model": "names the metric that picks a training run's best checkpoint; `tuneboard eval` trains "
                             "nothing: drop it (checkpoints=all shows the best checkpoint per metric)",
    "early_stopping_patience": "stops a training run whose evaluations stop improving; `tuneboard eval` trains "
                               "nothing: drop it",
    "eval_strategy": _WHILE_TRAINING,
    "eval_steps": _WHILE_TRAINING,
    **{key: "is a training setting; `tuneboard eval` trains nothing: drop it" for key in (
        "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
        "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "optim",
        "resume_from_checkpoint", "save_strategy", "save_steps", "save_total_limit", "logging_steps", "plot_loss")},
}


def eval_command_errors(given: dict, fields: dict) -> list[tuple[str, str]]:
    """(key, the one line) for each key given on the `tuneboard eval` command line (key=value: `given`, parsed) away
    from its default (`fields`: the spec's model_fields) that eval never reads: the counterpart of
    train_rules.train_command_errors (`tuneboard eval SPEC eval_metric=judge judge_url=...` ran eval and predict, and
    asked no judge). Asked before the spec is validated, so the line says what eval does instead before a training
    rule asks for more training keys. A spec file's keys are not refused: a training recipe serves `tuneboard eval`
    too, and its training keys are its run's."""
    return [(key, EVAL_IGNORES[key]) for key, value in given.items()
            if key in EVAL_IGNORES and value is not None and value != fields[key].default]
