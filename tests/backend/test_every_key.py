"""Every key either works or is refused: no RunSpec field, and no TrainingArguments passthrough key, is accepted
and then ignored (the user would believe a setting that is not there).

A field passes when one of these holds:
1. it is refused by validate when set to a value other than its default (the message starts "not supported"),
2. set to another value, it changes the TrainingArguments the Trainer is built with (backend.stages.base.
   training_arguments): transformers consumes it,
3. it is in CONSUMED, which names the test that shows its effect; that test must exist (checked by parsing
   the test file). (do_eval / do_predict also reach TrainingArguments, which ignores them: their row names
   our own consumer's test.)
A field in CONSUMED that validate refuses is a stale table row: the test says so.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from backend.core.passthrough_rules import RANGES
from backend.core.spec import REFUSED, RunSpec, SpecError, _field_info, training_args_fields, validate_spec

TESTS = Path(__file__).resolve().parents[1]

# field -> "file::test" (relative to tests/) of a test that shows the field's effect.
CONSUMED = {
    # model
    "model_name_or_path": "backend/test_models.py::test_resolve_gguf_path_and_folder",
    "adapter_name_or_path": "backend/test_models.py::test_resume_and_stack_adapters",
    "create_new_adapter": "backend/test_models.py::test_resume_and_stack_adapters",
    "oft_target": "backend/test_oft.py::test_oft_trains_an_oft_adapter_on_the_targeted_layers",
    "oft_block_size": "backend/test_oft.py::test_oft_trains_an_oft_adapter_on_the_targeted_layers",
    "oft_rank": "backend/test_methods.py::test_oft_keys_reach_peft",
    "module_dropout": "backend/test_methods.py::test_oft_keys_reach_peft",
    "template": "backend/test_templates.py::test_named_matches_official_jinja_and_auto",
    "trust_remote_code": "backend/test_key_effects.py::test_trust_remote_code_reaches_the_loaders",
    "flash_attn": "backend/test_models.py::test_attention_choices",
    "enable_liger_kernel": "backend/test_models.py::test_unavailable_accelerations_warn_once_and_fall_back",
    "bf16": "backend/test_bf16.py::test_trainer_gets_bf16_only_where_the_model_is_bf16",
    "pure_bf16": "backend/test_models.py::test_unavailable_accelerations_warn_once_and_fall_back",
    "fp16": "backend/test_models.py::test_unavailable_accelerations_warn_once_and_fall_back",
    "infer_dtype": "backend/test_key_effects.py::test_infer_dtype_and_export_device",
    "resize_vocab": "backend/test_features.py::test_resize_vocab_grows_the_embeddings_to_the_tokenizer",
    "new_special_tokens": "backend/test_features.py::test_new_special_tokens_are_trained_and_saved_with_the_adapter",
    "rope_scaling": "backend/test_features.py::test_rope_scaling_kinds_change_the_positions",
    # method
    "stage": "backend/test_train_cli.py::test_pretraining_stage",
    "finetuning_type": "backend/test_models.py::test_full_trains_everything",
    "pref_loss": "backend/test_stage_dpo.py::test_each_loss_learns_the_toy_preference",
    "pref_beta": "backend/test_key_effects.py::test_preference_keys_reach_the_trl_configs",
    "pref_ftx": "backend/test_stage_dpo.py::test_pref_ftx_adds_the_chosen_answers_nll",
    "simpo_gamma": "backend/test_key_effects.py::test_preference_keys_reach_the_trl_configs",
    "dpo_label_smoothing": "backend/test_stage_dpo.py::test_label_smoothing_is_conservative_dpo",
    "kto_chosen_weight": "backend/test_key_effects.py::test_preference_keys_reach_the_trl_configs",
    "kto_rejected_weight": "backend/test_key_effects.py::test_preference_keys_reach_the_trl_configs",
    "ref_model": "backend/test_stage_dpo.py::test_reference_model_per_setup",
    "reward_funcs": "backend/test_stage_grpo.py::test_grpo_learns_the_toy_reward",
    "reward_weights": "backend/test_stage_grpo.py::test_grpo_learns_the_toy_reward",
    "reward_schema": "backend/test_grpo_spec.py::test_prompts_are_rendered_by_our_template_with_their_reference",
    "reward_regex": "backend/test_rewards.py::test_builtins_are_bound_to_their_settings",
    "reward_model": "backend/test_stage_ppo.py::test_a_reward_model_folder_scores_prompt_and_response",
    "reward_model_type": "backend/test_reward_api.py::test_ppo_scores_through_a_tuneboard_api_reward_server",
    "reward_model_api_key_env": "backend/test_reward_api.py::test_ppo_scores_through_a_tuneboard_api_reward_server",
    "reward_model_api_key_file": "backend/test_reward_api.py::"
                                 "test_the_key_comes_from_its_variable_or_file_and_stays_out_of_the_log",
    "ppo_epochs": "backend/test_stage_ppo.py::test_ppo_logs_its_series_and_saves_adapter_and_value_head",
    "ppo_buffer_size": "backend/test_stage_ppo.py::test_ppo_logs_its_series_and_saves_adapter_and_value_head",
    "ppo_target": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "ppo_score_norm": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "ppo_whiten_rewards": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "init_kl_coef": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "adap_kl_ctrl": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "gamma": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "lam": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "cliprange": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "cliprange_value": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "vf_coef": "backend/test_ppo_math.py::test_each_ppo_key_changes_the_update",
    "num_generations": "backend/test_grpo_spec.py::test_grpo_keys_reach_trls_config",
    "max_completion_length": "backend/test_grpo_spec.py::test_grpo_keys_reach_trls_config",
    "grpo_beta": "backend/test_grpo_spec.py::test_grpo_keys_reach_trls_config",
    "grpo_epsilon": "backend/test_grpo_spec.py::test_grpo_keys_reach_trls_config",
    # kd (tests/backend/test_stage_kd.py)
    "teacher_model_name_or_path": "backend/test_stage_kd.py::test_kd_on_policy_steps_generate_from_the_student",
    "teacher_adapter": "backend/test_stage_kd.py::test_kd_run_mixes_cross_entropy_and_distils_from_the_teacher_adapter",
    "teacher_quantization_bit": "backend/test_stage_kd.py::test_teacher_quantization_bit_loads_a_4bit_teacher",
    "kd_beta": "backend/test_stage_kd.py::test_kd_terms_are_the_kl_divergences_at_the_temperature",
    "kd_temperature": "backend/test_stage_kd.py::test_kd_terms_are_the_kl_divergences_at_the_temperature",
    "kd_alpha": "backend/test_stage_kd.py::test_kd_run_mixes_cross_entropy_and_distils_from_the_teacher_adapter",
    "kd_lmbda": "backend/test_stage_kd.py::test_kd_on_policy_steps_generate_from_the_student",
    # lora
    "lora_target": "backend/test_models.py::test_lora_options_reach_peft",
    "lora_rank": "backend/test_models.py::test_lora_options_reach_peft",
    "lora_alpha": "backend/test_models.py::test_lora_options_reach_peft",
    "lora_dropout": "backend/test_models.py::test_lora_options_reach_peft",
    "additional_target": "backend/test_models.py::test_lora_options_reach_peft",
    "use_dora": "backend/test_models.py::test_lora_options_reach_peft",
    "use_rslora": "backend/test_models.py::test_lora_options_reach_peft",
    "pissa_init": "backend/test_models.py::test_lora_options_reach_peft",
    "pissa_iter": "backend/test_models.py::test_lora_options_reach_peft",
    "loraplus_lr_ratio": "backend/test_features.py::test_loraplus_gives_lora_b_a_higher_learning_rate",
    # freeze and GaLore
    "freeze_trainable_layers": "backend/test_models.py::test_freeze_last_layers_trains_exactly_those",
    "freeze_trainable_modules": "backend/test_models.py::test_freeze_first_layers_named_modules_and_extras",
    "freeze_extra_modules": "backend/test_models.py::test_freeze_first_layers_named_modules_and_extras",
    "use_galore": "backend/test_features.py::test_galore_updates_are_low_rank",
    "galore_rank": "backend/test_features.py::test_galore_updates_are_low_rank",
    "galore_target": "backend/test_features.py::test_galore_updates_are_low_rank",
    "galore_update_interval": "backend/test_features.py::test_galore_update_interval_renews_the_projection",
    "galore_scale": "backend/test_features.py::test_galore_scale_scales_the_update",
    # quantization
    "quantization_bit": "backend/test_models.py::test_qlora_trains_on_bitsandbytes",
    "quantization_type": "backend/test_models.py::test_qlora_trains_on_bitsandbytes",
    "double_quantization": "backend/test_models.py::test_qlora_trains_on_bitsandbytes",
    # data
    "dataset": "backend/test_data.py::test_several_names_and_max_samples",
    "eval_dataset": "backend/test_evaluate.py::test_eval_run_loss_and_streamed_predictions",
    "dataset_dir": "backend/test_data.py::test_dataset_dir_works_from_another_cwd",
    "cutoff_len": "backend/test_preprocess.py::test_truncation_cuts_the_prompt_and_keeps_the_answer",
    "packing": "backend/test_packing.py::test_packed_equals_unpacked",
    "neat_packing": "backend/test_key_effects.py::test_neat_packing_packs_without_cross_attention",
    "train_on_prompt": "backend/test_preprocess.py::test_train_on_prompt_trains_everything",
    "mask_history": "backend/test_preprocess.py::test_mask_history_trains_only_last_turn",
    "val_size": "backend/test_data.py::test_split_train_val",
    "max_samples": "backend/test_data.py::test_several_names_and_max_samples",
    "preprocessing_num_workers": "backend/test_features.py::test_preprocessing_workers_give_identical_rows",
    "preprocessing_batch_size": "backend/test_tokenizing_progress.py::test_each_batch_moves_the_status_progress",
    "tokenized_path": "backend/test_token_cache.py::test_tokenized_path_is_checked_against_the_data",
    "overwrite_cache": "backend/test_token_cache.py::test_second_run_loads_the_cache_and_a_changed_cutoff_retokenizes",
    "streaming": "backend/test_streaming.py::test_streaming_sft_trains_and_resumes_at_the_next_row",
    "buffer_size": "backend/test_streaming.py::test_the_shuffle_buffer_orders_the_stream_by_its_size_and_seed",
    "mix_strategy": "backend/test_features.py::test_interleave_follows_datasets_semantics",
    "interleave_probs": "backend/test_features.py::test_interleave_follows_datasets_semantics",
    "default_system": "backend/test_features.py::test_default_system_is_in_training_and_eval_rows",
    "enable_thinking": "backend/test_features.py::test_enable_thinking_false_puts_an_empty_think_block_in_the_prompt",
    "identity_name": "backend/test_data.py::test_identity_placeholders_filled_in_every_dataset",
    "identity_author": "backend/test_data.py::test_identity_placeholders_filled_in_every_dataset",
    # train
    "output_dir": "backend/test_key_effects.py::test_overwrite_output_dir_replaces_a_finished_run",
    "overwrite_output_dir": "backend/test_key_effects.py::test_overwrite_output_dir_replaces_a_finished_run",
    "resume_from_checkpoint": "backend/test_train_cli.py::test_stop_file_aborts_with_a_checkpoint_then_resume",
    "plot_loss": "backend/test_train_cli.py::test_lora_sft_on_tiny_llama",
    "report_to": "backend/test_trackers.py::test_tensorboard_event_files_hold_the_loss",
    "do_eval": "backend/test_key_effects.py::test_do_eval_alone_skips_the_predictions",
    "do_predict": "backend/test_train_cli.py::test_eval_during_training_and_predictions",
    "eval_metric": "backend/test_task_metric.py::test_json_field_f1_at_each_save_and_the_best_checkpoint_is_the_adapter",
    "eval_samples": "backend/test_task_metric.py::test_json_field_f1_at_each_save_and_the_best_checkpoint_is_the_adapter",
    "metric_for_best_model": "backend/test_task_metric.py::test_load_best_model_at_end_is_satisfied_by_the_task_metric",
    "early_stopping_patience": "backend/test_train_cli.py::test_early_stopping_ends_the_run_when_eval_loss_stops_improving",
    # benchmark (tuneboard eval tasks=..., backend/evaluation/benchmarks.py)
    "tasks": "backend/test_benchmarks.py::test_shipped_task_in_process_equals_lm_eval_through_the_api",
    "num_fewshot": "backend/test_benchmarks.py::test_num_fewshot_and_limit_reach_lm_eval",
    "limit": "backend/test_benchmarks.py::test_num_fewshot_and_limit_reach_lm_eval",
    "do_judge": "backend/test_judge_eval.py::test_eval_judges_tuned_against_base_then_answers_from_the_cache",
    "judge_url": "backend/test_judge_eval.py::test_eval_judges_tuned_against_base_then_answers_from_the_cache",
    "judge_model": "backend/test_judge.py::test_spec_keys_reach_the_judge_and_are_refused_without_one",
    "judge_api_key_env": "backend/test_judge_eval.py::test_refused_key_and_spent_budget",
    "judge_api_key_file": "backend/test_judge.py::test_spec_keys_reach_the_judge_and_are_refused_without_one",
    "judge_max_requests": "backend/test_judge_eval.py::test_refused_key_and_spent_budget",
    "judge_against": "backend/test_judge_eval.py::test_refused_key_and_spent_budget",
    "checkpoints": "backend/test_checkpoint_eval.py::test_every_checkpoint_and_the_final_on_the_same_rows",
    # devices and distribution (backend/core/launch.py)
    "nproc_per_node": "backend/test_distributed_runs.py::test_ddp_two_processes_match_one_process_with_the_doubled_batch",
    "nnodes": "backend/test_distributed.py::test_print_launch_gives_every_node_the_same_spec_and_rendezvous",
    "node_rank": "backend/test_distributed.py::test_print_launch_gives_every_node_the_same_spec_and_rendezvous",
    "master_addr": "backend/test_distributed.py::test_print_launch_gives_every_node_the_same_spec_and_rendezvous",
    "master_port": "backend/test_distributed.py::test_bad_process_layouts_are_refused_with_the_field",
    # export
    "export_dir": "backend/test_export.py::test_safetensors_sharded_export_equals_base_plus_adapter",
    "export_size": "backend/test_export.py::test_safetensors_sharded_export_equals_base_plus_adapter",
    "export_device": "backend/test_key_effects.py::test_infer_dtype_and_export_device",
    "export_format": "backend/test_export.py::test_gguf_f16_round_trip_metadata_and_modelfile",
    "export_gguf_type": "backend/test_export.py::test_gguf_q8_0_reports_agreement",
    "export_imatrix": "backend/test_export_llamacpp.py::test_export_imatrix_reaches_llama_cpps_quantizer",
    "export_overwrite": "backend/test_export.py::test_refuses_non_empty_dir_unless_overwrite",
    # generation (chat, API, predictions)
    "infer_backend": "backend/test_engine.py::test_vllm_falls_back_to_transformers_with_a_clear_message",
    "max_new_tokens": "backend/test_key_effects.py::test_generation_keys_are_the_served_defaults",
    "do_sample": "backend/test_key_effects.py::test_generation_keys_are_the_served_defaults",
    "temperature": "backend/test_key_effects.py::test_generation_keys_are_the_served_defaults",
    "top_p": "backend/test_key_effects.py::test_generation_keys_are_the_served_defaults",
    "top_k": "backend/test_key_effects.py::test_generation_keys_are_the_served_defaults",
    "num_beams": "backend/test_key_effects.py::test_num_beams_and_sampling_keys_reach_generate",
    "repetition_penalty": "backend/test_key_effects.py::test_generation_keys_are_the_served_defaults",
}


# Values to try where the type alone does not give a valid one, with the other keys they need.
SAMPLES = {
    "optim": ("sgd", {}),
    "eval_strategy": ("steps", {"val_size": 0.1}),
    "load_best_model_at_end": (True, {"val_size": 0.1, "eval_strategy": "steps"}),
    "disable_gradient_checkpointing": (True, {"gradient_checkpointing": True}),
    # they shape a switch (backend.core.methods.SWITCHED): refused while it is off
    "pissa_iter": (4, {"pissa_init": True}),
    **{key: (value, {"finetuning_type": "full", "use_galore": True})
       for key, value in (("galore_rank", 8), ("galore_target", "q_proj"), ("galore_update_interval", 50),
                          ("galore_scale", 1.0))},
    "gradient_checkpointing": (False, {}),  # unset = on (LLaMA-Factory's default)
    "mix_strategy": ("interleave_under", {"dataset": "a,b"}),
    "report_to": ("tensorboard", {}),
    "export_imatrix": (True, {"export_format": "gguf", "export_gguf_type": "q4_k_m"}),  # refused with other types
    "streaming": (True, {"max_steps": 3}),  # a stream has no length: max_steps is required
    "buffer_size": (64, {"streaming": True, "max_steps": 3}),
    "num_fewshot": (2, {"tasks": "data/lm_eval_tasks/tuneboard_mc.yaml"}),  # they shape tasks (refused alone)
    "limit": (5, {"tasks": "data/lm_eval_tasks/tuneboard_mc.yaml"}),
    "eval_samples": (8, {"eval_metric": "rouge_l", "val_size": 0.1}),  # it shapes eval_metric (refused alone)
    "export_gguf_type": ("q8_0", {"export_format": "gguf"}),  # the GGUF file's type (refused with safetensors)
    # a shipped config: reaches the Trainer (deepspeed=...), or, for FSDP on a CPU-only machine, is refused
    "deepspeed": ("examples/deepspeed/ds_z2_config.json", {}),
    "accelerate_config": ("examples/accelerate/fsdp_config.yaml", {}),
}


def _test_names(relpath: str) -> set[str]:
    tree = ast.parse((TESTS / relpath).read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


def _other_value(name: str):
    """A valid value other than the field's default (None when there is none to try)."""
    field = RunSpec.model_fields[name]
    info = _field_info(name)
    default = field.default
    if info["choices"]:
        others = [c for c in info["choices"] if c != default]
        return others[0] if others else None
    base = info["base"]
    if base == "bool":
        return not default
    if base in ("int", "float"):
        low = info["ge"] if info["ge"] is not None else info["gt"]
        value = (default if isinstance(default, (int, float)) else (low or 1)) + 1
        if info["le"] is not None and value > info["le"]:
            value = info["le"] / 2
        if info["lt"] is not None and value >= info["lt"]:
            value = info["lt"] / 2
        return value if base == "float" or isinstance(value, int) else int(value)
    if "bool" in base:  # resume_from_checkpoint: bool | str
        return True
    return "sample"


