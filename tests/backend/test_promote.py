"""tuneboard promote (backend/core/promote.py): a checkpoint of a real tiny run becomes the run's top-level
adapter (or model weights), what loads the run folder gets its weights, --undo puts the final files back byte
for byte, and each refusal is one line."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend.core import promote
from backend.core.rundir import PROMOTION_FILE, PROMOTION_KEEP_DIR, RUNNING_LOG, STATUS_FILE

TUNEBOARD = [sys.executable, "-m", "backend.cli"]


def _train(model: Path, out: Path, *extra: str) -> Path:
    proc = subprocess.run(TUNEBOARD + ["train", f"model_name_or_path={model}", f"output_dir={out}", "dataset=identity",
                                       "cutoff_len=64", "per_device_train_batch_size=2", "gradient_accumulation_steps=1",
                                       "logging_steps=1", "learning_rate=0.01", "max_steps=4", "save_steps=2",
                                       "plot_loss=false", *extra],
                          cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def lora_run(tiny_qwen2, tmp_path_factory):
    """A tiny LoRA SFT run with checkpoint-2 and checkpoint-4 (trained once for this module)."""
    return _train(tiny_qwen2, tmp_path_factory.mktemp("promote") / "lora", "lora_rank=4")


@pytest.fixture
def run(lora_run, tmp_path):
    """A fresh copy of the run per test (promote changes it)."""
    return Path(shutil.copytree(lora_run, tmp_path / "run"))


def _bytes(folder: Path, names) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in names}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(TUNEBOARD + ["promote", *args], cwd="/tmp", capture_output=True, text=True, timeout=120)


def _merged_weight(base: Path, adapter: Path):
    """The q_proj weight of layer 0 after loading `adapter` the way chat / export do (merged for inference)."""
    from transformers import AutoModelForCausalLM

    from backend.training.adapters import apply_finetuning

    model = AutoModelForCausalLM.from_pretrained(base)
    model = apply_finetuning(model, SimpleNamespace(finetuning_type="lora", adapter_name_or_path=str(adapter)),
                             for_training=False)
    return model.model.layers[0].self_attn.q_proj.weight.detach().clone()


@pytest.mark.slow
def test_promote_then_undo_lora(run, tiny_qwen2):
    names = ["adapter_config.json", "adapter_model.safetensors"]
    final, ckpt = _bytes(run, names), _bytes(run / "checkpoint-2", names)
    assert final["adapter_model.safetensors"] != ckpt["adapter_model.safetensors"]  # lr 0.01: they differ
    tokenizer = (run / "tokenizer.json").read_bytes()

    proc = _cli(str(run), "checkpoint-2")
    assert proc.returncode == 0, proc.stderr
    assert _bytes(run, names) == ckpt  # the top level is the checkpoint now
    assert _bytes(run / PROMOTION_KEEP_DIR, names) == final  # the final files are kept
    assert (run / "tokenizer.json").read_bytes() == tokenizer  # the tokenizer stays the run's
    record = json.loads((run / PROMOTION_FILE).read_text())
    assert record["checkpoint"] == "checkpoint-2" and record["final_kept_in"] == PROMOTION_KEEP_DIR
    assert [h["action"] for h in record["history"]] == ["promote"]
    assert promote.promoted_checkpoint(run) == "checkpoint-2"
    assert "PROMOTE: checkpoint-2" in (run / RUNNING_LOG).read_text()
    rows, _ = promote.checkpoint_rows(run)
    assert [(r["checkpoint"], r["adapter"]) for r in rows] == [("checkpoint-2", True), ("checkpoint-4", False)]
    assert all(isinstance(r["loss"], float) for r in rows)

    # what loads the run folder gets the checkpoint's weights, not the final ones
    import torch

    from_run = _merged_weight(tiny_qwen2, run)
    assert torch.equal(from_run, _merged_weight(tiny_qwen2, run / "checkpoint-2"))
    assert not torch.equal(from_run, _merged_weight(tiny_qwen2, run / PROMOTION_KEEP_DIR))

    # a second promote keeps the first final, and undo restores it byte for byte
    assert promote.promote(run, "4")["checkpoint"] == "checkpoint-4"
    assert _bytes(run / PROMOTION_KEEP_DIR, names) == final
    proc = _cli(str(run), "--undo")
    assert proc.returncode == 0, proc.stderr
    assert _bytes(run, names) == final
    assert not (run / PROMOTION_KEEP_DIR).exists()
    record = json.loads((run / PROMOTION_FILE).read_text())
    assert record["checkpoint"] is None
    assert [h["action"] for h in record["history"]] == ["promote", "promote", "undo"]
    assert promote.promoted_checkpoint(run) is None


@pytest.mark.slow
def test_refusals_are_one_line(run):
    def refused(*args: str) -> str:
        proc = _cli(*args)
        assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr

    assert "nothing to undo" in refused(str(run), "--undo")
    assert "checkpoint-9: no such checkpoint" in refused(str(run), "checkpoint-9")
    assert "no checkpoints" in refused(str(run.parent), "checkpoint-2")
    other = run.parent / "other-run"  # another run's checkpoint-2 is not this run's (only its name was read)
    shutil.copytree(run, other)
    assert "not a checkpoint of" in refused(str(run), str(other / "checkpoint-2"))
    weights = run / "checkpoint-4" / "adapter_model.safetensors"  # cut short: it would have become the adapter
    whole = weights.read_bytes()
    weights.write_bytes(whole[:1000])
    assert "checkpoint-4: cannot be promoted" in refused(str(run), "checkpoint-4")
    weights.write_bytes(whole)
    (run / "checkpoint-4" / "adapter_config.json").write_text("{bad")
    assert "is not valid JSON (line 1, column 2" in refused(str(run), "checkpoint-4")
    (run / "checkpoint-2" / "trainer_state.json").unlink()
    assert "incomplete checkpoint" in refused(str(run), "checkpoint-2")
    status = json.loads((run / STATUS_FILE).read_text())
    (run / STATUS_FILE).write_text(json.dumps({**status, "state": "running"}))
    assert "still running" in refused(str(run), "checkpoint-4")
    assert "still running" in refused(str(run), "--undo")
    assert not (run / PROMOTION_FILE).exists() and not (run / PROMOTION_KEEP_DIR).exists()  # nothing touched


@pytest.mark.slow
def test_a_crash_mid_promote_leaves_a_loadable_adapter(run, tiny_qwen2, monkeypatch):
    """The process dies after the first file moved in (the weights) and before the config and promotion.json:
    the run folder still loads as an adapter, and undo brings the final files back byte for byte."""
    names = ["adapter_config.json", "adapter_model.safetensors"]
    final = _bytes(run, names)
    real, moved = promote.replace_path, []

    def dies_after_the_weights(src, dst):
        if moved and Path(dst).name in names:
            raise SystemExit("killed")  # what a kill looks like to the code after it: nothing more runs
        real(src, dst)
        if Path(dst).name in names and Path(dst).parent == run:
            moved.append(Path(dst).name)

    monkeypatch.setattr(promote, "replace_path", dies_after_the_weights)
    with pytest.raises(SystemExit):
        promote.promote(run, "checkpoint-2")
    monkeypatch.undo()
    assert moved == ["adapter_model.safetensors"]
    assert (run / "adapter_model.safetensors").read_bytes() == (run / "checkpoint-2" / "adapter_model.safetensors").read_bytes()
    assert not (run / PROMOTION_FILE).exists()
    _merged_weight(tiny_qwen2, run)  # loads: every top-level file is whole
    promote.undo(run)
    assert _bytes(run, names) == final


@pytest.mark.slow
def test_a_resumed_run_after_a_promote(run, tiny_qwen2):
    """Resuming a promoted run saves new final weights over the promoted ones: the run no longer counts as
    promoted, undo refuses (it would bring back older weights), and the next promote keeps the new final,
    the older kept final moved aside, nothing deleted."""
    names = ["adapter_config.json", "adapter_model.safetensors"]
    first_final = _bytes(run, names)
    promote.promote(run, "checkpoint-2")
    _train(tiny_qwen2, run, "lora_rank=4", "max_steps=6", "resume_from_checkpoint=true")
    new_final = _bytes(run, names)
    assert new_final["adapter_model.safetensors"] not in (first_final["adapter_model.safetensors"],
                                                          _bytes(run / "checkpoint-2", names)["adapter_model.safetensors"])
    assert promote.promoted_checkpoint(run) is None
    proc = _cli(str(run), "--undo")
    assert proc.returncode == 1 and "saved new final weights" in proc.stderr, proc.stderr
    assert _bytes(run, names) == new_final  # untouched

    promote.promote(run, "checkpoint-4")
    assert _bytes(run / PROMOTION_KEEP_DIR, names) == new_final
    aside = [p for p in run.iterdir() if p.name.startswith(PROMOTION_KEEP_DIR + "-")]
    assert len(aside) == 1 and _bytes(aside[0], names) == first_final
    promote.undo(run)
    assert _bytes(run, names) == new_final


@pytest.mark.slow
def test_promote_full_run(tiny_qwen2, tmp_path):
    """A full run's model weights (and config) are promoted the same way; undo restores them exactly."""
    run = _train(tiny_qwen2, tmp_path / "full", "finetuning_type=full")
    names = promote.weight_files(run, adapter=False)
    assert "model.safetensors" in names and "config.json" in names
    final, ckpt = _bytes(run, names), _bytes(run / "checkpoint-2", names)
    assert final["model.safetensors"] != ckpt["model.safetensors"]
    assert promote.promote(run, "checkpoint-2")["kind"] == "model"
    assert _bytes(run, names) == ckpt and _bytes(run / PROMOTION_KEEP_DIR, names) == final
    promote.undo(run)
    assert _bytes(run, names) == final


