"""Train keys another key makes inert are refused by validate, naming the key that wins (backend/core/train_rules.py);
resume_from_checkpoint names a checkpoint there is (backend.core.rundir.resume_choice, the rule the run applies)."""
from __future__ import annotations

import json

import pytest

from backend.core.spec import REFUSED, SpecError, validate_spec


def _errors(**keys) -> dict[str, str]:
    try:
        validate_spec({"dataset": "extraction_demo", **keys})
    except SpecError as exc:
        return dict(exc.errors)
    return {}


@pytest.mark.parametrize("keys, refused, winner", [
    ({"warmup_steps": 3, "warmup_ratio": 0.2}, "warmup_ratio", "warmup_steps 3"),
    ({"lr_scheduler_type": "constant", "warmup_ratio": 0.1}, "warmup_ratio", "constant has no warmup"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "warmup_steps": 2}, "warmup_steps", "has no warmup"),
    ({"save_strategy": "no", "save_steps": 50}, "save_steps", "save_strategy no"),
    ({"save_strategy": "epoch", "save_steps": 5}, "save_steps", "save_strategy epoch"),
    ({"save_strategy": "no", "save_total_limit": 2}, "save_total_limit", "save_strategy no"),
    ({"eval_steps": 5}, "eval_steps", "eval_strategy no"),
])
def test_a_key_its_winner_makes_inert_is_refused(keys, refused, winner):
    message = _errors(**keys).get(refused)
    assert message and message.startswith(REFUSED) and winner in message, message


def test_with_the_winner_out_of_the_way_they_pass():
    assert _errors(warmup_ratio=0.2) == {}
    assert _errors(warmup_steps=3, lr_scheduler_type="constant_with_warmup") == {}
    assert _errors(save_steps=5, save_total_limit=2) == {}  # save_strategy steps, the default
    assert _errors(save_strategy="epoch", save_total_limit=2) == {}
    assert _errors(eval_steps=5, eval_strategy="steps", val_size=0.1) == {}
    assert _errors(lr_scheduler_type="constant", warmup_ratio=0.0, warmup_steps=0) == {}  # the defaults


def test_resume_needs_a_checkpoint_to_resume(tmp_path):
    assert "set output_dir" in _errors(resume_from_checkpoint=True)["resume_from_checkpoint"]
    out = tmp_path / "run"
    out.mkdir()
    assert _errors(resume_from_checkpoint=True, output_dir=str(out))["resume_from_checkpoint"] == \
        f"no complete checkpoint-N folder in {out}"
    (out / "checkpoint-4").mkdir()  # cut short: no trainer_state.json
    assert "(checkpoint-4 incomplete)" in _errors(resume_from_checkpoint=True, output_dir=str(out))["resume_from_checkpoint"]
    assert "is incomplete" in _errors(resume_from_checkpoint=str(out / "checkpoint-4"))["resume_from_checkpoint"]
    assert "is not a checkpoint folder" in _errors(resume_from_checkpoint=str(out / "x"))["resume_from_checkpoint"]
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    assert "resume_from_checkpoint" not in _errors(resume_from_checkpoint=True, output_dir=str(out),
                                                   overwrite_output_dir=False)
    assert "resume_from_checkpoint" not in _errors(resume_from_checkpoint=str(out / "checkpoint-2"))


def test_a_schedule_that_needs_evaluations_needs_them():
    """reduce_lr_on_plateau steps on the evaluation loss: in a run that never evaluates transformers stopped it after
    launch ("requires an eval strategy"); validate says it first."""
    message = _errors(lr_scheduler_type="reduce_lr_on_plateau")["lr_scheduler_type"]
    assert message.startswith("reduce_lr_on_plateau lowers the rate") and "set eval_strategy" in message
    assert _errors(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps", val_size=0.1) == {}


@pytest.mark.parametrize("optim, words", [
    ("galore_adamw", "set use_galore: true"), ("galore_adafactor_layerwise", "use_galore picks itself"),
    ("schedule_free_adamw", "needs the schedulefree package"), ("adamw_torch_xla", "Google TPUs"),
    ("stable_adamw", "pip install torch-optimi"), ("lomo", "needs the lomo-optim package"),
])
def test_an_optimizer_that_cannot_run_here_is_refused(optim, words):
    """Each stopped a short run after launch (ImportError, GaLore without its target modules); the optimizers the
    form offers run (the sweep of 2026-12-05: adamw_torch(_fused), adafactor, sgd, adamw_8bit, paged_adamw_8bit,
    lion_8bit, the bitsandbytes family, adagrad, rmsprop)."""
    import importlib.util

    from backend.core.optim_names import OPTIMIZER_PACKAGES

    module = next((m for k, (m, _, _) in OPTIMIZER_PACKAGES.items() if optim == k or optim.startswith(k)), None)
    if module and importlib.util.find_spec(module):
        pytest.skip(f"{module} is installed here: {optim} may run")
    assert words in _errors(optim=optim)["optim"]
    assert _errors(optim="adamw_torch", use_galore=True, finetuning_type="full") == {}


def test_a_schedule_without_the_kwargs_it_needs_is_refused():
    assert "min_lr or min_lr_rate in lr_scheduler_kwargs" in _errors(lr_scheduler_type="cosine_with_min_lr")["lr_scheduler_type"]
    assert "num_decay_steps" in _errors(lr_scheduler_type="warmup_stable_decay")["lr_scheduler_type"]
    assert _errors(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}) == {}
    assert _errors(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"num_decay_steps": 2}) == {}