def _refused(name: str, value, companions: dict | None = None) -> str | None:
    """The refusal message for field=value on the default spec, or None."""
    try:
        validate_spec({**(companions or {}), name: value}, check_files=False)
    except SpecError as exc:
        for field, message in exc.errors:
            if field == name and message.startswith(REFUSED):
                return message
    return None


class _Recorder:
    """Stands in for TrainingArguments: records the keyword arguments it is built with."""
    __dataclass_fields__ = None

    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _trainer_kwargs(data: dict) -> dict:
    from transformers import TrainingArguments

    from backend.stages.base import training_arguments

    _Recorder.__dataclass_fields__ = TrainingArguments.__dataclass_fields__
    spec = validate_spec(data, check_files=False)
    return training_arguments(spec, Path("/tmp/tb-every-key"), has_eval=True, args_class=_Recorder).kwargs


def _reaches_trainer(name: str, value, companions: dict) -> bool:
    try:
        changed = _trainer_kwargs({**companions, name: value})
    except SpecError:
        return False
    return changed != _trainer_kwargs(companions)


FIELDS = [n for n in RunSpec.model_fields if n != "passthrough"]


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_is_consumed_or_refused(name):
    value, companions = SAMPLES.get(name, (_other_value(name), {}))
    refused = value is not None and _refused(name, value, companions)
    to_trainer = value is not None and not refused and _reaches_trainer(name, value, companions)
    where = CONSUMED.get(name)
    if where:
        assert not refused, f"{name} is refused at validate ({refused}): drop its CONSUMED row"
        path, test = where.split("::")
        assert (TESTS / path).is_file(), f"{name}: CONSUMED names {path}, which does not exist"
        assert test in _test_names(path), f"{name}: CONSUMED names {where}, which does not exist"
        return
    if value is None:  # a single allowed value (e.g. quantization_method: bnb): nothing can be set
        assert len(_field_info(name)["choices"] or ()) == 1, f"{name}: no other value to try"
        return
    assert refused or to_trainer, (
        f"{name}={value!r} validates and changes nothing: make it work (and add the test to CONSUMED) or refuse "
        "it in backend/core/spec.py with the reason")


