"""TrainingArguments passthrough keys that stopped a run after launch, or changed nothing, are refused by validate
with the key named (backend/core/passthrough_rules.py); where another key makes them work, they pass with it."""
from __future__ import annotations

import pytest

from backend.core.spec import REFUSED, SpecError, validate_spec

# each of these, set alone, stopped a short `tuneboard train` of the default model after launch (2026-12-05)
STOPPED_AFTER_LAUNCH = {
    "torch_compile": True, "torch_compile_backend": "inductor", "torch_compile_mode": "default",
    "use_liger_kernel": True, "tf32": True, "push_to_hub": True, "ddp_backend": "gloo",
    "dataloader_persistent_workers": True, "dataloader_prefetch_factor": 2, "dataloader_multiprocessing_context": "spawn",
    "debug": "underflow_overflow", "parallelism_config": {"dp_shard_size": 1}, "bf16_full_eval": True,
}
# and these ran, changing nothing
CHANGED_NOTHING = {
    "liger_kernel_config": {"rope": True}, "remove_unused_columns": False, "hub_model_id": "me/x",
    "hub_strategy": "end", "project": "p", "trackio_space_id": "a/b", "local_rank": 0,
    "optim_target_modules": ["q_proj"], "ddp_static_graph": True, "ddp_find_unused_parameters": True,
    "eval_on_start": True, "prediction_loss_only": True, "fp16_full_eval": True, "eval_accumulation_steps": 2,
    "length_column_name": "len", "log_on_each_node": False, "log_level_replica": "info", "save_on_each_node": True,
}


def _errors(**keys) -> dict[str, str]:
    try:
        validate_spec(keys, check_files=False)
    except SpecError as exc:
        return dict(exc.errors)
    return {}


@pytest.mark.parametrize("key,value", [*STOPPED_AFTER_LAUNCH.items(), *CHANGED_NOTHING.items()])
def test_refused_naming_the_key(key, value):
    message = _errors(**{key: value}).get(key)
    assert message and message.startswith(REFUSED), (key, message)


def test_what_makes_them_work_lets_them_pass():
    assert not _errors(ddp_backend="gloo", ddp_static_graph=True, nproc_per_node=2)  # several processes
    assert "ddp_backend" in _errors(ddp_backend="nccl", nproc_per_node=2)  # no GPU here: gloo only
    assert not _errors(dataloader_num_workers=2, dataloader_prefetch_factor=2, dataloader_persistent_workers=True)
    evaluating = {"val_size": 0.1, "eval_strategy": "steps", "eval_steps": 5}
    assert not _errors(**evaluating, eval_on_start=True, prediction_loss_only=True, eval_accumulation_steps=2)
    assert not _errors(hub_strategy="every_save", tf32=None)  # their defaults: nothing set


def test_label_smoothing_only_where_the_loss_is_the_token_cross_entropy():
    assert not _errors(label_smoothing_factor=0.1)  # sft
    assert not _errors(stage="pt", label_smoothing_factor=0.1)
    assert "dpo_label_smoothing" in _errors(stage="dpo", label_smoothing_factor=0.1)["label_smoothing_factor"]
    assert _errors(stage="kto", label_smoothing_factor=0.1)["label_smoothing_factor"].startswith(REFUSED)


def test_group_by_length_only_for_rows_of_one_input_ids():
    assert not _errors(train_sampling_strategy="group_by_length")  # sft
    assert "dpo" in _errors(stage="dpo", train_sampling_strategy="group_by_length")["train_sampling_strategy"]
    assert not _errors(stage="dpo", train_sampling_strategy="sequential")
