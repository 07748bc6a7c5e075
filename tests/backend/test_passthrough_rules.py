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


# ------------------------------------------------------------------ values transformers reads after launch (2026-12-07)

def test_optim_args_the_optimizer_would_stop_on_or_not_read_is_refused():
    """optim_args foo stopped the default run when the optimizer was made ("not enough values to unpack"); sgd given
    foo=1 trained as if it were not there."""
    assert _errors(optim_args="foo")["optim_args"].startswith(f"{REFUSED}: optim adamw_torch reads no optim_args")
    assert _errors(optim="sgd", optim_args="foo")["optim_args"].startswith("comma-separated key=value pairs")
    assert _errors(optim="sgd", optim_args="momentum=0.9,")["optim_args"].startswith("comma-separated key=value")
    assert _errors(optim="sgd", optim_args="foo=1")["optim_args"] == (
        "optim sgd takes no 'foo' (it takes momentum, dampening, weight_decay, nesterov)")
    assert _errors(optim="sgd", optim_args="momentum=x")["optim_args"] == "momentum must be a number (got 'x')"
    assert _errors(optim="ademamix", optim_args="t_alpha=0.5")["optim_args"] == "t_alpha must be an integer (got '0.5')"
    assert _errors(optim="sgd", optim_args="nesterov=maybe")["optim_args"] == (
        "nesterov must be true or false (got 'maybe')")
    assert "bitsandbytes as text" in _errors(optim="rmsprop_bnb", optim_args="alpha=0.9")["optim_args"]
    galore = _errors(use_galore=True, finetuning_type="full", optim_args="rank=4")["optim_args"]
    assert galore.startswith(REFUSED) and "galore_rank" in galore
    assert not _errors(optim="sgd", optim_args="momentum=0.9, nesterov=true")  # transformers drops the spaces
    assert not _errors(optim="ademamix", optim_args="beta3=0.999,t_alpha=10")


def _optimizer_kwargs(args, optim: str, optim_args: str | None) -> dict:
    """The keyword arguments transformers makes optimizer `optim` with, given optim_args (params left out)."""
    import copy

    import torch
    from transformers import Trainer

    run = copy.copy(args)
    run.optim, run.optim_args = optim, optim_args
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(run, torch.nn.Linear(2, 2))
    return {k: v for k, v in kwargs.items() if k != "params"}


def test_optim_args_table_is_what_the_installed_optimizers_read(tmp_path):
    """Every optimizer that can run here: each key OPTIM_ARGS lets through changes the optimizer's arguments, and a key
    it refuses changes nothing (transformers drops it without a word); what validate refuses in the value, transformers
    stops on; bitsandbytes' RMSprop gets the text."""
    import importlib.util

    from transformers import TrainingArguments
    from transformers.trainer_optimizer import _parse_optim_args

    from backend.core.optim_names import optimizer_problem
    from backend.core.passthrough_rules import OPTIM_ARGS, OPTIM_ARGS_AS_TEXT
    from backend.core.spec import training_args_fields

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    sample = {"number": "0.125", "integer": "7", "switch": "true", "text": "float16"}
    checked = []
    for optim in training_args_fields()["optim"]["choices"]:
        if optimizer_problem(optim) or optim in OPTIM_ARGS_AS_TEXT:
            continue  # refused by name here (galore_*, a package not installed); the text case below
        plain = _optimizer_kwargs(args, optim, None)
        assert _optimizer_kwargs(args, optim, "tuneboard_unread=1") == plain, optim
        for key, kind in OPTIM_ARGS.get(optim, {}).items():
            assert _optimizer_kwargs(args, optim, f"{key}={sample[kind]}") != plain, (optim, key)
        checked.append(optim)
    assert {"adamw_torch", "adafactor", "sgd", "adagrad", "rmsprop"} <= set(checked)
    with pytest.raises(ValueError):
        _parse_optim_args("foo")
    with pytest.raises(ValueError):
        _optimizer_kwargs(args, "sgd", "momentum=x")
    if importlib.util.find_spec("bitsandbytes"):
        assert _optimizer_kwargs(args, "rmsprop_bnb", "alpha=0.9")["alpha"] == "0.9"


def test_optim_args_table_keys_are_read_by_their_handlers():
    """The rows of optimizers whose package is not installed here (the test above cannot make them): each key is one
    their transformers handler reads from optim_args."""
    import inspect
    import re

    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS

    from backend.core.passthrough_rules import OPTIM_ARGS

    for optim, takes in OPTIM_ARGS.items():
        source = inspect.getsource(_OPTIMIZER_HANDLERS[optim])
        read = set(re.findall(r'optim_args(?:\.(?:get|pop)\(|\[)"(\w+)"', source))
        read |= set(re.findall(r'"(\w+)" in ctx\.optim_args', source))
        for listed in re.findall(r"for key in \(([^)]*)\):\s*if key in ctx\.optim_args", source):
            read |= set(re.findall(r'"(\w+)"', listed))
        assert set(takes) <= read, (optim, set(takes) - read)


