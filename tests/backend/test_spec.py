"""RunSpec: defaults, the reference guide's recipes verbatim, friendly errors, cross-field rules,
overrides, YAML round trip, load errors, and the no-heavy-imports boundary.

File checks (template exists, dataset registered) run against a small dataset_info.json and template
folder made in tmp_path, so these tests pin the spec's own logic; tests/backend/test_examples.py
checks the real data/ and templates/."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from backend.core import paths
from backend.core.spec import (
    RunSpec,
    SpecError,
    load_spec,
    parse_overrides,
    spec_fields,
    training_args_fields,
    validate_spec,
)

# The two recipes of the reference guide (shared/reference/llama-factory-guide.txt), as printed there.
GUIDE_TRAIN = """\
### Model Configuration
model_name_or_path: Qwen/Qwen2.5-7B-Instruct
trust_remote_code: true
### Training Stage
stage: sft
do_train: true
finetuning_type: lora
lora_target: all
lora_rank: 16
lora_alpha: 32
lora_dropout: 0.05
### Quantization & Acceleration
quantization_bit: 4
quantization_type: nf4
double_quantization: true
flash_attn: fa2
enable_liger_kernel: true
### Dataset Configuration
dataset: aifetchly_extraction
template: qwen
cutoff_len: 4096
packing: true
overwrite_cache: true
preprocessing_num_workers: 8
### Hyperparameters
output_dir: saves/qwen2.5-7b-aifetchly-lora
logging_steps: 10
save_steps: 100
plot_loss: true
learning_rate: 2.0e-4
num_train_epochs: 3.0
per_device_train_batch_size: 4
gradient_accumulation_steps: 4
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
"""

GUIDE_EXPORT = """\
### Base Model & Trained Adapter
model_name_or_path: Qwen/Qwen2.5-7B-Instruct
adapter_name_or_path: saves/qwen2.5-7b-aifetchly-lora
template: qwen
finetuning_type: lora
### Export Configuration
export_dir: models/qwen2.5-7b-aifetchly-merged
export_size: 4
export_device: cpu
export_legacy_format: false
"""

# The guide's Step 2 registration of its dataset.
GUIDE_DATASET_INFO = {
    "aifetchly_extraction": {
        "file_name": "aifetchly_extraction.json",
        "columns": {"prompt": "instruction", "query": "input", "response": "output"},
    }
}

FAKE_DATASET_INFO = {
    "identity": {"file_name": "identity.json"},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "extraction_demo": {"file_name": "extraction_demo.json",
                        "columns": {"prompt": "instruction", "query": "input", "response": "output"}},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True,
                    "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}},
    "kto_en_demo": {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "kto_tag": "label"}},
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A data/ and templates/ of our own, so the file checks see exactly what each test sets up."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(FAKE_DATASET_INFO))
    for entry in FAKE_DATASET_INFO.values():  # validate checks that each registered file exists
        (data / entry["file_name"]).touch()
    tdir = tmp_path / "templates"
    tdir.mkdir()
    for name in ("qwen", "qwen3", "llama3", "chatml", "default"):
        (tdir / f"{name}.yaml").write_text(f"name: {name}\n")
    monkeypatch.setattr(paths, "DATA_DIR", data)
    monkeypatch.setattr(paths, "TEMPLATES_DIR", tdir)
    return tmp_path


def errors_of(data: dict, **kw) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        validate_spec(data, **kw)
    return info.value.errors


def messages(data: dict) -> dict[str, str]:
    return dict(errors_of(data))


# ---------------------------------------------------------------------------------------------- defaults


def test_defaults_are_valid_and_sensible(files):
    spec = RunSpec()
    assert spec.model_name_or_path == paths.DEFAULT_MODEL_ID
    assert (spec.stage, spec.finetuning_type, spec.dataset, spec.template) == ("sft", "lora", "identity", "auto")
    assert spec.resolved_lora_alpha == 16
    assert spec.resolved_packing is False
    assert spec.model_copy(update={"stage": "pt"}).resolved_packing is True
    assert spec.resolved_dataset_dir() == (files / "data").resolve()
    assert spec.passthrough == {}
    assert load_spec() == spec


def test_default_output_dir_layout(files, monkeypatch, tmp_path):
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path / "saves"))
    spec = RunSpec.model_validate({"model_name_or_path": "/models/My Model.Q4_K_M.gguf", "finetuning_type": "freeze"},
                                  context={"check_files": False})  # a made-up path: only the folder name matters
    out = spec.default_output_dir(datetime(2025, 1, 2, 3, 4, 5))
    assert out == tmp_path / "saves" / "My_Model.Q4_K_M" / "freeze" / "20250102-030405"
    assert RunSpec().with_output_dir().output_dir.startswith(str(tmp_path / "saves" / "SmolLM2-135M-Instruct" / "lora"))


def test_every_field_has_description_and_group():
    for name, field in RunSpec.model_fields.items():
        assert field.description and "\n" not in field.description, name
        assert (field.json_schema_extra or {}).get("group") in (
            "model", "method", "lora", "oft", "freeze", "quantization", "data", "train", "distributed", "logging", "eval", "export",
            "generation", "advanced"), name


def test_spec_fields_table():
    rows = {r["name"]: r for r in spec_fields()}
    assert rows["lora_rank"]["type"] == "int" and rows["lora_rank"]["ge"] == 1 and rows["lora_rank"]["default"] == 8
    assert rows["lora_alpha"]["type"] == "optional-int"
    assert rows["stage"]["type"] == "choice" and rows["stage"]["choices"][:2] == ["pt", "sft"]
    assert rows["quantization_bit"]["type"] == "optional-choice" and rows["quantization_bit"]["choices"] == [4, 8]
    assert rows["lora_dropout"]["ge"] == 0 and rows["lora_dropout"]["le"] == 1
    assert rows["lora_rank"]["methods"] == ["lora"] and rows["lora_rank"]["group"] == "lora"
    assert rows["pref_beta"]["stages"] and "dpo" in rows["pref_beta"]["stages"]
    assert rows["learning_rate"]["gt"] == 0
    assert "passthrough" not in rows
    with_pt = {r["name"]: r for r in spec_fields(include_passthrough=True)}
    assert with_pt["dataloader_num_workers"]["type"] == "int" and with_pt["dataloader_num_workers"]["passthrough"]
    assert with_pt["learning_rate"] == rows["learning_rate"]  # spec fields are not duplicated
    assert with_pt["torch_compile"]["refused"] and not with_pt["dataloader_num_workers"]["refused"]


# ---------------------------------------------------------------------------------------------- guide recipes


def test_guide_train_recipe_validates_verbatim(files, tmp_path, hub_cache):
    # The guide's machine has its model: here a Hugging Face cache of the test's own holds it under its hub id.
    hub_cache("Qwen/Qwen2.5-7B-Instruct")
    ddir = tmp_path / "guide_data"
    ddir.mkdir()
    (ddir / "dataset_info.json").write_text(json.dumps(GUIDE_DATASET_INFO))
    (ddir / "aifetchly_extraction.json").touch()
    path = tmp_path / "train_qwen_qlora.yaml"
    path.write_text(GUIDE_TRAIN)
    spec = load_spec(path, [f"dataset_dir={ddir}"])
    assert spec.quantization_bit == 4 and spec.quantization_type == "nf4" and spec.double_quantization
    assert spec.lora_rank == 16 and spec.resolved_lora_alpha == 32 and spec.lora_dropout == 0.05
    assert spec.flash_attn == "fa2" and spec.enable_liger_kernel and spec.packing is True
    assert spec.learning_rate == 2.0e-4 and spec.warmup_ratio == 0.1 and spec.bf16
    assert spec.ddp_timeout == 180000000 and spec.template == "qwen"
    assert spec.output_dir == "saves/qwen2.5-7b-aifetchly-lora"
    # Without its dataset registered, the recipe is refused with a message that says so.
    errs = errors_of(yaml.safe_load(GUIDE_TRAIN))
    assert errs[0][0] == "dataset" and "'aifetchly_extraction' is not in" in errs[0][1]
    assert str(files / "data" / "dataset_info.json") in errs[0][1]


def test_guide_export_recipe_validates_verbatim(files, tmp_path, hub_cache, monkeypatch):
    path = tmp_path / "export_qwen.yaml"
    path.write_text(GUIDE_EXPORT)
    monkeypatch.chdir(tmp_path)  # the recipe's relative adapter path: the guide runs from its project folder
    with pytest.raises(SpecError) as refused:  # before its training: the model is not here, nor the adapter
        load_spec(path)
    assert [field for field, _ in refused.value.errors] == ["adapter_name_or_path", "model_name_or_path"]
    assert "saves/qwen2.5-7b-aifetchly-lora does not exist" in str(refused.value)
    assert "'Qwen/Qwen2.5-7B-Instruct' is not in this machine's Hugging Face cache" in str(refused.value)
    hub_cache("Qwen/Qwen2.5-7B-Instruct")
    (tmp_path / "saves" / "qwen2.5-7b-aifetchly-lora").mkdir(parents=True)
    (tmp_path / "saves" / "qwen2.5-7b-aifetchly-lora" / "adapter_config.json").write_text("{}")
    spec = load_spec(path)
    assert spec.adapter_name_or_path == "saves/qwen2.5-7b-aifetchly-lora"
    assert (spec.export_dir, spec.export_size, spec.export_device, spec.export_legacy_format) == (
        "models/qwen2.5-7b-aifetchly-merged", 4, "cpu", False)


def test_examples_hold_the_guide_recipes_verbatim():
    assert (paths.EXAMPLES_DIR / "train_qwen_qlora.yaml").read_text() == GUIDE_TRAIN
    assert (paths.EXAMPLES_DIR / "export_qwen.yaml").read_text() == GUIDE_EXPORT
    adapted = yaml.safe_load((paths.EXAMPLES_DIR / "sft_qlora_extraction.yaml").read_text())
    original = yaml.safe_load(GUIDE_TRAIN)
    changed = {k for k in original if adapted.get(k) != original[k]}
    assert changed == {"model_name_or_path", "dataset"} and adapted.keys() == original.keys()
    assert adapted["model_name_or_path"] == paths.DEFAULT_MODEL_ID and adapted["dataset"] == "extraction_demo"


# ---------------------------------------------------------------------------------------------- field errors


def test_unknown_key_names_closest(files):
    errs = errors_of({"lora_alpah": 16, "learnin_rate": 1e-3, "zzzzzz": 1})
    assert ("lora_alpah", "unknown key 'lora_alpah' (did you mean 'lora_alpha'?)") in errs
    assert ("learnin_rate", "unknown key 'learnin_rate' (did you mean 'learning_rate'?)") in errs
    assert ("zzzzzz", "unknown key 'zzzzzz'") in errs


def test_unknown_key_suggests_passthrough_names(files):
    assert messages({"dataloader_num_worker": 2})["dataloader_num_worker"] == (
        "unknown key 'dataloader_num_worker' (did you mean 'dataloader_num_workers'?)")


def test_range_messages_name_field_and_range(files):
    m = messages({"lora_rank": 0, "lora_dropout": 1.5, "learning_rate": 0, "cutoff_len": 4,
                  "warmup_ratio": 1.0, "export_size": 0})
    assert m["lora_rank"] == "must be >= 1 (got 0)"
    assert m["lora_dropout"] == "must be between 0 and 1 (got 1.5)"
    assert m["learning_rate"] == "must be > 0 (got 0)"
    assert m["cutoff_len"] == "must be >= 8 (got 4)"
    assert m["warmup_ratio"] == "must be >= 0 and < 1 (got 1.0)"
    assert m["export_size"] == "must be > 0 (got 0)"


def test_type_messages(files):
    m = messages({"lora_rank": "big", "fp16": "maybe", "bf16": "maybe", "learning_rate": "fast", "max_samples": [1],
                  "resume_from_checkpoint": [1], "freeze_trainable_layers": 0})
    assert m["lora_rank"] == "must be an integer >= 1 (got 'big')"
    assert m["bf16"] == "must be true or false or null (got 'maybe')"
    assert m["fp16"] == "must be true or false (got 'maybe')"
    assert m["learning_rate"] == "must be a number > 0 (got 'fast')"
    assert m["max_samples"] == "must be an integer or null >= 1 (got [1])"
    assert m["resume_from_checkpoint"] == "must be true/false or a string or null (got [1])"
    assert m["freeze_trainable_layers"].startswith("must not be 0")


def test_choice_messages(files):
    m = messages({"stage": "sfft", "quantization_bit": 3, "finetuning_type": "qlora", "optim": "adamw"})
    from backend.stages import IMPLEMENTED  # light: the stage declarations, in their order

    assert m["stage"] == f"must be one of {', '.join(IMPLEMENTED)} (got 'sfft')"
    assert IMPLEMENTED[:7] == ("pt", "sft", "rm", "dpo", "orpo", "simpo", "kto") and "rloo" in IMPLEMENTED
    assert m["quantization_bit"] == "must be one of 4, 8, null (got 3)"
    assert m["finetuning_type"] == "must be one of lora, oft, freeze, full (got 'qlora')"
    assert m["optim"].startswith("unknown optimizer 'adamw'")


def test_all_errors_collected_in_one_go(files):
    errs = errors_of({"lora_rank": 0, "stage": "x", "lora_alpah": 1, "bf16": True, "fp16": True})
    fields = [f for f, _ in errs]
    assert {"lora_rank", "stage", "lora_alpah", "fp16"} <= set(fields)
    text = str(SpecError(errs))
    assert text.splitlines()[0] == f"{errs[0][0]}: {errs[0][1]}" and len(text.splitlines()) == len(errs)


def test_yaml_no_means_the_choice_no(files):
    spec = load_spec(None, ["save_strategy=no", "eval_strategy=no"])
    assert spec.save_strategy == "no" and spec.eval_strategy == "no"
    assert spec.to_yaml().count("'no'") == 2


def test_lists_accepted_for_comma_fields(files):
    spec = validate_spec({"lora_target": ["q_proj", "v_proj"], "dataset": ["identity", "alpaca_en_demo"]})
    assert spec.lora_target == "q_proj,v_proj" and spec.dataset_names == ["identity", "alpaca_en_demo"]


# ---------------------------------------------------------------------------------------------- passthrough


def test_training_arguments_keys_pass_through_typed(files):
    spec = validate_spec({"disable_tqdm": "true", "dataloader_num_workers": "2", "save_only_model": True,
                          "include_num_input_tokens_seen": True, "torch_compile": False,
                          "label_names": "labels,extra", "adam_beta2": 0.95, "logging_strategy": "no"})
    assert spec.passthrough == {"disable_tqdm": True, "dataloader_num_workers": 2, "save_only_model": True,
                                "include_num_input_tokens_seen": True, "torch_compile": False,
                                "label_names": ["labels", "extra"], "adam_beta2": 0.95, "logging_strategy": "no"}
    kwargs = spec.training_arguments()
    assert kwargs["dataloader_num_workers"] == 2 and kwargs["disable_tqdm"] is True


def test_passthrough_errors_name_the_key(files):
    m = messages({"dataloader_num_workers": "two", "disable_tqdm": 3, "hub_strategy": "sometimes"})
    assert m["dataloader_num_workers"] == "must be an integer (got 'two')"
    assert m["disable_tqdm"] == "must be true or false (got 3)"
    assert m["hub_strategy"].startswith("must be one of end, every_save") and "(got 'sometimes')" in m["hub_strategy"]


def test_passthrough_table_is_loaded():
    fields = training_args_fields()
    assert "save_strategy" in fields and "disable_tqdm" in fields and "dataloader_num_workers" in fields


# ---------------------------------------------------------------------------------------------- cross-field rules


@pytest.mark.parametrize("data, field, needle", [
    ({"quantization_bit": 4, "finetuning_type": "full"}, "quantization_bit", "QLoRA needs finetuning_type lora: a 4/8-bit base trains only adapters that keep it frozen (got full)"),
    ({"quantization_bit": 8, "finetuning_type": "freeze"}, "quantization_bit", "QLoRA needs finetuning_type lora: a 4/8-bit base trains only adapters that keep it frozen (got freeze)"),
    ({"bf16": True, "fp16": True}, "fp16", "bf16 and fp16 cannot both be true"),
    ({"use_dora": True, "pissa_init": True}, "use_dora", "use_dora and pissa_init cannot be combined"),
    ({"eval_strategy": "steps"}, "eval_strategy", "needs val_size > 0 or an eval_dataset"),
    ({"load_best_model_at_end": True}, "load_best_model_at_end", "needs evaluation"),
    ({"export_format": "gguf", "export_quantization_bit": 4}, "export_quantization_bit", "gguf"),
    ({"adapter_name_or_path": "saves/x", "finetuning_type": "full"}, "adapter_name_or_path", "adapters need finetuning_type lora or oft (got full)"),
    ({"adapter_name_or_path": "saves/x", "finetuning_type": "freeze"}, "adapter_name_or_path", "(got freeze)"),
    ({"use_galore": True}, "use_galore", "GaLore"),
    ({"early_stopping_patience": 2}, "early_stopping_patience", "load_best_model_at_end"),
    ({"stage": "dpo", "dataset": "identity"}, "dataset", "stage dpo needs a ranking dataset"),
    ({"stage": "rm", "dataset": "alpaca_en_demo"}, "dataset", "stage rm needs a ranking dataset"),
    ({"stage": "orpo", "dataset": "kto_en_demo"}, "dataset", "'kto_en_demo' is not one"),
    ({"stage": "kto", "dataset": "dpo_en_demo"}, "dataset", "stage kto needs a dataset with a kto_tag column"),
    ({"stage": "sft", "dataset": "dpo_en_demo"}, "dataset", "'dpo_en_demo' is a ranking dataset"),
    ({"dataset": "identity,alpaca_en_dem"}, "dataset", "'alpaca_en_dem' is not in"),
    ({"eval_dataset": "nope"}, "eval_dataset", "'nope' is not in"),
    ({"template": "qwn"}, "template", "did you mean qwen"),
])
def test_cross_field_rule_fires(files, data, field, needle):
    m = messages(data)
    assert field in m and needle in m[field], m


def test_cross_field_rules_pass_when_satisfied(files):
    validate_spec({"quantization_bit": 4, "finetuning_type": "lora", "bf16": True})
    validate_spec({"eval_strategy": "steps", "val_size": 0.1, "load_best_model_at_end": True, "early_stopping_patience": 2})
    validate_spec({"eval_strategy": "epoch", "eval_dataset": "alpaca_en_demo"})
    validate_spec({"stage": "dpo", "dataset": "dpo_en_demo"})
    validate_spec({"stage": "kto", "dataset": "kto_en_demo"})
    validate_spec({"stage": "pt", "dataset": "c4_demo"})
    validate_spec({"export_format": "gguf", "export_gguf_type": "q8_0"})
    validate_spec({"use_galore": True, "finetuning_type": "full"})
    validate_spec({"template": "llama3"})


def test_unimplemented_stages_are_refused_at_validate(files):
    from backend.stages import STAGES

    for stage in [s for s in STAGES.values() if not s.implemented]:
        why = stage.reason or "it is not implemented yet"
        assert messages({"stage": stage.id})["stage"].startswith(f"stage {stage.id!r}: {why} (available: ")
    assert validate_spec({"stage": "simpo", "dataset": "dpo_en_demo", "pref_loss": "simpo"}).stage == "simpo"


def test_template_error_lists_known_when_nothing_close(files):
    m = messages({"template": "zzzzzzzz"})["template"]
    assert "templates" in m and "known: auto, chatml, default, llama3, qwen, qwen3" in m


def test_dataset_info_missing_or_malformed_names_the_file(files, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    m = messages({"dataset_dir": str(empty)})
    assert m["dataset"] == f"dataset_info.json not found: {empty / 'dataset_info.json'} (set dataset_dir to the folder that holds it)"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "dataset_info.json").write_text('{"identity": {"file_name": "x.json",}\n}')
    m = messages({"dataset_dir": str(bad)})
    assert m["dataset"].startswith(f"malformed {bad / 'dataset_info.json'}: line 1")
    (bad / "dataset_info.json").write_text("[1, 2]")
    assert "top level must be an object" in messages({"dataset_dir": str(bad)})["dataset"]


def test_dataset_dir_relative_resolution(files, tmp_path, monkeypatch):
    # relative to the current directory when it exists there ...
    here = tmp_path / "work"
    (here / "mydata").mkdir(parents=True)
    (here / "mydata" / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "m.json"}}))
    (here / "mydata" / "m.json").touch()
    monkeypatch.chdir(here)
    spec = validate_spec({"dataset_dir": "mydata", "dataset": "mine"})
    assert spec.resolved_dataset_dir() == (here / "mydata").resolve()
    # ... else relative to the repo root (so `dataset_dir: data` works from anywhere)
    spec = RunSpec.model_validate({"dataset_dir": "data"}, context={"check_files": False})
    assert spec.resolved_dataset_dir() == (paths.REPO_ROOT / "data").resolve()


def test_check_files_false_skips_file_checks(files):
    spec = validate_spec({"template": "nope", "dataset": "nope"}, check_files=False)
    assert spec.template == "nope"
    # ... but not the pure rules
    assert "fp16" in dict(errors_of({"bf16": True, "fp16": True}, check_files=False))


def test_rule_not_fired_from_an_invalid_input(files):
    # quantization_bit is invalid, so the QLoRA rule must not also complain through a default.
    m = messages({"quantization_bit": 3, "finetuning_type": "full", "bf16": True, "fp16": True})
    assert m["quantization_bit"].startswith("must be one of") and "fp16" in m


# ---------------------------------------------------------------------------------------------- overrides, YAML


def test_overrides_parse_values():
    assert parse_overrides(["lora_rank=16", "bf16=true", "learning_rate=1e-4", "dataset=a,b",
                            "--lora_alpha=32", "adapter_name_or_path=", "default_system=You are: x",
                            "model_revision=1.0"]) == {
        "lora_rank": 16, "bf16": True, "learning_rate": "1e-4", "dataset": "a,b", "lora_alpha": 32,
        "adapter_name_or_path": None, "default_system": "You are: x", "model_revision": "1.0"}
    with pytest.raises(SpecError) as info:
        parse_overrides(["lora_rank"])
    assert str(info.value) == "lora_rank: override must be key=value"


def test_overrides_apply_on_top_of_file(files, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("lora_rank: 4\nlearning_rate: 1.0e-3\n")
    spec = load_spec(path, ["lora_rank=16", "learning_rate=1e-4", "bf16=true"])
    assert (spec.lora_rank, spec.learning_rate, spec.bf16) == (16, 1e-4, True)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["lora_rnk=3"])
    assert "did you mean 'lora_rank'" in str(info.value)


def test_yaml_round_trip(files):
    run = files / "run"  # resume_from_checkpoint: true needs a checkpoint to resume in output_dir
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "checkpoint-1" / "trainer_state.json").write_text("{}")
    spec = validate_spec({"stage": "pt", "dataset": "c4_demo", "lora_rank": 32, "lora_alpha": 64, "learning_rate": 3e-5,
                          "warmup_ratio": 0.1, "report_to": ["tensorboard"], "default_system": "line one\nline two: yes",
                          "save_steps": 0.25, "quantization_bit": 8, "resume_from_checkpoint": True,
                          "output_dir": str(run), "disable_tqdm": True, "label_names": ["labels"],
                          "identity_author": "1.0"})
    text = spec.to_yaml()
    assert text.startswith("### Model\nmodel_name_or_path: ")
    assert "### TrainingArguments passthrough\ndisable_tqdm: true\n" in text
    assert validate_spec(yaml.safe_load(text)) == spec
    short = spec.to_yaml(include_defaults=False)
    assert "lora_rank: 32" in short and "lora_dropout" not in short and "seed" not in short
    assert validate_spec(yaml.safe_load(short)) == spec


def test_yaml_round_trip_through_file(files, tmp_path):
    spec = RunSpec()
    path = tmp_path / "run_spec.yaml"
    path.write_text(spec.to_yaml())
    assert load_spec(path) == spec


def test_to_yaml_groups_follow_field_order():
    text = RunSpec.model_validate({}, context={"check_files": False}).to_yaml()
    headers = [line for line in text.splitlines() if line.startswith("### ")]
    assert headers == ["### Model", "### Method", "### LoRA", "### OFT", "### Freeze", "### Quantization", "### Data",
                       "### Train", "### Devices and distribution", "### Logging", "### Eval", "### Export",
                       "### Generation"]
    keys = [line.split(":")[0] for line in text.splitlines() if not line.startswith("#")]
    assert keys == [k for k in RunSpec.model_fields if k != "passthrough"]


# ---------------------------------------------------------------------------------------------- load errors


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == f"{path}: spec file not found"


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stage: sft\nlora_rank: 8\n  bad: [1, 2\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (field, message), = info.value.errors
    assert field == str(path) and message.startswith("YAML syntax error at line 3")


def test_non_mapping_top_level(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- stage: sft\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert "top level must be a mapping" in str(info.value) and str(path) in str(info.value)


def test_empty_file_means_defaults(files, tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_spec(path) == RunSpec()


# ---------------------------------------------------------------------------------------------- training_arguments


def test_training_arguments_mapping(files):
    spec = validate_spec({"warmup_ratio": 0.1, "gradient_checkpointing": True, "output_dir": "/tmp/x",
                          "bf16": True, "seed": 7})
    kw = spec.training_arguments()
    assert kw["output_dir"] == "/tmp/x" and kw["bf16"] is True and kw["seed"] == 7
    assert kw["per_device_train_batch_size"] == 2 and kw["gradient_accumulation_steps"] == 4
    known = training_args_fields()
    assert set(kw) <= set(known)
    if "warmup_ratio" in known:
        assert kw["warmup_ratio"] == 0.1
    else:
        assert kw["warmup_steps"] == 0.1  # transformers 5: a fraction below 1
    key = "activation_checkpointing" if "activation_checkpointing" in known else "gradient_checkpointing"
    assert kw[key] is True
    assert validate_spec({"warmup_steps": 20}).training_arguments()["warmup_steps"] == 20  # with a ratio: refused
    assert validate_spec({"gradient_checkpointing": True, "disable_gradient_checkpointing": True}
                         ).training_arguments()[key] is False


# ---------------------------------------------------------------------------------------------- import boundary


def test_spec_imports_no_heavy_libraries():
    code = textwrap.dedent("""
        import sys
        import backend.core.spec as s
        s.RunSpec.model_validate({}, context={"check_files": False}).to_yaml()
        s.spec_fields(include_passthrough=True)
        s.load_spec(None, ["lora_rank=4"], check_files=False).training_arguments()
        heavy = [m for m in ("torch", "transformers", "peft", "trl", "accelerate", "datasets") if m in sys.modules]
        assert not heavy, heavy
        print("clean")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr


def test_duplicate_key_names_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("lora_rank: 8\nstage: sft\nlora_rank: 16\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.errors == [("lora_rank", f"duplicate key in {path} (lines 1 and 3)")]
