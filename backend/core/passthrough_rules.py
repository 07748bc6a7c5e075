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
"""
from __future__ import annotations

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


def passthrough_errors(spec, defaults: dict[str, dict], gpus: int, processes: int) -> list[tuple[str, str, frozenset]]:
    """(field, message, involved) for the passthrough keys that would stop the run after launch or change nothing.
    defaults: hf_training_args.json's fields (their recorded defaults); gpus: NVIDIA GPUs visible here; processes:
    the run's world size."""
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
    return errors
