"""The train group's keys that another key makes inert, refused by `validate` (spec._refusals) with the key that
wins and what to do instead: each was set beside its winner in a short `tuneboard train` (2026-12-05) and the run
was the same as without it.

- warmup_ratio with warmup_steps above 0: the steps win (transformers: warmup_steps overrides the ratio).
- warmup (either key) with lr_scheduler_type constant or reduce_lr_on_plateau: those schedules have no warmup
  (transformers' get_scheduler builds them without the warmup steps): constant_with_warmup is the one that warms up.
- save_steps with save_strategy no / epoch / best, save_total_limit with save_strategy no: no step-wise saves, no
  checkpoints to rotate.
- eval_steps with eval_strategy no / epoch: no step-wise evaluation.
Only a value set away from its default is refused: a recipe that leaves the key alone is not. And one that stopped
the run after launch: reduce_lr_on_plateau in a run that never evaluates (transformers: "requires an eval
strategy"), cosine_with_min_lr / warmup_stable_decay without the lr_scheduler_kwargs they need, save_strategy best
without an evaluation that measures metric_for_best_model. Light."""
from __future__ import annotations

from backend.core.passthrough_rules import as_mapping
from backend.core.refusals import REFUSED

NO_WARMUP = ("constant", "reduce_lr_on_plateau")
# schedules transformers builds only with these lr_scheduler_kwargs (any one of each tuple), else the run stops
# after launch ("One of min_lr or min_lr_rate should be set", "get_wsd_schedule() missing ... 'num_decay_steps'")
NEEDS_KWARGS = {"cosine_with_min_lr": ("min_lr", "min_lr_rate"), "cosine_warmup_with_min_lr": ("min_lr", "min_lr_rate"),
                "warmup_stable_decay": ("num_decay_steps",)}

# the lr_scheduler_kwargs each schedule takes (transformers' get_scheduler passes them to its schedule function;
# reduce_lr_on_plateau's to torch's ReduceLROnPlateau; constant and constant_with_warmup are built without any):
# another key stopped the run after launch ("got an unexpected keyword argument"). tests/backend/test_train_rules.py
# holds this table to the installed functions' signatures.
SCHEDULER_KWARGS = {
    "linear": ("last_epoch",), "cosine": ("num_cycles", "last_epoch"),
    "cosine_with_restarts": ("num_cycles", "last_epoch"), "polynomial": ("lr_end", "power", "last_epoch"),
    "constant": (), "constant_with_warmup": (), "inverse_sqrt": ("timescale", "last_epoch"),
    "reduce_lr_on_plateau": ("mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps"),
    "cosine_with_min_lr": ("num_cycles", "last_epoch", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "last_epoch", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": ("num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio",
                            "num_cycles", "last_epoch"),
}