def test_mapping_keys_tables_are_the_installed_ones():
    """CHECKPOINT_KWARGS: torch's checkpoint arguments (but the callable context_fn) and the two the Trainer takes out
    of the kwargs; ACCELERATOR_CONFIG: AcceleratorConfig's fields; and TrainingArguments parses a JSON object string
    for each key validate reads one in."""
    import inspect
    import re

    import torch.utils.checkpoint
    from transformers import PreTrainedModel, TrainingArguments
    from transformers.trainer_pt_utils import AcceleratorConfig

    from backend.core.passthrough_rules import ACCELERATOR_CONFIG, CHECKPOINT_KWARGS, CHECKPOINT_KWARGS_KEYS

    checkpoint = torch.utils.checkpoint.checkpoint
    torch_takes = {n for n, p in inspect.signature(checkpoint).parameters.items() if p.kind == p.KEYWORD_ONLY}
    torch_takes |= set(re.findall(r'kwargs\.pop\("(\w+)"', inspect.getsource(checkpoint)))
    trainer_takes = set(inspect.signature(PreTrainedModel.activation_checkpointing_enable).parameters)
    assert set(CHECKPOINT_KWARGS) == (torch_takes - {"context_fn"}) | (trainer_takes - {
        "self", "activation_checkpointing_kwargs"})
    assert set(ACCELERATOR_CONFIG) == set(AcceleratorConfig.__dataclass_fields__)
    assert {"accelerator_config", "lr_scheduler_kwargs", *CHECKPOINT_KWARGS_KEYS} <= set(
        TrainingArguments._VALID_DICT_FIELDS)


def test_checkpoint_kwargs_take_a_mapping_or_a_json_object_string(tmp_path):
    """gradient_checkpointing_kwargs junk stopped the default run at its first step ("dictionary update sequence
    element #0 has length 1"), {"foo": 1} too ("Unexpected keyword arguments: foo"); the mapping and its JSON string
    (TrainingArguments parses one) reach the Trainer as the mapping."""
    from backend.stages.base import training_arguments

    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        assert _errors(**{key: "junk"})[key] == ("a mapping of torch.utils.checkpoint's arguments, e.g. "
                                                 "{\"use_reentrant\": false} (got 'junk')")
        assert _errors(**{key: ["use_reentrant"]})[key].startswith("a mapping of torch.utils.checkpoint's")
        assert _errors(**{key: "{use_reentrant: false}"})[key].startswith("not a JSON object: Expecting property")
        assert _errors(**{key: {"foo": 1}})[key] == (
            "takes no 'foo' (it takes use_reentrant, preserve_rng_state, determinism_check, debug, early_stop, "
            "every_n_layers, offload)")
    for value in ({"use_reentrant": False, "every_n_layers": 2}, '{"use_reentrant": false, "every_n_layers": 2}'):
        spec = validate_spec({"gradient_checkpointing_kwargs": value}, check_files=False)
        args = training_arguments(spec, tmp_path, has_eval=False)
        assert args.activation_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 2}


def test_accelerator_config_takes_a_mapping_a_json_string_or_a_json_file(tmp_path):
    """accelerator_config naming a missing file stopped the default run after launch ("No such file or directory");
    what validate refuses, TrainingArguments stops on, and what it passes, TrainingArguments builds."""
    from transformers import TrainingArguments

    from backend.core.passthrough_rules import accelerator_config_problem

    good = tmp_path / "accelerate.json"
    good.write_text('{"split_batches": false, "even_batches": true}')
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"foo": 1}')
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    missing = tmp_path / "missing.json"
    for value in ({"even_batches": True}, '{"even_batches": true}', str(good)):
        assert accelerator_config_problem(value) is None, value
        TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", accelerator_config=value)
    refused = {str(missing): f"file not found: {missing}", str(tmp_path): f"is a folder: {tmp_path}",
               str(unknown): f"{unknown}: no setting 'foo'", '{"foo": 1}': "no setting 'foo'",
               str(listed): f"{listed}: a mapping of accelerate's settings", '{"even': "not a JSON object"}
    for value, says in refused.items():
        assert accelerator_config_problem(value).startswith(says), value
        with pytest.raises((OSError, ValueError, TypeError)):
            TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", accelerator_config=value)
    assert accelerator_config_problem(str(missing), check_files=False) is None  # a form being edited
    assert _errors(accelerator_config=5)["accelerator_config"].startswith("a mapping of accelerate's settings")