def test_save_strategy_best_needs_an_evaluation_of_its_metric():
    assert "set metric_for_best_model" in _errors(save_strategy="best")["save_strategy"]
    assert "save_strategy" in _errors(save_strategy="best", metric_for_best_model="eval_loss")  # never evaluated
    assert _errors(save_strategy="best", metric_for_best_model="eval_loss", eval_strategy="steps", val_size=0.2) == {}


def test_save_strategy_best_saves_where_the_evaluation_improved(tiny_llama, tmp_path):
    """A real run: a checkpoint at each evaluation that beat the best eval_loss so far, none at the others."""
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "train", f"model_name_or_path={tiny_llama}",
                           "template=llama3", "dataset=identity", "cutoff_len=64", "per_device_train_batch_size=2",
                           "gradient_accumulation_steps=1", "learning_rate=0.05", "max_steps=6", "logging_steps=1",
                           "lora_rank=4", "save_strategy=best", "metric_for_best_model=eval_loss",
                           "eval_strategy=steps", "eval_steps=1", "val_size=0.2", "plot_loss=false",
                           f"output_dir={out}"], cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    evals = [(r["step"], r["eval_loss"]) for r in map(json.loads, (out / "trainer_log.jsonl").read_text().splitlines())
             if r.get("eval_loss") is not None]
    best, improved = float("inf"), set()
    for step, loss in evals:
        if loss < best:
            best, improved = loss, improved | {step}
    saved = {int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")}
    assert len(evals) == 6 and saved == improved and saved != {step for step, _ in evals}, (evals, saved)


def test_the_other_export_formats_key_is_refused(tmp_path):
    """export_gguf_type is the GGUF file's tensor type, export_size the safetensors shards' size: each is inert in the
    other format's export (backend/exporting/export.py reads it only in its own branch)."""
    x = str(tmp_path / "x")  # a folder still to make (validate refuses a non-empty one without export_overwrite)
    assert "export_format is safetensors" in _errors(export_dir=x, export_gguf_type="q8_0")["export_gguf_type"]
    assert "a GGUF export is one file" in _errors(export_dir=x, export_format="gguf", export_size=2)["export_size"]
    assert _errors(export_dir=x, export_format="gguf", export_gguf_type="q8_0") == {}
    assert _errors(export_dir=x, export_size=2) == {}


def test_scheduler_kwargs_table_is_the_installed_schedules():
    """SCHEDULER_KWARGS (what validate lets through in lr_scheduler_kwargs) equals what the installed transformers'
    schedule functions (and torch's ReduceLROnPlateau) take, for every lr_scheduler_type the spec offers."""
    import inspect
    import typing

    import torch
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    from backend.core.spec import RunSpec
    from backend.core.train_rules import SCHEDULER_KWARGS

    offered = typing.get_args(RunSpec.model_fields["lr_scheduler_type"].annotation)
    assert set(SCHEDULER_KWARGS) == set(offered)
    own = {"optimizer", "num_warmup_steps", "num_training_steps"}
    for name in offered:
        if name == "reduce_lr_on_plateau":
            takes = set(inspect.signature(torch.optim.lr_scheduler.ReduceLROnPlateau).parameters) - own
        elif name in ("constant", "constant_with_warmup"):
            takes = set()  # get_scheduler builds these without the kwargs
        else:
            takes = set(inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters) - own
        assert set(SCHEDULER_KWARGS[name]) == takes, name


def test_a_scheduler_kwarg_the_schedule_does_not_take_is_refused():
    """lr_scheduler_kwargs {"foo": 1} stopped the run after launch (get_cosine_schedule_with_warmup() got an
    unexpected keyword argument 'foo'); a string stopped it too."""
    assert _errors(lr_scheduler_kwargs={"foo": 1}) == {
        "lr_scheduler_kwargs": "cosine takes no foo (it takes num_cycles, last_epoch)"}
    assert "takes no num_cycles (it takes no arguments)" in _errors(
        lr_scheduler_type="constant", lr_scheduler_kwargs={"num_cycles": 0.5})["lr_scheduler_kwargs"]
    assert _errors(lr_scheduler_kwargs={"num_cycles": 0.5}) == {}


def test_scheduler_kwargs_as_a_json_object_string_are_read_as_transformers_reads_them(tmp_path):
    """TrainingArguments parses a string that starts with "{" as JSON (lr_scheduler_kwargs: '{"num_cycles": 0.5}' in
    YAML quotes): validate checks its keys the same, and refuses one that is not JSON (it stopped the run there)."""
    from backend.stages.base import training_arguments

    assert _errors(lr_scheduler_kwargs='{"foo": 1}') == {
        "lr_scheduler_kwargs": "cosine takes no foo (it takes num_cycles, last_epoch)"}
    assert _errors(lr_scheduler_kwargs='{"foo": 1')["lr_scheduler_kwargs"].startswith("not a JSON object: Expecting")
    assert _errors(lr_scheduler_kwargs="num_cycles=0.5")["lr_scheduler_kwargs"].startswith("a mapping of the schedule")
    assert _errors(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr_rate": 0.1}') == {}
    spec = validate_spec({"lr_scheduler_kwargs": '{"num_cycles": 0.25}'}, check_files=False)
    assert training_arguments(spec, tmp_path, has_eval=False).lr_scheduler_kwargs == {"num_cycles": 0.25}
