"""tuneboard eval checkpoints=... (backend/evaluation/checkpoint_eval.py) on a real tiny LoRA run with two checkpoints: one
result per checkpoint and the final adapter, the same numbers as a plain `tuneboard eval` of one checkpoint, the
base model loaded once, a STOP between checkpoints, and the refusals (one line each)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.evaluation import checkpoint_eval, evaluate
from backend.evaluation import predict as prediction
from backend.core.checkpoint_pick import CheckpointChoiceError, available, pick
from backend.core.rundir import CHECKPOINT_EVAL_FILE, EVAL_RESULTS_FILE, PREDICTIONS_FILE, STATUS_FILE, STOP_FILE
from backend.core.spec import SpecError, load_spec, validate_spec

TUNEBOARD = [sys.executable, "-m", "backend.cli"]
ROWS = ["dataset=identity", "max_samples=3", "max_new_tokens=8", "do_sample=false"]


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(TUNEBOARD + ["eval", *args], cwd="/tmp", capture_output=True, text=True, timeout=600)


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.slow
def test_every_checkpoint_and_the_final_on_the_same_rows(lora_checkpoints_run, tiny_qwen2, tmp_path):
    run = lora_checkpoints_run
    out = tmp_path / "all"
    proc = _eval(f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={run}", "checkpoints=all",
                 f"output_dir={out}", *ROWS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _read(out / CHECKPOINT_EVAL_FILE)
    entries = report["checkpoints"]
    assert [e["checkpoint"] for e in entries] == ["checkpoint-2", "checkpoint-4", "final"]
    assert [e["step"] for e in entries] == [2, 4, 4]
    assert all(e["predict_rows"] == 3 and e["eval_loss"] > 0 for e in entries)
    assert entries[0]["eval_loss"] != entries[1]["eval_loss"]  # two steps of training apart
    for name in ("checkpoint-2", "checkpoint-4", "final"):
        assert len((out / name / PREDICTIONS_FILE).read_text().splitlines()) == 3
    # the best per metric is the entry with the lowest loss / the highest score
    assert report["best"]["eval_loss"]["value"] == min(e["eval_loss"] for e in entries)
    assert report["best"]["predict_rouge-l"]["value"] == max(e["predict_rouge-l"] for e in entries)
    status = _read(out / STATUS_FILE)
    assert status["state"] == "completed" and status["step"] == status["total_steps"] == 9

    # a plain eval of checkpoint-2 alone (the adapter merged into the base, as chat and export load it): the same
    single = tmp_path / "single"
    proc = _eval(f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={run}/checkpoint-2",
                 f"output_dir={single}", *ROWS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alone = _read(single / EVAL_RESULTS_FILE)
    assert entries[0]["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-4)
    assert entries[0]["eval_tokens"] == alone["eval_tokens"]
    for key in ("predict_bleu-4", "predict_rouge-l", "predict_exact_match"):
        assert entries[0][key] == pytest.approx(alone[key], abs=1e-6), key
    # the top-level results are the final adapter's, as `tuneboard eval` of the run folder writes them
    top = _read(out / EVAL_RESULTS_FILE)
    assert top["checkpoint"] == "final" and top["eval_loss"] == entries[-1]["eval_loss"]


@pytest.mark.slow
def test_a_list_of_names_one_base_and_a_stop(lora_checkpoints_run, tiny_qwen2, tmp_path, monkeypatch):
    """checkpoints=final,4,checkpoint-2 evaluates those in step order on one loaded base model (the adapters are
    swapped on it); a STOP file that appears once the second one is scored ends the eval before the third: exit
    130, the two reported, status aborted."""
    out = tmp_path / "stopped"
    real_predict, real_load = prediction.predict, checkpoint_eval.load_model
    models, loads = [], []

    def then_stop(model, *args, **kwargs):
        models.append(model)
        result = real_predict(model, *args, **kwargs)
        if len(models) == 2:
            (out / STOP_FILE).write_text("stop\n")
        return result

    def counted(*args, **kwargs):
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(prediction, "predict", then_stop)
    monkeypatch.setattr(checkpoint_eval, "load_model", counted)
    spec = load_spec(None, [f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={lora_checkpoints_run}",
                            "checkpoints=final,4,checkpoint-2", f"output_dir={out}", *ROWS])
    assert evaluate.run(spec) == 130
    assert len(loads) == 1 and len(models) == 2 and models[0] is models[1]
    report = _read(out / CHECKPOINT_EVAL_FILE)
    assert report["asked"] == ["checkpoint-2", "checkpoint-4", "final"]
    assert [e["checkpoint"] for e in report["checkpoints"]] == ["checkpoint-2", "checkpoint-4"]
    assert report["checkpoints"][0]["eval_loss"] != report["checkpoints"][1]["eval_loss"]
    assert report["stopped"] == "STOP file found"
    assert _read(out / STATUS_FILE)["state"] == "aborted"


@pytest.mark.slow
def test_refusals_one_line_each(lora_checkpoints_run, tiny_qwen2, tmp_path):
    run = lora_checkpoints_run
    # an adapter folder without checkpoints (the CLI: one line naming the key, nothing written)
    plain = tmp_path / "plain"
    shutil.copytree(run / "checkpoint-2", plain, ignore=shutil.ignore_patterns("trainer_state.json"))
    proc = _eval(f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={plain}", "checkpoints=all",
                 f"output_dir={tmp_path / 'out'}", *ROWS)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if "checkpoints" in line]
    assert len(lines) == 1 and "holds no checkpoint-N folders" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()

    def refused(**keys) -> str:
        with pytest.raises(SpecError) as info:
            validate_spec({"model_name_or_path": str(tiny_qwen2), "dataset": "identity", **keys})
        found = [m for f, m in info.value.errors if f == "checkpoints"]
        assert len(found) == 1, info.value.errors
        return found[0]

    assert "checkpoint-7 is not a checkpoint of" in refused(adapter_name_or_path=str(run), checkpoints="checkpoint-7")
    assert "(it has checkpoint-2, checkpoint-4, final)" in refused(adapter_name_or_path=str(run), checkpoints="7")
    assert "is one checkpoint" in refused(adapter_name_or_path=str(run / "checkpoint-2"), checkpoints="all")
    assert "one training run folder" in refused(checkpoints="all")
    # a checkpoint cut short (no trainer_state.json)
    cut = Path(shutil.copytree(run, tmp_path / "cut"))
    (cut / "checkpoint-4" / "trainer_state.json").unlink()
    assert "checkpoint-4 of" in refused(adapter_name_or_path=str(cut), checkpoints="checkpoint-4")
    assert [c.name for c in pick(cut, "all")] == ["checkpoint-2", "final"]
    assert available(cut) == ["checkpoint-2", "final"]
    # a checkpoint whose weights are cut short: refused up front, named (the eval stopped after the ones before it
    # with "SafetensorError: invalid header length", naming none)
    weights = cut / "checkpoint-2" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    said = refused(adapter_name_or_path=str(cut), checkpoints="all")
    assert said.startswith(f"checkpoint-2 of {cut} cannot be loaded: {weights} is truncated"), said
    # a full-weights run: its checkpoints are whole models
    full = tmp_path / "full"
    shutil.copytree(tiny_qwen2, full / "checkpoint-2")
    (full / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (full / "run_spec.yaml").write_text("finetuning_type: full\n")
    with pytest.raises(CheckpointChoiceError, match="is a full run: its checkpoints are whole models"):
        pick(full, "all")
    # with another eval part that runs on one adapter
    assert "do_judge runs on one adapter" in refused(adapter_name_or_path=str(run), checkpoints="all", do_judge=True,
                                                     judge_url="http://127.0.0.1:9/v1", judge_model="m")
    # tuneboard train has no use for it
    proc = subprocess.run(TUNEBOARD + ["train", f"model_name_or_path={tiny_qwen2}", "dataset=identity",
                                       f"adapter_name_or_path={run}", "checkpoints=all",
                                       f"output_dir={tmp_path / 'train'}"],
                          cwd="/tmp", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: checkpoints:"), proc.stderr


def test_pick_on_a_run_folder_written_by_hand(tmp_path):
    """checkpoint_pick alone (fast tier): names in step order, final last, "N" for checkpoint-N, the kept final
    after a promote, and the refusals."""
    run = tmp_path / "run"
    for step in (10, 2):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (run / "checkpoint-12").mkdir()  # cut short: no trainer_state.json
    (run / "checkpoint-12" / "adapter_config.json").write_text("{}")
    assert available(run) == ["checkpoint-2", "checkpoint-10"]  # no final adapter yet
    (run / "adapter_config.json").write_text("{}")
    (run / "status.json").write_text(json.dumps({"step": 12}))
    assert [(c.name, c.step) for c in pick(run, "all")] == [("checkpoint-2", 2), ("checkpoint-10", 10), ("final", 12)]
    assert [c.name for c in pick(run, "final, 10,checkpoint-2,10")] == ["checkpoint-2", "checkpoint-10", "final"]
    assert pick(run, "final")[0].folder == run
    for wanted, words in (("checkpoint-12", "checkpoint-12 of"), ("3", "checkpoint-3 is not a checkpoint"),
                          ("", "give all, or checkpoint-N names")):
        with pytest.raises(CheckpointChoiceError, match=words):
            pick(run, wanted)
    with pytest.raises(CheckpointChoiceError, match="set adapter_name_or_path to one training run folder"):
        pick(f"{run},{run}", "all")


def test_a_final_loaded_from_a_checkpoint_is_labelled_by_it(tmp_path):
    """load_best_model_at_end ends a run on its best checkpoint's weights: `all` scored that checkpoint and "final"
    (the same weights) labelled with status.json's last step, so checkpoint_eval.json showed two values at that step.
    final now carries the loaded checkpoint's step and `all` leaves it out while that checkpoint is scored; the
    Trainer's own best (load_best_model_at_end on eval_loss: trainer_state.json) counts the same."""
    run = tmp_path / "run"
    for step in (2, 4):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (run / "adapter_config.json").write_text("{}")
    (run / "status.json").write_text(json.dumps({"step": 4}))
    (run / "checkpoint_scores.json").write_text(json.dumps({"metric": "json_field_f1", "loaded": "checkpoint-2"}))
    assert [(c.name, c.step) for c in pick(run, "all")] == [("checkpoint-2", 2), ("checkpoint-4", 4)]
    assert [(c.name, c.step) for c in pick(run, "final,4")] == [("checkpoint-4", 4), ("final", 2)]
    (run / "checkpoint_scores.json").unlink()
    assert [(c.name, c.step) for c in pick(run, "final")] == [("final", 4)]  # no best loaded: the last step
    (run / "run_spec.yaml").write_text("load_best_model_at_end: true\n")
    (run / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": str(run / "checkpoint-2")}))
    assert [(c.name, c.step) for c in pick(run, "all")] == [("checkpoint-2", 2), ("checkpoint-4", 4)]
    assert pick(run, "final")[0].step == 2


def test_best_is_per_metric():
    entries = [{"checkpoint": "checkpoint-2", "step": 2, "eval_loss": 1.0, "predict_bleu-4": 5.0, "predict_rows": 3},
               {"checkpoint": "checkpoint-4", "step": 4, "eval_loss": 2.0, "predict_bleu-4": 7.0, "predict_rows": 3}]
    best = checkpoint_eval.best(entries)
    assert best == {"eval_loss": {"checkpoint": "checkpoint-2", "step": 2, "value": 1.0},
                    "predict_bleu-4": {"checkpoint": "checkpoint-4", "step": 4, "value": 7.0}}


@pytest.mark.slow
def test_a_full_run_loads_each_checkpoint_as_the_model(tiny_qwen2, tmp_path):
    """finetuning_type full, model_name_or_path = the run folder: each checkpoint is a whole model, loaded in turn;
    checkpoint-2's figures equal a plain eval of checkpoint-2 as the model."""
    run = tmp_path / "full"
    proc = subprocess.run(TUNEBOARD + ["train", f"model_name_or_path={tiny_qwen2}", f"output_dir={run}",
                                       "dataset=identity", "finetuning_type=full", "cutoff_len=64",
                                       "per_device_train_batch_size=2", "logging_steps=1", "learning_rate=0.001",
                                       "max_steps=4", "save_steps=2", "plot_loss=false"],
                          cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # asked as an adapter run: one line says how to ask for a full run
    with pytest.raises(SpecError) as info:
        validate_spec({"model_name_or_path": str(tiny_qwen2), "adapter_name_or_path": str(run), "checkpoints": "all",
                       "dataset": "identity"})
    assert any(f == "checkpoints" and f"model_name_or_path={run}" in m for f, m in info.value.errors)
    out = tmp_path / "all"
    proc = _eval(f"model_name_or_path={run}", "finetuning_type=full", "checkpoints=all", f"output_dir={out}", *ROWS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    entries = _read(out / CHECKPOINT_EVAL_FILE)["checkpoints"]
    assert [e["checkpoint"] for e in entries] == ["checkpoint-2", "checkpoint-4", "final"]
    assert entries[0]["eval_loss"] != entries[1]["eval_loss"]
    single = tmp_path / "single"
    proc = _eval(f"model_name_or_path={run}/checkpoint-2", "finetuning_type=full", f"output_dir={single}", *ROWS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alone = _read(single / EVAL_RESULTS_FILE)
    assert entries[0]["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-5)
    assert entries[0]["predict_rouge-l"] == pytest.approx(alone["predict_rouge-l"], abs=1e-6)

