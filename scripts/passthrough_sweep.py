"""Set TrainingArguments passthrough keys (or the train group's keys, or every optimizer) one at a time in a short
`tuneboard train` and say what each did.

Why: a passthrough key that `validate` accepts reaches transformers as written, and that alone does not make it
work here (torch_compile, push_to_hub, tf32 on a CPU, ... stopped runs after launch; others changed nothing).
backend/core/passthrough_rules.py refuses what this sweep found; rerun it after a transformers upgrade (a new
key in backend/core/hf_training_args.json) or a change to the training path. One JSON line per key: refused by
validate (with the message), or the run's exit code and its FAILED line. A run that passes may still change
nothing: that part is read, not run.

--train runs TRAIN_CASES instead (the train group's keys with the keys beside them; backend/core/train_rules.py
refuses what it found), --optim every optimizer name transformers knows (backend/core/optim_names.py).

Usage:  .venv/bin/python scripts/passthrough_sweep.py [--stage sft|pt|dpo|kto|rm] [--model DIR] [--train | --optim]
        [KEY ...]   (default: every passthrough key below, stage sft, the bundled default model; ~10 s a run)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.core.passthrough_rules import EVAL_LOOP_KEYS  # noqa: E402
from backend.core.spec import SpecError, training_args_fields, validate_spec  # noqa: E402

DATASETS = {"sft": "alpaca_en_demo", "pt": "c4_demo", "dpo": "dpo_en_demo", "kto": "kto_en_demo", "rm": "dpo_en_demo"}
EVALUATING = {"val_size": 0.25, "eval_strategy": "steps", "eval_steps": 1}
# key -> a value other than transformers' default (a key of the evaluation loop also gets EVALUATING)
VALUES = {
    "torch_compile": True, "torch_compile_backend": "inductor", "torch_compile_mode": "default",
    "use_liger_kernel": True, "liger_kernel_config": {"rope": True}, "tf32": True, "push_to_hub": True,
    "hub_model_id": "me/x", "ddp_backend": "gloo", "ddp_find_unused_parameters": True, "ddp_static_graph": True,
    "dataloader_num_workers": 2, "dataloader_persistent_workers": True, "dataloader_prefetch_factor": 2,
    "dataloader_multiprocessing_context": "spawn", "dataloader_drop_last": True, "dataloader_pin_memory": False,
    "dataloader_in_order": False, "train_sampling_strategy": "group_by_length", "length_column_name": "len",
    "remove_unused_columns": False, "label_names": ["labels"], "debug": "underflow_overflow",
    "parallelism_config": {"dp_shard_size": 1}, "accelerator_config": {"split_batches": True}, "local_rank": 0,
    "lr_scheduler_kwargs": {"num_cycles": 2}, "optim_args": "foo=1", "optim_target_modules": ["q_proj"],
    "adam_beta1": 0.8, "label_smoothing_factor": 0.1, "average_tokens_across_devices": False,
    "activation_checkpointing_kwargs": {"use_reentrant": True}, "neftune_noise_alpha": 5, "use_cache": True,
    "torch_empty_cache_steps": 1, "auto_find_batch_size": True, "include_num_input_tokens_seen": "all",
    "logging_strategy": "epoch", "logging_first_step": True, "log_level": "debug", "log_on_each_node": False,
    "log_level_replica": "info", "save_on_each_node": True, "project": "p", "save_only_model": True,
    "full_determinism": True, "data_seed": 1, "use_cpu": True, "enable_jit_checkpoint": True,
    "bf16_full_eval": True, "fp16_full_eval": True, "eval_delay": 1, "prediction_loss_only": True, "eval_on_start": True,
    "eval_accumulation_steps": 2, "eval_do_concat_batches": False, "eval_use_gather_object": True,
    "include_for_metrics": ["inputs"], "batch_eval_metrics": True, "greater_is_better": True,
}
# (key, value, the keys set beside it): schedules, saves, evaluations (run with validate's rules in place, a refused
# case prints its message; at a commit before a rule, the run shows what it did)
TRAIN_CASES = [
    ("lr_scheduler_type", "cosine_with_restarts", {}), ("lr_scheduler_type", "polynomial", {}),
    ("lr_scheduler_type", "inverse_sqrt", {}), ("lr_scheduler_type", "cosine_with_min_lr", {}),
    ("lr_scheduler_type", "cosine_with_min_lr", {"lr_scheduler_kwargs": {"min_lr_rate": 0.5}}),
    ("lr_scheduler_type", "warmup_stable_decay", {}),
    ("lr_scheduler_type", "warmup_stable_decay", {"lr_scheduler_kwargs": {"num_decay_steps": 1}}),
    ("lr_scheduler_type", "reduce_lr_on_plateau", {}), ("lr_scheduler_type", "reduce_lr_on_plateau", EVALUATING),
    ("warmup_ratio", 0.5, {"warmup_steps": 1}), ("warmup_ratio", 0.5, {"lr_scheduler_type": "constant"}),
    ("save_steps", 1, {"save_strategy": "no"}), ("save_total_limit", 1, {"save_strategy": "no"}),
    ("save_strategy", "best", {}), ("save_strategy", "best", {**EVALUATING, "metric_for_best_model": "eval_loss"}),
    ("eval_steps", 1, {"val_size": 0.25}), ("resume_from_checkpoint", True, {}),
    ("fp16", True, {}), ("pure_bf16", True, {}), ("max_grad_norm", 0.0, {}), ("ddp_timeout", 60, {}),
]
# keys tried in an evaluating run: the evaluation loop's (passthrough_rules.EVAL_LOOP_KEYS) and three more that only an
# evaluation reads
EVAL_LOOP = set(EVAL_LOOP_KEYS) | {"bf16_full_eval", "fp16_full_eval", "greater_is_better"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", default="sft", choices=sorted(DATASETS))
    ap.add_argument("--model", help="model folder (default: the bundled default model)")
    ap.add_argument("--out", default="/tmp/tb-passthrough-sweep", help="where the runs' folders go")
    ap.add_argument("--train", action="store_true", help="the train group's cases (TRAIN_CASES)")
    ap.add_argument("--optim", action="store_true", help="every optimizer name transformers knows")
    ap.add_argument("keys", nargs="*", help="only these keys (with --optim: these optimizer names)")
    args = ap.parse_args()
    base = {"stage": args.stage, "dataset": DATASETS[args.stage], "template": "default", "finetuning_type": "lora",
            "max_samples": 16, "cutoff_len": 128, "per_device_train_batch_size": 2, "max_steps": 2,
            "save_strategy": "no", "report_to": "none", "logging_steps": 1, "overwrite_output_dir": True}
    if args.model:
        base["model_name_or_path"] = args.model
    if args.train:
        cases = TRAIN_CASES
    elif args.optim:
        cases = [("optim", name, {}) for name in training_args_fields()["optim"]["choices"]]
    else:
        cases = [(key, value, EVALUATING if key in EVAL_LOOP else {}) for key, value in VALUES.items()]
    for n, (key, value, beside) in enumerate(cases):
        if args.keys and key not in args.keys and value not in args.keys:
            continue
        spec = {**base, **beside, key: value, "output_dir": f"{args.out}/{args.stage}-{key}-{n}"}
        try:
            validate_spec(spec)
        except SpecError as exc:
            print(json.dumps({"key": key, "value": value, "beside": beside,
                              "refused": [m for f, m in exc.errors if f == key] or
                              [f"{f}: {m}" for f, m in exc.errors]}), flush=True)
            continue
        argv = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in spec.items()]
        done = subprocess.run([sys.executable, "-m", "backend.cli", "train", *argv], capture_output=True, text=True,
                              cwd=ROOT)
        failed = [line for line in (done.stdout + done.stderr).splitlines() if "FAILED" in line][-1:]
        lr = [line.split("lr=")[1].split()[0] for line in done.stdout.splitlines() if " lr=" in line]
        saved = sorted(p.name for p in Path(spec["output_dir"]).glob("checkpoint-*"))
        print(json.dumps({"key": key, "value": value, "beside": beside, "exit": done.returncode, "failed": failed,
                          "lr": lr, "checkpoints": saved}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
