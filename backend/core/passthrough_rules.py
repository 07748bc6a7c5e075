"""Validate rules of the TrainingArguments passthrough keys (light: no torch; backend.core.spec calls this).

A passthrough key reaches transformers' TrainingArguments as written, and that alone does not make it work here:
each key below was set in a short `tuneboard train` of the default model (SFT and DPO, 2026-12-05) and either
stopped the run after launch (torch_compile and its backend / mode: selective checkpointing untraceable, and with
plain checkpointing inductor's kernel failed in bf16 and ran slower than eager in fp32; push_to_hub: the hub is
offline; tf32 without an NVIDIA GPU; ddp_backend without a process group; the data loader's worker options without
workers; debug underflow_overflow; parallelism_config, which wants an accelerate object; use_liger_kernel without
liger-kernel; bf16_full_eval in a fp32 DPO run; group_by_length with pairs) or changed nothing (the hub options without pushing, trackio's
options, which report_to does not offer, the evaluation loop's options in a run that never evaluates, the DDP and
replica options of a one-process run, label smoothing in a stage whose loss is not the token cross-entropy,
remove_unused_columns, which TuneBoard always sets). validate refuses them with the reason and what to do instead.

And the values transformers reads only once the run has started, each passed validate and then stopped a short run of
the default model (2026-12-07, a CLI bug hunt): optim_args that is not key=value pairs (split when the optimizer is
created), accelerator_config naming a missing file, a checkpoint kwargs string that is not a JSON object; also
refused: a key or value the optimizer, accelerate or torch's checkpoint does not take, and optim_args where the
optimizer reads none (sgd given foo=1 trained as if it were not there). A mapping written as a JSON object string
works where TrainingArguments parses one (`as_mapping`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.core.refusals import REFUSED
from backend.stages import get_stage, stages_where, stages_with_data

HUB_KEYS = ("push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo", "hub_always_push", "hub_revision")
TRACKIO_KEYS = ("project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")
EVAL_LOOP_KEYS = ("eval_delay", "prediction_loss_only", "eval_accumulation_steps", "eval_do_concat_batches",
                  "eval_on_start", "batch_eval_metrics", "eval_use_gather_object", "include_for_metrics")
DDP_KEYS = ("ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
            "ddp_static_graph")
REPLICA_KEYS = ("log_on_each_node", "log_level_replica", "save_on_each_node")  # the other processes' logs and saves
WORKER_KEYS = ("dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context")
ROWS_WITH_IDS = ("plain", "text")  # the stages' data kinds whose rows are one input_ids each
COMPILE_KEYS = ("torch_compile", "torch_compile_backend", "torch_compile_mode")

# key -> why it is refused whatever else the spec says
ALWAYS = {
    "use_liger_kernel": "TuneBoard patches Liger's kernels itself with LLaMA-Factory's key, which falls back to plain "
                        "ops with a warning where liger-kernel or a GPU is missing: set enable_liger_kernel: true",
    "liger_kernel_config": "Liger's kernels are chosen by TuneBoard (RMSNorm, RoPE, SwiGLU and the fused loss, where the "
                           "model has them): set enable_liger_kernel: true",
    "remove_unused_columns": "TuneBoard's rows carry exactly the columns its collators read, so it always runs with "
                             "remove_unused_columns false: drop the key",
    "parallelism_config": "it takes accelerate's ParallelismConfig object, which a YAML spec cannot hold, and its "
                          "tensor / context parallelism needs GPUs: for several processes set nproc_per_node (with "
                          "deepspeed for sharding)",
    "debug": "its underflow_overflow hooks stop on the empty logits the model's head gives while TuneBoard computes "
             "the loss from the hidden states in chunks, and tpu_metrics_debug needs a TPU: watch grad_norm and the "
             "loss in the run log instead (logging_nan_inf_filter decides whether nan/inf losses are logged)",
    **{key: "TuneBoard's training step is not compiled: with its selective checkpointing torch.compile stopped at "
            "the first step (dynamo does not trace the checkpoint contexts); with plain checkpointing inductor's "
            "generated kernel stopped with an index out of bounds in bf16, and in fp32 the bench recipe's first 6 "
            "steps ran at 81 useful tokens/s against ~200 eager (its batches change length every step). Drop the key"
       for key in COMPILE_KEYS},
    **{key: f"transformers applies {key} (casting the model's weights) only to evaluations outside train(), so in "
            "a training run it would touch the final evaluation at most, and it stopped a DPO run on a CPU: "
            "evaluations run in the training precision here; set bf16 to train and evaluate in bf16" for key in
       ("bf16_full_eval", "fp16_full_eval")},
    "length_column_name": "TuneBoard's rows have no length column: train_sampling_strategy group_by_length measures "
                          "each row's input_ids: drop the key",
    "local_rank": "the launcher gives each process its rank (nproc_per_node, nnodes, node_rank): drop the key",
    "optim_target_modules": "the modules of GaLore come from galore_target (with use_galore: true, LLaMA-Factory's "
                            "keys): set those instead",
}

# key -> (the values that work, said as a range): torch's optimizers and data loader refuse the others after launch
RANGES = {
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_epsilon": (lambda v: v >= 0, ">= 0"),
    "neftune_noise_alpha": (lambda v: v > 0, "> 0 (leave it out for no noise)"),
    "dataloader_num_workers": (lambda v: v >= 0, ">= 0"),
}


# optim -> {optim_args key: what its value must be} for transformers' optimizers that read optim_args (the handlers of
# transformers/trainer_optimizer.py convert each value with float / int / strtobool when the optimizer is created, so
# "momentum=x" stopped the run there, and drop the keys they do not read); every other optimizer reads none.
# tests/backend/test_passthrough_rules.py holds this table to the installed handlers.
_ADEMAMIX = {"beta1": "number", "beta2": "number", "beta3": "number", "alpha": "number", "eps": "number",
             "t_alpha": "integer", "t_beta3": "integer"}
_SCHEDULE_FREE = {"weight_lr_power": "number", "r": "number"}
OPTIM_ARGS = {
    "sgd": {"momentum": "number", "dampening": "number", "weight_decay": "number", "nesterov": "switch"},
    "adagrad": {"lr_decay": "number", "weight_decay": "number", "eps": "number"},
    "rmsprop": {"momentum": "number", "alpha": "number", "eps": "number", "weight_decay": "number",
                "centered": "switch"},
    **{name: _ADEMAMIX for name in ("ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit")},
    "adamw_anyprecision": {"use_kahan_summation": "switch", "momentum_dtype": "text", "variance_dtype": "text",
                           "compensation_buffer_dtype": "text"},
    # block_size is handed on as the text written, not a number: only the switch is offered
    **{name: {"bf16_stochastic_round": "switch"} for name in ("adamw_torch_4bit", "adamw_torch_8bit")},
    "grokadamw": {"alpha_init": "number", "lamb": "number", "gamma": "number", "grokking_signal_decay_rate": "number",
                  "gradient_clipping": "number"},
    **{name: _SCHEDULE_FREE for name in ("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd")},
    **{name: {"rank": "integer", "proj": "text", "scale_type": "text", "update_proj_gap": "integer",
              "scale": "number", "proj_type": "text"} for name in ("apollo_adamw", "apollo_adamw_layerwise")},
    "stable_adamw": {"max_lr": "number", "kahan_sum": "text", "decouple_lr": "text"},
}
# bitsandbytes' RMSprop gets every optim_args value as the text written: its first step stopped ("'<=' not supported
# between instances of 'float' and 'str'")
OPTIM_ARGS_AS_TEXT = ("rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")
# the words every handler reads alike (strtobool takes y / on too, sgd and rmsprop read anything but true / 1 / yes as
# false)
SWITCH_WORDS = ("true", "false", "yes", "no", "1", "0")

CHECKPOINT_KWARGS_KEYS = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
# what those take: torch.utils.checkpoint.checkpoint's arguments (context_fn, a callable, cannot be written in YAML)
# and the two the Trainer takes out first; another key stopped the run at the first step ("Unexpected keyword
# arguments: foo"). Held to the installed torch and transformers by tests/backend/test_passthrough_rules.py.
CHECKPOINT_KWARGS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop",
                     "every_n_layers", "offload")
# accelerator_config's keys (transformers' AcceleratorConfig fields; another stopped the run after launch)
ACCELERATOR_CONFIG = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking",
                      "gradient_accumulation_kwargs", "use_configured_state")


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def as_mapping(value: Any) -> Any:
    """A mapping key's value (accelerator_config, lr_scheduler_kwargs, the checkpoint kwargs) as TrainingArguments
    will hold it: a string that starts with "{" parsed as JSON, as its __post_init__ does (ValueError when it is not
    JSON, which stopped the run there), anything else as given."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not a JSON object: {exc} (got {_cut(value)})") from None
    return value