def train_errors(spec) -> list[tuple[str, str, tuple[str, ...]]]:
    """(key, the one line: why it would change nothing or cannot run, and what to do instead; the keys involved)."""
    fields = type(spec).model_fields
    given = {name for name in ("warmup_ratio", "warmup_steps", "save_steps", "save_total_limit", "eval_steps")
             if getattr(spec, name) != fields[name].default}
    errors = []
    if "warmup_ratio" in given and spec.warmup_steps > 0:
        errors.append(("warmup_ratio", f"{REFUSED}: warmup_steps {spec.warmup_steps} sets the warmup and overrides "
                       "the ratio: drop warmup_ratio, or set warmup_steps to 0 to warm up over a share of the steps",
                       ("warmup_steps",)))
    if spec.lr_scheduler_type == "reduce_lr_on_plateau" and spec.eval_strategy == "no":
        errors.append(("lr_scheduler_type", "reduce_lr_on_plateau lowers the rate when the evaluation loss stops "
                       "improving, and this run never evaluates while it trains: set eval_strategy (steps or epoch) "
                       "with val_size or an eval_dataset, or pick another schedule", ("eval_strategy",)))
    needed = NEEDS_KWARGS.get(spec.lr_scheduler_type)
    kwargs = (getattr(spec, "passthrough", None) or {}).get("lr_scheduler_kwargs") or {}
    takes = SCHEDULER_KWARGS.get(spec.lr_scheduler_type)
    try:
        kwargs = as_mapping(kwargs)  # a JSON object string: TrainingArguments parses it
    except ValueError as exc:
        errors.append(("lr_scheduler_kwargs", str(exc), ("lr_scheduler_type",)))
        kwargs = {}
    if not isinstance(kwargs, dict):
        errors.append(("lr_scheduler_kwargs", f"a mapping of the schedule's own arguments, e.g. {{\"num_cycles\": "
                       f"0.5}} (got {str(kwargs)[:80]!r})", ("lr_scheduler_type",)))
        kwargs = {}
    elif takes is not None and set(kwargs) - set(takes):
        unknown = ", ".join(sorted(set(kwargs) - set(takes)))
        errors.append(("lr_scheduler_kwargs", f"{spec.lr_scheduler_type} takes no {unknown}" +
                       (f" (it takes {', '.join(takes)})" if takes else " (it takes no arguments)"),
                       ("lr_scheduler_type",)))
    if needed and not (isinstance(kwargs, dict) and any(k in kwargs for k in needed)):
        example = {"min_lr": '{"min_lr_rate": 0.1}', "num_decay_steps": '{"num_decay_steps": 100}'}[needed[0]]
        errors.append(("lr_scheduler_type", f"{spec.lr_scheduler_type} needs {' or '.join(needed)} in "
                       f"lr_scheduler_kwargs (e.g. lr_scheduler_kwargs: {example}), or pick another schedule",
                       ("lr_scheduler_kwargs",)))
    if spec.save_strategy == "best" and (not spec.metric_for_best_model or spec.eval_strategy == "no"
                                         or spec.best_by_task_metric):
        errors.append(("save_strategy", "best saves a checkpoint each time an evaluation beats the best "
                       "metric_for_best_model so far: set metric_for_best_model (eval_loss, or an eval_ metric) and "
                       "eval_strategy (steps or epoch) with val_size or an eval_dataset, or use save_strategy steps",
                       ("metric_for_best_model", "eval_strategy")))
    if spec.lr_scheduler_type in NO_WARMUP:
        for key in ("warmup_ratio", "warmup_steps"):
            if key in given:
                errors.append((key, f"{REFUSED}: lr_scheduler_type {spec.lr_scheduler_type} has no warmup: use "
                               "constant_with_warmup (or another schedule that warms up), or drop " + key,
                               ("lr_scheduler_type",)))
    if "save_steps" in given and spec.save_strategy != "steps":
        errors.append(("save_steps", f"{REFUSED}: save_strategy {spec.save_strategy} does not save every N steps: "
                       "set save_strategy steps, or drop save_steps", ("save_strategy",)))
    if "save_total_limit" in given and spec.save_strategy == "no":
        errors.append(("save_total_limit", f"{REFUSED}: save_strategy no saves no checkpoints to keep or delete: "
                       "set save_strategy steps (or epoch), or drop save_total_limit", ("save_strategy",)))
    if "eval_steps" in given and spec.eval_strategy != "steps":
        errors.append(("eval_steps", f"{REFUSED}: eval_strategy {spec.eval_strategy} does not evaluate every N "
                       "steps: set eval_strategy steps, or drop eval_steps", ("eval_strategy",)))
    return errors


def train_command_errors(spec) -> list[tuple[str, str]]:
    """(key, the one line) for what `tuneboard train` cannot do with a spec `validate` accepts for the other commands
    (the same spec file serves eval, chat and export): the eval-only parts, and no dataset at all (`dataset:` left
    empty stopped the run after launch with "'NoneType' object is not iterable"). Asked by the train command, the
    Train tab's Start and distill's step train before anything starts."""
    errors = []
    if spec.do_judge:
        errors.append(("do_judge", "the judge runs in `tuneboard eval` (this spec with do_judge: true); during "
                                   "training use eval_metric: judge"))
    if spec.checkpoints:
        errors.append(("checkpoints", "it evaluates a finished run's checkpoints in `tuneboard eval` (this spec with "
                                      "adapter_name_or_path = the run folder); during training use eval_metric"))
    if spec.tasks:
        errors.append(("tasks", "lm-eval benchmarks run in `tuneboard eval` (this spec with tasks, on the trained "
                                "adapter)"))
    if not spec.dataset_names:
        errors.append(("dataset", "empty: name the registered dataset(s) to train on (comma-separated), e.g. "
                                  "identity"))
    return errors

