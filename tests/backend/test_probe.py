"""`tuneboard probe`: the spec trained for 2 steps with its longest rows first, in a temporary folder, measured
(issue 10, "Memory you can trust"). One probe run per module on the tiny Llama, asserted several ways."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SHORT, LONG = 20, 2  # short rows and rows longer than the cutoff (the probe must take these first)


def write_dataset(folder: Path) -> None:
    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}."} for i in range(SHORT)]
    rows[5:5] = [{"instruction": "Count.", "input": "", "output": " ".join(["one two three"] * 80)}]
    rows[15:15] = [{"instruction": "Count again.", "input": "", "output": " ".join(["four five six"] * 80)}]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.json").write_text(json.dumps(rows), encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"mixed": {"file_name": "rows.json"}}), encoding="utf-8")


def probe_args(model, data: Path, out: Path, *extra: str) -> list[str]:
    return [f"model_name_or_path={model}", "template=llama3", "dataset=mixed", f"dataset_dir={data}",
            "cutoff_len=128", "per_device_train_batch_size=2", "gradient_accumulation_steps=3", "num_train_epochs=1",
            "lora_rank=4", f"output_dir={out}", *extra]


@pytest.fixture(scope="module")
def probed(tiny_llama, tmp_path_factory):
    """One probe with a far too small memory limit (1 MiB: it cannot fit, the suggestions must come)."""
    tmp = tmp_path_factory.mktemp("probe")
    write_dataset(tmp / "data")
    cache, out, result_file = tmp / "cache", tmp / "user_run", tmp / "result" / "probe.json"
    env = dict(os.environ, TUNEBOARD_CACHE=str(cache))
    argv = [sys.executable, "-m", "backend.cli", "probe", "--available-mib", "1", "--out", str(result_file),
            *probe_args(tiny_llama, tmp / "data", out, "gradient_checkpointing=false")]
    proc = subprocess.run(argv, cwd="/tmp", env=env, capture_output=True, text=True, timeout=600)
    result = json.loads(result_file.read_text())
    return {"proc": proc, "result": result, "cache": cache, "out": out, "model": Path(tiny_llama)}


def test_probe_measures_the_spec(probed):
    r, proc = probed["result"], probed["proc"]
    assert r["state"] == "completed", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout[proc.stdout.index("{"):]) == r  # the JSON on stdout is the --out file
    model_bytes = (probed["model"] / "model.safetensors").stat().st_size
    assert r["peak_rss_mib"] * 2**20 > model_bytes
    assert r["baseline_mib"] is not None and 0 < r["baseline_mib"] <= r["peak_rss_mib"]
    assert r["steps_measured"] == 2 and r["s_per_step"] > 0
    # 22 rows, batch 2, accumulation 3, one epoch: ceil(11 / 3) = 4 optimizer steps in the real run
    assert r["rows"] == SHORT + LONG and r["total_steps"] == 4
    # projected_total_s is rounded to 0.1 s (a fast CI step: 0.06 s x 4 = 0.24 -> 0.2)
    assert math.isclose(r["projected_total_s"], r["s_per_step"] * 4, rel_tol=0.01, abs_tol=0.051)
    assert r["machine_total_mib"] > 0 and r["available_mib"] == 1


def test_probe_runs_the_longest_rows_first(probed):
    """Both rows longer than the cutoff (truncated to 128) are the first batch, although the data has them at
    positions 5 and 16 of 22: shuffled, they would be the first batch of 2 once in 231 runs."""
    assert probed["result"]["first_batch_lengths"] == [128, 128]


def test_probe_folder_is_temporary_and_never_the_users(probed):
    r = probed["result"]
    probe_dir = Path(r["probe_dir"])
    assert probe_dir.is_relative_to(probed["cache"]) and not probe_dir.exists()
    assert not probed["out"].exists()  # the user's output_dir was not created, let alone written


def test_probe_suggests_what_to_change_when_it_does_not_fit(probed):
    r = probed["result"]
    assert r["fits"] is False
    changes = [s["change"] for s in r["suggestions"]]
    assert {"gradient_checkpointing": True} in changes
    # a smaller batch keeps the effective batch (2 x 3 = 1 x 6)
    assert {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 6} in changes
    assert {"quantization_bit": 4} in changes
    for s in r["suggestions"]:
        assert 0 < s["peak_mib"] < r["peak_rss_mib"] and s["fits"] is False  # 1 MiB fits nothing


def test_suggestions_project_from_the_measurement():
    """4,000 of the 5,000 MiB came with training: half the batch (or the cutoff) halves that part."""
    from backend.training.probe import suggestions
    from backend.core.spec import load_spec

    spec = load_spec(None, ["model_name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct", "dataset=identity", "cutoff_len=1024",
                            "per_device_train_batch_size=4", "gradient_accumulation_steps=2"])
    measured = {"peak_mib": 5000.0, "baseline_mib": 1000.0, "frozen_weights_mib": 500.0, "params": 135e6,
                "first_batch_lengths": [1024, 1000, 900, 800]}
    got = [(s["change"], s["peak_mib"], s["fits"]) for s in suggestions(spec, measured, available_mib=3000)]
    assert got == [
        ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, 3000.0, False),
        ({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}, 2000.0, True),
        ({"quantization_bit": 4}, round(5000 - 500 + 135e6 * 0.55 / 2**20, 1), False),
        ({"cutoff_len": 512}, 3000.0, False),
        ({"cutoff_len": 256}, 2000.0, True),
    ]  # checkpointing is on already (the default): not suggested
    assert suggestions(spec, measured, available_mib=10**6)[0]["fits"] is True


def test_probe_of_a_bad_spec_says_why(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "probe", "model_name_or_path=/nonexistent",
                           "dataset=identity", "lora_rankk=4"], cwd="/tmp", capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TUNEBOARD_CACHE=str(tmp_path)))
    assert proc.returncode == 1
    assert "lora_rankk" in proc.stderr and "Traceback" not in proc.stderr


def test_a_spec_that_saves_evaluates_and_picks_the_best_is_probed_without_them(tiny_llama, tmp_path):
    """The probe saves and evaluates nothing: a spec with a task metric, the best checkpoint, step-wise evaluation and
    saves (the form's preset saves every 10 steps, keeping 2) is probed with those keys at their defaults, which
    validate accepts (they were left set, and the probe refused: 'metric_for_best_model: only used with
    load_best_model_at_end', 'save_total_limit: save_strategy no saves no checkpoints', ...)."""
    from backend.core.spec import validate_spec
    from backend.training.probe import probe_spec

    write_dataset(tmp_path / "data")
    user = validate_spec({**dict(a.split("=", 1) for a in probe_args(tiny_llama, tmp_path / "data", tmp_path / "run")),
                          "val_size": 0.2, "eval_strategy": "steps", "eval_steps": 2, "eval_metric": "rouge_l",
                          "load_best_model_at_end": True, "metric_for_best_model": "rouge_l", "save_steps": 2,
                          "save_total_limit": 2, "eval_accumulation_steps": 2, "early_stopping_patience": 2,
                          "lr_scheduler_type": "reduce_lr_on_plateau"})
    probe = probe_spec(user, tmp_path / "probe", 3)
    assert (probe.output_dir, probe.max_steps, probe.save_strategy, probe.eval_strategy) == (
        str(tmp_path / "probe"), 3, "no", "no")
    assert probe.eval_metric is None and not probe.load_best_model_at_end and probe.val_size == 0
    assert "eval_accumulation_steps" not in probe.passthrough and probe.lr_scheduler_type == "constant"
    assert (probe.lora_rank, probe.cutoff_len, probe.per_device_train_batch_size) == (4, 128, 2)  # the run's own


def test_probe_options_that_cannot_work_are_one_line_before_it_trains(tmp_path, capsys):
    """--out under a file ran the whole probe, then raised FileExistsError with a traceback; --steps 0 and a
    negative --available-mib were taken silently."""
    from backend.training.probe import main

    (tmp_path / "afile").write_text("x")
    cases = {("--steps", "0"): "error: --steps must be >= 1 (got 0)",
             ("--available-mib", "-5"): "error: --available-mib must be > 0 (got -5)",
             ("--out", str(tmp_path / "afile" / "x.json")): f"error: --out {tmp_path / 'afile' / 'x.json'}: "
                                                            f"{tmp_path / 'afile'} is a file, not a folder",
             ("--out", str(tmp_path)): f"error: --out {tmp_path} is a folder: give a file name for the JSON result"}
    for args, said in cases.items():
        assert main([*args, "max_steps=2"]) == 2
        assert capsys.readouterr().err.strip() == said