def test_refused_fields_are_marked_and_not_offered_in_the_form():
    """A field that is always refused carries the `refused` marker (so the form skips it), and says why."""
    from webui.fields import rows_by_name

    form = rows_by_name()
    marked = [n for n in FIELDS if (RunSpec.model_fields[n].json_schema_extra or {}).get("refused")]
    assert "use_llama_pro" in marked and "tool_format" in marked
    for name in marked:
        assert name not in form, f"{name} is always refused but the form offers it"
        message = _refused(name, _other_value(name))
        assert message and len(message) > len(REFUSED) + 20, f"{name}: refused without a reason"


def _passthrough_value(info: dict):
    kind, default, choices = info.get("type"), info.get("default"), info.get("choices")
    if choices:
        others = [c for c in choices if c != default]
        return others[0] if others else None
    number = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 0
    return {"bool": not default if isinstance(default, bool) else True, "int": int(number) + 3,
            "float": number + 0.25, "str": "sample", "list": ["sample"], "dict": {"sample": 1}}.get(kind)


def test_every_passthrough_key_reaches_the_trainer_or_is_refused():
    """The TrainingArguments passthrough as a class: every key, set to another value, arrives in the
    TrainingArguments as written (or validate refuses it)."""
    lost = []
    for name, info in training_args_fields().items():
        if name in RunSpec.model_fields:
            continue
        value = _passthrough_value(info)
        if name in RANGES and value is not None and not RANGES[name][0](value):  # a value the run can take
            value = (info.get("default") or 1) / 2
        if value is None or value == info.get("default"):
            continue
        if _refused(name, value):
            continue
        kwargs = _trainer_kwargs({name: value})
        if kwargs.get(name) != value:
            lost.append(f"{name}={value!r} -> {kwargs.get(name)!r}")
    assert not lost, "passthrough keys accepted but not passed on: " + "; ".join(lost)


def test_a_key_that_does_nothing_fails_this_check(monkeypatch):
    """The check itself can fail: a field nobody reads is reported."""
    monkeypatch.delitem(CONSUMED, "lora_rank")
    with pytest.raises(AssertionError, match="validates and changes nothing"):
        test_every_field_is_consumed_or_refused("lora_rank")


def test_consumed_rows_name_real_tests():
    missing = []
    for name, where in CONSUMED.items():
        path, test = where.split("::")
        if not (TESTS / path).is_file() or test not in _test_names(path):
            missing.append(f"{name}: {where}")
    assert not missing, "CONSUMED names tests that do not exist:\n" + "\n".join(missing)
    assert set(CONSUMED) <= set(FIELDS), f"not RunSpec fields: {sorted(set(CONSUMED) - set(FIELDS))}"