def optim_args_problem(optim: str, optim_args: str, use_galore: bool) -> tuple[str | None, str | None]:
    """(refusal, mistake): why optim_args changes nothing in this run (the refusal), or what is wrong with the value
    that the optimizer would stop on; (None, None) when it works."""
    if use_galore:
        return ("use_galore builds GaLore's optimizer with its own optim_args from galore_rank, "
                "galore_update_interval and galore_scale: set those instead"), None
    if optim in OPTIM_ARGS_AS_TEXT:
        return (f"optim {optim} hands every optim_args value to bitsandbytes as text, and its first step stopped on "
                "it: drop the key (or use optim rmsprop, which takes momentum, alpha, eps, weight_decay, "
                "centered)"), None
    takes = OPTIM_ARGS.get(optim)
    if not takes:
        return (f"optim {optim} reads no optim_args: drop the key, or pick an optimizer that reads it (sgd, adagrad, "
                "rmsprop, ademamix, ...)"), None
    pairs = [pair.split("=") for pair in optim_args.replace(" ", "").split(",")]
    if any(len(pair) != 2 for pair in pairs):
        return None, (f"comma-separated key=value pairs, e.g. {next(iter(takes))}=... (got {_cut(optim_args)}; "
                      f"optim {optim} takes {', '.join(takes)})")
    unknown = [key for key, _ in pairs if key not in takes]
    if unknown:
        return None, f"optim {optim} takes no {', '.join(map(repr, unknown))} (it takes {', '.join(takes)})"
    for key, value in pairs:
        kind = takes[key]
        if kind == "number" and not _parses(float, value) or kind == "integer" and not _parses(int, value):
            return None, f"{key} must be a{'n' if kind == 'integer' else ''} {kind} (got {value!r})"
        if kind == "switch" and value.lower() not in SWITCH_WORDS:
            return None, f"{key} must be true or false (got {value!r})"
    return None, None


