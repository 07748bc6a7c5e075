"""tuneboard distill refuses up front, before any teacher request (a paid API call in real use): the run spec
step train will build (train_args on top of the derived SFT spec, validated as `tuneboard train` validates it),
and a dataset_dir it could not create without making every missing folder above it. No spec that would work
is refused: the dataset generate registers does not exist yet when the check runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_teacher import KEY, TASK, FakeTeacher, distill_flat

from backend.distill.spec import DistillSpecError, validate_distill

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def teacher():
    server = FakeTeacher("valid", key=KEY).start()
    yield server
    server.stop()


@pytest.fixture
def flat(tmp_path, tiny_qwen2, teacher, monkeypatch):
    monkeypatch.setenv("FAKE_TEACHER_KEY", KEY)
    return distill_flat(tmp_path, teacher, tiny_qwen2, max_retries=0)


def errors(flat: dict, **data) -> dict:
    with pytest.raises(DistillSpecError) as exc:
        validate_distill({**flat, **data})
    return dict(exc.value.errors)


def distill_cli(flat: dict) -> subprocess.CompletedProcess:
    args = [f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in flat.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "backend.cli", "distill", *args], cwd="/tmp", capture_output=True,
                          text=True, timeout=600, env=env)


# ------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("train_args, key, said", [
    ({"max_steps": -5}, "train_args.max_steps", "must be >= -1"),
    ({"num_train_epochs": ".inf"}, "train_args.num_train_epochs", "finite"),
    # the train step's folder is <output_dir>/train (the score step reads the adapter there): not a train_arg
    ({"output_dir": "FILE"}, "train_args.output_dir", "the train step's folder is <output_dir>/train"),
])
def test_a_bad_train_arg_is_refused_before_any_teacher_request(flat, teacher, tmp_path, train_args, key, said):
    if train_args.get("output_dir") == "FILE":
        (tmp_path / "a_file").write_text("x")
        train_args = {"output_dir": str(tmp_path / "a_file")}
    if train_args.get("num_train_epochs") == ".inf":
        train_args = {"num_train_epochs": float("inf")}
    text = "{" + ", ".join(f"{k}: {'.inf' if v == float('inf') else v}" for k, v in train_args.items()) + "}"
    proc = distill_cli({**flat, "steps": "generate,train", "train_args": text})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert teacher.requests == []
    said_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said_lines) == 1 and said_lines[0].startswith(f"error: {key}: ") and said in said_lines[0], proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_a_dataset_dir_under_a_missing_folder_is_refused_before_any_teacher_request(flat, teacher, tmp_path):
    missing = tmp_path / "nowhere" / "data"
    proc = distill_cli({**flat, "dataset_dir": str(missing)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert teacher.requests == []
    said_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said_lines) == 1 and said_lines[0].startswith("error: dataset_dir: "), proc.stderr
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------- in process
def test_the_train_spec_errors_name_their_distill_key(flat, tmp_path):
    train = {"steps": "generate,train"}
    assert "must be >= -1" in errors(flat, **train, train_args={"max_steps": -5})["train_args.max_steps"]
    assert "finite" in errors(flat, **train, train_args={"num_train_epochs": float("inf")})["train_args.num_train_epochs"]
    assert "unknown template" in errors(flat, **train, train_args={"template": "nope"})["train_args.template"]
    # the distilled dataset is an alpaca one: a stage that needs pairs cannot train on it
    assert "ranking" in errors(flat, **train, train_args={"stage": "dpo"})["train_args.stage"]
    # a key of the distill spec that the train spec takes is named by its distill name
    assert "unknown template" in errors(flat, **train, template="nope")["template"]
    # the field checks hold without the file checks too (the UI reading a run folder's spec)
    with pytest.raises(DistillSpecError, match="train_args.max_steps"):
        validate_distill({**flat, **train, "train_args": {"max_steps": -5}}, check_files=False)
    # only with step train
    validate_distill({**flat, "steps": "generate", "train_args": {"max_steps": -5}})


def test_no_false_refusal_before_the_dataset_exists(flat, tmp_path):
    """The dataset step generate will register is not there yet (a fresh dataset_dir, or one that holds other
    datasets): a spec that would train is accepted, its eval split named too."""
    args = {"max_steps": 2, "logging_steps": 1, "lora_rank": 4, "plot_loss": False}
    validate_distill({**flat, "steps": "generate,train,score", "train_args": args})
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.json").write_text(json.dumps([{"instruction": "i", "input": "", "output": "o"}]))
    (other / "dataset_info.json").write_text(json.dumps({"x": {"file_name": "x.json"}}))
    validate_distill({**flat, "dataset_dir": str(other), "steps": "generate,train",
                      "train_args": {**args, "eval_dataset": "facts_eval", "eval_strategy": "steps",
                                     "eval_steps": 1}})
    # another registered dataset next to the distilled one: its own checks still hold
    validate_distill({**flat, "dataset_dir": str(other), "steps": "generate,train", "train_args": {"dataset": "facts,x"}})
    validate_distill({**flat, "dataset_dir": str(other), "steps": "generate,train", "train_args": {"dataset": "x"}})
    (other / "x.json").unlink()
    assert "file not found" in errors(flat, dataset_dir=str(other), steps="generate,train",
                                      train_args={"dataset": "x"})["train_args.dataset"]


def test_step_train_alone_checks_the_dataset_generate_registered(flat, tmp_path):
    """Without step generate the dataset must be there already, with the cutoff_len the train step will use."""
    data, out = tmp_path / "data", tmp_path / "run"
    train = {**flat, "steps": "train"}
    assert "dataset_info.json not found" in errors(train)["dataset_name"]
    data.mkdir()
    (data / "facts.json").write_text(json.dumps([{"instruction": TASK, "input": "c", "output": "{}"}]))
    (data / "dataset_info.json").write_text(json.dumps({"facts": {"file_name": "facts.json"}}))
    out.mkdir()
    (out / "progress.json").write_text(json.dumps({"dataset": {"name": "facts", "cutoff_len": 64}}))
    validate_distill(train)


def test_the_train_step_runs_the_arguments_that_were_checked(flat):
    """One function builds the `tuneboard train` arguments for the check and for the step (no drift), and the
    web UI still finds train_overrides in the pipeline."""
    from backend.core.spec import parse_overrides, validate_spec
    from backend.distill import pipeline
    from backend.distill.spec import train_cli_args

    spec = validate_distill({**flat, "steps": "generate,train", "train_args": {"max_steps": 2}})
    args = train_cli_args(spec, {"cutoff_len": 64}, Path(flat["output_dir"]) / "train")
    assert "max_steps=2" in args and "cutoff_len=64" in args and "overwrite_output_dir=true" in args
    assert validate_spec(parse_overrides(args), check_files=False).max_steps == 2
    assert pipeline.train_overrides(spec, None)["dataset"] == "facts"
    assert "train_cli_args(spec, dataset, out)" in Path(pipeline.__file__).read_text()


def test_generate_refuses_a_dataset_dir_under_a_missing_folder_before_asking(flat, teacher, tmp_path):
    from backend.core.rundir import RunDir
    from backend.distill import DistillError
    from backend.distill.pipeline import generate

    spec = validate_distill({**flat, "dataset_dir": str(tmp_path / "nowhere" / "data")})
    run_dir = RunDir(spec.resolved_output_dir())
    run_dir.start()
    try:
        with pytest.raises(DistillError, match=r"^dataset_dir: .*nowhere/data does not exist, nor does its parent"):
            generate(spec, run_dir, stop=lambda: False)
    finally:
        run_dir.close()
    assert teacher.requests == [] and not (tmp_path / "nowhere").exists()
