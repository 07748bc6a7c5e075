"""`tuneboard validate` refuses what training would reject later (issue 9, item 8): each case is one clear
line naming the field, exit code 1, and no traceback. The checks are plain file checks (no torch), so
the web UI's form refuses the same values before it launches anything."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from backend.cli import main as tuneboard
from backend.core.paths import REPO_ROOT


@pytest.fixture
def data_dir(tmp_path):
    """A dataset_dir whose dataset_info.json registers one file that exists and one that does not."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "dataset_info.json").write_text(json.dumps({"here": {"file_name": "here.json"},
                                                     "gone": {"file_name": "gone.json"}}))
    (d / "here.json").write_text('[{"instruction": "hi", "output": "hello"}]')
    return d


def refusal(capsys, *args: str) -> dict[str, str]:
    """The errors of `tuneboard validate ARGS` as {field: message} (it must refuse, without a traceback)."""
    code = tuneboard(["validate", *args])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("error: invalid run spec") and "Traceback" not in err, err
    return dict(line.strip().split(": ", 1) for line in err.splitlines()[1:])


def test_a_model_path_must_exist_and_hold_a_model(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    assert refusal(capsys, f"model_name_or_path={missing}")["model_name_or_path"] == f"{missing} does not exist"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "not a model folder (no config.json and no .gguf file)" in \
        refusal(capsys, f"model_name_or_path={empty}")["model_name_or_path"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert "is a LoRA adapter, not a model" in refusal(capsys, f"model_name_or_path={adapter}")["model_name_or_path"]
    text = tmp_path / "weights.txt"
    text.write_text("x")
    assert "not a .gguf model file" in refusal(capsys, f"model_name_or_path={text}")["model_name_or_path"]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert tuneboard(["validate", f"model_name_or_path={model}"]) == 0  # a folder with config.json passes


def test_a_registered_dataset_file_must_exist(capsys, data_dir):
    errors = refusal(capsys, f"dataset_dir={data_dir}", "dataset=here,gone")
    assert errors["dataset"] == (f"dataset 'gone': file not found: {data_dir / 'gone.json'} "
                                 f"(file_name in {data_dir / 'dataset_info.json'})")
    assert tuneboard(["validate", f"dataset_dir={data_dir}", "dataset=here"]) == 0


def test_seed_template_and_passthrough_values(capsys, tmp_path):
    assert refusal(capsys, "seed=-1")["seed"] == "must be between 0 and 4294967295 (got -1)"
    for name in ("../../x", "../templates/qwen", "/etc/passwd"):
        assert "is not a template name" in refusal(capsys, f"template={name}")["template"]
    spec = tmp_path / "spec.yaml"
    spec.write_text("passthrough: 5\n")  # a TypeError inside validate before
    assert "passthrough" in refusal(capsys, str(spec))


def test_output_dir_must_be_a_writable_folder(capsys, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert refusal(capsys, f"output_dir={a_file}")["output_dir"] == f"{a_file} is a file, not a folder"
    assert refusal(capsys, f"output_dir={a_file}/run")["output_dir"] == f"cannot create {a_file}/run: {a_file} is a file"
    # a folder nobody may create runs in (root may write almost anywhere, but not into a process's /proc entry)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        where = locked if not os.access(locked, os.W_OK) else "/proc/1"
        message = refusal(capsys, f"output_dir={where}/run")["output_dir"]
        assert message == f"cannot create {where}/run: {where} is not writable"
    finally:
        locked.chmod(0o700)
    assert tuneboard(["validate", f"output_dir={tmp_path / 'new' / 'run'}"]) == 0  # creatable: fine


def test_a_mistake_prints_no_traceback_through_the_real_command(tmp_path):
    """The same through the installed entry point in its own process (what a user runs)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("passthrough: 5\nseed: -1\ntemplate: ../../x\n")
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "validate", str(spec)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert {line.split(":")[0].strip() for line in proc.stderr.splitlines()[1:]} == {"passthrough", "seed", "template"}


@pytest.mark.parametrize("key, value, says", [
    # inf / nan passed validate for every number key: learning_rate=inf trained 2 steps into NaN weights and
    # reported success; the rest stopped after launch (OverflowError) or shard sizes of inf
    ("learning_rate", "inf", "must be a finite number > 0 (got 'inf')"),
    ("num_train_epochs", "inf", "must be a finite number > 0"),
    ("val_size", "inf", "must be a finite number >= 0"),
    ("export_size", "inf", "must be a finite number > 0"),
    ("limit", "inf", "must be a finite number"),
    ("temperature", "nan", "must be a finite number >= 0"),
    ("adam_beta1", "inf", "must be a finite number (got 'inf')"),  # a TrainingArguments passthrough key
    # torch's optimizers and data loader refused these after launch
    ("adam_beta1", "1.5", "must be in [0, 1) (got 1.5)"),
    ("adam_beta2", "1", "must be in [0, 1) (got 1.0)"),
    ("adam_epsilon", "-1", "must be >= 0 (got -1.0)"),
    ("neftune_noise_alpha", "-1", "must be > 0 (leave it out for no noise) (got -1.0)"),
    ("dataloader_num_workers", "-1", "must be >= 0 (got -1)"),
    ("val_size", "2.5", "a fraction below 1 or a whole row count (got 2.5)"),
])
def test_numbers_no_run_can_use_are_refused(capsys, key, value, says):
    assert says in refusal(capsys, f"{key}={value}")[key]


def test_numbers_in_range_pass(capsys):
    assert tuneboard(["validate", "val_size=3", "adam_beta1=0", "adam_epsilon=0", "neftune_noise_alpha=5",
                      "learning_rate=1e-3"]) == 0


def test_yaml_aliases_are_not_expanded(capsys, tmp_path):
    """A 'billion laughs' spec (9 levels of 9 aliases, 1 KB) took 5.5 GB and never returned; a flat spec has no
    use for aliases. A long value is shown cut, so the error stays one readable line."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
    (tmp_path / "laughs.yaml").write_text("\n".join(lines) + "\n")
    assert refusal(capsys, str(tmp_path / "laughs.yaml"))[str(tmp_path / "laughs.yaml")] == (
        "line 2: a YAML alias (*name): a run spec is read without them, write the value out")
    said = refusal(capsys, "learning_rate=" + "x" * 100_000)["learning_rate"]
    assert said.endswith("... (100002 characters))") and len(said) < 300


def test_an_unknown_option_is_named_as_one(capsys):
    """`tuneboard train --bogus` said "--bogus: spec file not found"."""
    for command in ("train", "validate", "eval", "export"):
        assert tuneboard([command, "--bogus", "max_steps=2"]) != 0
        assert capsys.readouterr().err.strip() == ("error: unknown option --bogus: this command takes [SPEC.yaml] "
                                                   "[key=value ...] (see its --help)")
    assert tuneboard(["validate", "--max_steps=2"]) == 0  # an override written as an option still is one


def test_a_checkpoint_resumed_with_another_rank_or_method_is_refused(capsys, tmp_path):
    """Resumed with lora_rank 16, a rank-8 checkpoint failed after launch with one 'size mismatch' line per adapter
    matrix (420 for the default model); with finetuning_type freeze, it found no model weights to load."""
    ckpt = tmp_path / "run" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    out = f"output_dir={tmp_path / 'again'}"
    said = refusal(capsys, f"resume_from_checkpoint={ckpt}", "lora_rank=16", out)["resume_from_checkpoint"]
    assert said == f"{ckpt} was trained with lora_rank 8 (its adapter_config.json) and this spec says 16: resume " \
                   "with the run's own lora_rank"
    said = refusal(capsys, f"resume_from_checkpoint={ckpt}", "finetuning_type=freeze", out)["resume_from_checkpoint"]
    assert said.startswith(f"{ckpt} holds an adapter (adapter_config.json), and this spec trains finetuning_type freeze")
    assert tuneboard(["validate", f"resume_from_checkpoint={ckpt}", "lora_rank=8", out]) == 0


def test_a_lora_rank_above_the_models_width_is_refused(capsys):
    """lora_rank 100000 on the default model (hidden size 576) took all the memory and was killed after ~60 s."""
    assert refusal(capsys, "lora_rank=100000")["lora_rank"] == (
        "100000 is above the model's hidden size 576: an adapted layer's update has rank 576 at most, a larger rank "
        "only costs memory")
    assert tuneboard(["validate", "lora_rank=576"]) == 0
    assert tuneboard(["validate", "lora_rank=100000", "finetuning_type=freeze"]) == 0  # no adapter: no rank


def test_train_refuses_a_spec_with_no_dataset_before_launch(capsys, tmp_path):
    """`dataset:` left empty passed validate (export and chat specs need none) and the run stopped after launch with
    "'NoneType' object is not iterable". The Train tab's checks are the same function (webui/form.check)."""
    assert tuneboard(["train", "dataset=", "max_steps=1", f"output_dir={tmp_path / 'run'}"]) == 1
    assert capsys.readouterr().err.strip() == ("error: dataset: empty: name the registered dataset(s) to train on "
                                               "(comma-separated), e.g. identity")
    assert not (tmp_path / "run").exists()
    from webui.form import check

    spec, errors = check({"dataset": None, "max_steps": 1}, [])
    assert spec is None and errors == [("dataset", "empty: name the registered dataset(s) to train on "
                                                   "(comma-separated), e.g. identity")]
    assert tuneboard(["validate", "dataset="]) == 0  # a spec for export or chat needs no dataset


# --- values that passed validate and stopped the run after launch (a CLI bug hunt on the default model, 2026-12-07)

def test_optim_args_is_key_value_pairs_the_optimizer_reads(capsys):
    """optim_args foo stopped the run when the optimizer was made ("not enough values to unpack (expected 2, got
    1)"); sgd given foo=1 trained as if it were not there."""
    assert refusal(capsys, "optim_args=foo")["optim_args"] == (
        "not supported: optim adamw_torch reads no optim_args: drop the key, or pick an optimizer that reads it (sgd, "
        "adagrad, rmsprop, ademamix, ...)")
    assert refusal(capsys, "optim=sgd", "optim_args=foo")["optim_args"] == (
        "comma-separated key=value pairs, e.g. momentum=... (got 'foo'; optim sgd takes momentum, dampening, "
        "weight_decay, nesterov)")
    assert refusal(capsys, "optim=sgd", "optim_args=foo=1")["optim_args"] == (
        "optim sgd takes no 'foo' (it takes momentum, dampening, weight_decay, nesterov)")
    assert tuneboard(["validate", "optim=sgd", "optim_args=momentum=0.9,nesterov=true"]) == 0


def test_accelerator_config_is_a_mapping_or_a_json_file_of_one(capsys, tmp_path):
    """A path to a file that did not exist stopped the run after launch ("No such file or directory")."""
    missing = tmp_path / "missing.json"
    assert refusal(capsys, f"accelerator_config={missing}")["accelerator_config"] == (
        f"file not found: {missing} (a JSON file of accelerate's settings, a mapping of them, or leave the key out)")
    yaml_file = tmp_path / "accelerate.yaml"
    yaml_file.write_text("even_batches: true\n")
    assert refusal(capsys, f"accelerator_config={yaml_file}")["accelerator_config"].startswith(
        f"{yaml_file} is not valid JSON: Expecting value: line 1 column 1")
    good = tmp_path / "accelerate.json"
    good.write_text('{"even_batches": true}')
    assert tuneboard(["validate", f"accelerator_config={good}"]) == 0
    assert tuneboard(["validate", "accelerator_config={even_batches: true}"]) == 0  # the mapping itself


def test_checkpoint_kwargs_are_a_mapping_or_its_json_string(capsys, tmp_path):
    """gradient_checkpointing_kwargs junk stopped the run at its first step ("dictionary update sequence element #0
    has length 1; 2 is required"). The mapping, and the same as a JSON string in YAML quotes (TrainingArguments parses
    it; a run with it trained), pass."""
    assert refusal(capsys, "gradient_checkpointing_kwargs=junk")["gradient_checkpointing_kwargs"] == (
        "a mapping of torch.utils.checkpoint's arguments, e.g. {\"use_reentrant\": false} (got 'junk')")
    spec = tmp_path / "spec.yaml"
    spec.write_text("gradient_checkpointing_kwargs: '{use_reentrant: false}'\n")  # YAML's flow style is not JSON
    assert refusal(capsys, str(spec))["gradient_checkpointing_kwargs"].startswith(
        "not a JSON object: Expecting property name enclosed in double quotes")
    spec.write_text("gradient_checkpointing_kwargs: '{\"use_reentrant\": false}'\n")
    assert tuneboard(["validate", str(spec)]) == 0
    assert tuneboard(["validate", "gradient_checkpointing_kwargs={use_reentrant: false}"]) == 0


@pytest.mark.parametrize("stage, entry, files, says", [
    ("sft", {"file_name": "x.yaml"}, {"x.yaml": "- instruction: hi\n  output: hello\n"},
     "{d}/x.yaml: unsupported file type '.yaml' (supported: .json, .jsonl, .csv, .parquet, .arrow, .txt)"),
    ("sft", {"file_name": "rows"}, {"rows/notes.md": "hi\n"},
     "folder {d}/rows has no data files (.json, .jsonl, .csv, .parquet, .arrow, .txt)"),
    ("sft", {"file_name": "x.txt"}, {"x.txt": "hello\n"},
     "{d}/x.txt is read as one column, text (a row a line), and stage sft reads the entry's 'instruction' and "
     "'output' columns: save the rows as .json, .jsonl, .csv or .parquet (stage pt takes a .txt file, with "
     "\"columns\": {\"prompt\": \"text\"})"),
    ("pt", {"file_name": "x.txt"}, {"x.txt": "hello\n"},
     "{d}/x.txt is read as one column, text (a row a line), and its entry reads 'instruction': set \"columns\": "
     "{\"prompt\": \"text\"} in {d}/dataset_info.json"),
    ("pt", {"file_name": "x.txt", "columns": {"prompt": "text"}}, {"x.txt": "hello\n"}, None),
    ("pt", {"file_name": "rows", "columns": {"text": "text"}}, {"rows/a.txt": "hello\n", "rows/b.md": "x"}, None),
    ("sft", {"file_name": "x.jsonl"}, {"x.jsonl": '{"instruction": "hi", "output": "hello"}\n'}, None),
])
def test_a_dataset_file_the_loader_cannot_read_is_refused(capsys, tmp_path, stage, entry, files, says):
    """A dataset registered with a .yaml file, a folder of none it reads or a .txt file for sft passed validate and
    stopped the run after launch, when the loader read it; validate now says what the loader says, and what it
    passes, the loader loads."""
    from backend.core.dataset_info import DatasetError
    from backend.dataprep.data import load_examples

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": entry}))
    args = [f"dataset_dir={tmp_path}", "dataset=mine", f"stage={stage}"]
    if says is None:
        assert tuneboard(["validate", *args]) == 0
        assert load_examples("mine", tmp_path, stage=stage)[0]
    else:
        assert refusal(capsys, *args)["dataset"] == "dataset 'mine': " + says.replace("{d}", str(tmp_path))
        with pytest.raises(DatasetError):
            load_examples("mine", tmp_path, stage=stage)


def test_an_output_dir_that_is_not_utf8_is_refused(capsys, tmp_path):
    """A byte that is not UTF-8 in output_dir (Python reads it from the command line as a lone surrogate) passed
    validate, and `tuneboard train` stopped with a traceback at its first write (status.json: "surrogates not
    allowed")."""
    assert refusal(capsys, f"output_dir={tmp_path}/run\udcff")["output_dir"] == (
        f"{tmp_path}/run\\xff is not UTF-8 text: the run writes the folder's name into its status.json as UTF-8 (its "
        "first write stopped on it): name the folder in UTF-8")
    assert tuneboard(["train", f"output_dir={tmp_path}/run\udcff", "max_steps=1"]) == 1
    assert "output_dir: " in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert tuneboard(["validate", f"output_dir={tmp_path}/rün"]) == 0


def test_limit_is_a_whole_count_or_a_share_below_one(capsys):
    """limit=1.5 was accepted (lm-eval then scored 1 question); the README says a whole count or a share below 1."""
    task = str(REPO_ROOT / "data" / "lm_eval_tasks" / "tuneboard_mc.yaml")
    assert refusal(capsys, f"tasks={task}", "limit=1.5")["limit"] == ("1.5: give a whole number of questions (e.g. 1) "
                                                                      "or a share of each task below 1 (e.g. 0.5)")
    for fine in ("limit=2", "limit=0.5"):
        assert tuneboard(["validate", f"tasks={task}", fine]) == 0, capsys.readouterr().err