def _parses(kind: type, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def accelerator_config_problem(value: Any, check_files: bool = True) -> str | None:
    """What is wrong with accelerator_config (a mapping of AcceleratorConfig's fields, the same as a JSON object
    string, or the path of a JSON file holding one, read from the folder the run starts in), or None."""
    where = ""
    if isinstance(value, str) and not value.startswith("{"):
        if not check_files:
            return None
        path = Path(value)
        if not path.is_file():
            return (f"{'is a folder' if path.is_dir() else 'file not found'}: {value} (a JSON file of accelerate's "
                    f"settings, a mapping of them, or leave the key out)")
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            return f"cannot read {path}: {exc}"
        except ValueError as exc:
            return f"{path} is not valid JSON: {exc}"
        where = f"{path}: "
    else:
        try:
            value = as_mapping(value)
        except ValueError as exc:
            return str(exc)
    return _mapping_problem(value, ACCELERATOR_CONFIG, f"a mapping of accelerate's settings "
                            f"({', '.join(ACCELERATOR_CONFIG)}), the same as a JSON object, or the path of a JSON file "
                            "holding one", "no setting", where)


def checkpoint_kwargs_problem(value: Any) -> str | None:
    """What is wrong with activation_checkpointing_kwargs / gradient_checkpointing_kwargs, or None."""
    try:
        value = as_mapping(value)
    except ValueError as exc:
        return str(exc)
    return _mapping_problem(value, CHECKPOINT_KWARGS, "a mapping of torch.utils.checkpoint's arguments, e.g. "
                            "{\"use_reentrant\": false}", "takes no")


def _mapping_problem(value: Any, takes: tuple[str, ...], wanted: str, unknown_words: str,
                     where: str = "") -> str | None:
    """Why `value` is not a mapping of some of the keys `takes` (`wanted` says what it should be), or None."""
    if not isinstance(value, dict):
        return f"{where}{wanted} (got {_cut(value)})"
    unknown = [key for key in value if key not in takes]
    if unknown:
        return f"{where}{unknown_words} {', '.join(map(repr, unknown))} (it takes {', '.join(takes)})"
    return None


def passthrough_errors(spec, defaults: dict[str, dict], gpus: int, processes: int,
                       check_files: bool = True) -> list[tuple[str, str, frozenset]]:
    """(field, message, involved) for the passthrough keys that would stop the run after launch or change nothing.
    defaults: hf_training_args.json's fields (their recorded defaults); gpus: NVIDIA GPUs visible here; processes:
    the run's world size; check_files: read the file accelerator_config names."""
    errors: list[tuple[str, str, frozenset]] = []
    given = {k: v for k, v in (spec.passthrough or {}).items() if v != (defaults.get(k) or {}).get("default")}

    def refuse(field: str, reason: str, *involved: str) -> None:
        errors.append((field, f"{REFUSED}: {reason}", frozenset((field,) + involved)))

    for key, reason in ALWAYS.items():
        if key in given:
            refuse(key, reason)
    for key, (works, text) in RANGES.items():
        value = given.get(key)
        if value is not None and not works(value):
            errors.append((key, f"must be {text} (got {value})", frozenset((key,))))
    for key in HUB_KEYS:
        if key in given:
            refuse(key, "pushing to the Hugging Face Hub is not available here (no network): upload output_dir "
                   "yourself (`hf upload`)" + ("" if key == "push_to_hub" else f"; {key} only shapes that push"))
    for key in TRACKIO_KEYS:
        if key in given:
            refuse(key, f"{key} configures the trackio tracker, which report_to does not offer: use tensorboard, "
                   "wandb, mlflow or swanlab (their own environment variables name the project)", "report_to")
    if "tf32" in given and not gpus:
        refuse("tf32", "TF32 is a mode of NVIDIA (Ampere or newer) GPUs' fp32 matrix products, and no GPU is visible "
               "here: drop the key (bf16 is the faster precision on a CPU that has it)")
    if processes <= 1:
        for key in DDP_KEYS:
            if key in given:
                refuse(key, f"{key} sets up DistributedDataParallel, and this run is one process: set "
                       "nproc_per_node (or nnodes) for several, or drop the key", "nproc_per_node", "nnodes")
        for key in REPLICA_KEYS:
            if key in given:
                refuse(key, f"{key} is about the run's other processes, and this run is one process: set "
                       "nproc_per_node (or nnodes) for several, or drop the key", "nproc_per_node", "nnodes")
    elif given.get("ddp_backend") not in (None, "gloo") and not gpus:
        refuse("ddp_backend", f"{given['ddp_backend']} is not a backend for CPUs (nccl needs NVIDIA GPUs, ccl Intel's "
               "oneCCL, hccl / xccl their own accelerators): processes on CPUs talk over gloo, which TuneBoard picks "
               "itself: drop the key", "nproc_per_node")
    if not spec.passthrough.get("dataloader_num_workers"):
        for key in WORKER_KEYS:
            if key in given:
                refuse(key, f"{key} shapes the data loader's worker processes, and dataloader_num_workers is 0 (the "
                       "rows are collated in the training process): set dataloader_num_workers too, or drop the key",
                       "dataloader_num_workers")
    if spec.eval_strategy == "no" and not (spec.do_eval or spec.do_predict):
        for key in EVAL_LOOP_KEYS:
            if key in given:
                refuse(key, f"{key} shapes the evaluations of eval_strategy, and this run never evaluates: set "
                       "eval_strategy (steps or epoch) with val_size or eval_dataset, or drop the key",
                       "eval_strategy")
    if given.get("train_sampling_strategy") == "group_by_length" and get_stage(spec.stage).data not in ROWS_WITH_IDS:
        refuse("train_sampling_strategy", f"group_by_length measures each row's input_ids, which the rows of stage "
               f"{', '.join(s for kind in ROWS_WITH_IDS for s in stages_with_data(kind))} have, and stage {spec.stage}'s "
               f"({get_stage(spec.stage).data} data) do not (it stopped a DPO run): use random or sequential", "stage")
    if "label_smoothing_factor" in given and not get_stage(spec.stage).token_loss:
        refuse("label_smoothing_factor", f"it smooths the cross-entropy over answer tokens of stage "
               f"{', '.join(stages_where('token_loss'))}, and stage {spec.stage} trains another loss" +
               (" (dpo_label_smoothing smooths DPO's preference labels)" if get_stage(spec.stage).module == "dpo"
                else ""), "stage")
    if given.get("optim_args"):
        refusal, mistake = optim_args_problem(spec.optim, given["optim_args"], spec.use_galore)
        if refusal:
            refuse("optim_args", refusal, "optim", "use_galore")
        elif mistake:
            errors.append(("optim_args", mistake, frozenset(("optim_args", "optim"))))
    if given.get("accelerator_config") is not None:
        problem = accelerator_config_problem(given["accelerator_config"], check_files)
        if problem:
            errors.append(("accelerator_config", problem, frozenset(("accelerator_config",))))
    for key in CHECKPOINT_KWARGS_KEYS:
        if given.get(key) is not None:
            problem = checkpoint_kwargs_problem(given[key])
            if problem:
                errors.append((key, problem, frozenset((key,))))
    return errors