# ------------------------------------------------------------------ fast tier: a run folder written by hand
def _weights(tag: bytes) -> bytes:
    """A whole safetensors file whose one tensor holds `tag` (promote checks the files it promotes)."""
    import numpy as np
    from safetensors.numpy import save

    return save({"tag": np.frombuffer(tag, dtype=np.uint8)})


def _hand_made_run(root: Path) -> Path:
    """The files of a finished LoRA run with two checkpoints (the weights' bytes only need to differ)."""
    run = root / "run"
    for folder, tag in ((run, b"final"), (run / "checkpoint-10", b"ten"), (run / "checkpoint-20", b"twenty")):
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(_weights(b"weights of " + tag))
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        (folder / "tokenizer.json").write_text("{}")
        if folder != run:
            (folder / "trainer_state.json").write_text("{}")
    (run / "run_spec.yaml").write_text("finetuning_type: lora\n")
    (run / STATUS_FILE).write_text(json.dumps({"state": "completed"}))
    (run / "trainer_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0 - s / 100}) + "\n"
                                                   for s in range(1, 21)))
    return run


def test_rows_promote_undo_on_a_hand_made_run(tmp_path):
    from backend.core.rundir import CHECKPOINT_SCORES_FILE

    run = _hand_made_run(tmp_path)
    (run / CHECKPOINT_SCORES_FILE).write_text(json.dumps({
        "metric": "json_field_f1", "greater_is_better": True, "samples": 8,
        "scores": [{"step": 10, "checkpoint": "checkpoint-10", "value": 0.6, "seconds": 1.0},
                   {"step": 20, "checkpoint": "checkpoint-20", "value": 0.4, "seconds": 1.0}],
        "best": {"step": 10, "checkpoint": "checkpoint-10", "value": 0.6}}))
    rows, metric = promote.checkpoint_rows(run)
    assert metric == "json_field_f1"
    assert [(r["step"], r["loss"], r["metric"], r["best"], r["adapter"]) for r in rows] == [
        (10, 1.9, 0.6, True, False), (20, 1.8, 0.4, False, False)]
    promote.promote(run, "checkpoint-10")
    assert (run / "adapter_model.safetensors").read_bytes() == _weights(b"weights of ten")
    assert [r["adapter"] for r in promote.checkpoint_rows(run)[0]] == [True, False]
    promote.undo(run)
    assert (run / "adapter_model.safetensors").read_bytes() == _weights(b"weights of final")
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".") or "promot" in p.name) == [PROMOTION_FILE]
    with pytest.raises(promote.PromoteError, match="nothing to undo"):
        promote.undo(run)
    (run / "checkpoint-20" / "adapter_model.safetensors").unlink()
    with pytest.raises(promote.PromoteError, match="holds no adapter weights"):
        promote.promote(run, "checkpoint-20")


def test_an_eval_output_folder_is_not_a_training_run(tmp_path):
    """`tuneboard promote <output of eval checkpoints=...> checkpoint-2` said "incomplete checkpoint": that folder
    holds a checkpoint-N folder of answers per adapter. It is named as no training run, with the run it evaluated."""
    out = tmp_path / "ckpt-eval"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "generated_predictions.jsonl").write_text("")
    (out / "checkpoint_eval.json").write_text(json.dumps({"run": "/runs/r1", "entries": []}))
    with pytest.raises(promote.PromoteError) as err:
        promote.promote(out, "checkpoint-2")
    assert str(err.value) == (f"{out}: not a training run (no run_spec.yaml, no complete checkpoint-N folder): it "
                              "holds the checkpoint evaluation of /runs/r1: promote in that run folder")
