"""backend/core/hf_training_args.json matches the installed transformers.TrainingArguments, and the
kwargs a RunSpec produces are accepted by it. (This test may import transformers; spec.py may not.)"""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from backend.core import paths
from backend.core.spec import HF_TRAINING_ARGS_JSON, RunSpec, training_args_fields, validate_spec

transformers = pytest.importorskip("transformers")


def _generator():
    path = paths.REPO_ROOT / "scripts" / "gen_training_args.py"
    spec = importlib.util.spec_from_file_location("gen_training_args", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_json_is_up_to_date_with_installed_transformers():
    recorded = json.loads(HF_TRAINING_ARGS_JSON.read_text())["fields"]
    fresh = _generator().build()["fields"]
    missing = sorted(set(fresh) - set(recorded))
    stale = sorted(set(recorded) - set(fresh))
    changed = sorted(k for k in set(fresh) & set(recorded) if fresh[k] != recorded[k])
    assert not (missing or stale or changed), (
        f"backend/core/hf_training_args.json is out of date with transformers {transformers.__version__} "
        f"(missing {missing}, stale {stale}, changed {changed}): run scripts/gen_training_args.py")


def test_every_init_field_recorded():
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    assert names <= set(training_args_fields())


def _no_files(data):
    return RunSpec.model_validate(data, context={"check_files": False})


def test_default_spec_kwargs_build_training_arguments(tmp_path):
    kwargs = _no_files({"output_dir": str(tmp_path)}).training_arguments()
    args = transformers.TrainingArguments(**kwargs)
    assert args.learning_rate == 1e-4 and args.per_device_train_batch_size == 2
    assert args.gradient_accumulation_steps == 4 and args.lr_scheduler_type.value == "cosine"
    assert args.logging_steps == 5 and args.optim.value == "adamw_torch" and args.seed == 42


def test_guide_hyperparameters_reach_training_arguments(tmp_path):
    spec = validate_spec({"output_dir": str(tmp_path), "learning_rate": 2.0e-4, "num_train_epochs": 3.0,
                          "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
                          "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "logging_steps": 10,
                          "save_steps": 100, "ddp_timeout": 180000000, "gradient_checkpointing": True,
                          "save_strategy": "steps", "disable_tqdm": True, "dataloader_num_workers": 0,
                          "include_num_input_tokens_seen": True, "torch_compile": False}, check_files=False)
    args = transformers.TrainingArguments(**spec.training_arguments())
    assert args.get_warmup_steps(100) == 10  # warmup_ratio 0.1 of 100 steps, whatever the version calls it
    assert args.ddp_timeout == 180000000 and args.save_steps == 100 and args.logging_steps == 10
    assert args.save_strategy.value == "steps" and args.disable_tqdm is True
    checkpointing = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    assert checkpointing is True


def test_every_passthrough_default_is_accepted(tmp_path):
    """Writing any passthrough key with its own default value validates and is accepted by
    TrainingArguments (so the recorded types are the right ones)."""
    fields = training_args_fields()
    data = {k: v["default"] for k, v in fields.items()
            if k not in RunSpec.model_fields and v["default"] is not None}
    spec = _no_files({**data, "output_dir": str(tmp_path)})
    assert set(spec.passthrough) == set(data)
    transformers.TrainingArguments(**spec.training_arguments())
