"""webui/promotion.py: a run's checkpoint table and the Promote / Undo messages, on a run folder written by
hand (real files; the promote itself is tested on trained runs in tests/backend/test_promote.py)."""
import json

from backend.core.rundir import CHECKPOINT_SCORES_FILE, STATUS_FILE
from webui.promotion import checkpoint_frame, checkpoint_names, promote_checkpoint


def _weights(tag: str) -> bytes:
    """A whole safetensors file whose one tensor holds `tag` (promote checks the files it promotes)."""
    import numpy as np
    from safetensors.numpy import save

    return save({"tag": np.frombuffer(tag.encode(), dtype=np.uint8)})


def _run(root):
    run = root / "run"
    for folder, tag in ((run, "final"), (run / "checkpoint-5", "five"), (run / "checkpoint-10", "ten")):
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(_weights(tag))
        (folder / "adapter_config.json").write_text("{}")
    (run / "checkpoint-10" / "trainer_state.json").write_text("{}")  # checkpoint-5 was cut short
    (run / "run_spec.yaml").write_text("finetuning_type: lora\n")
    (run / STATUS_FILE).write_text(json.dumps({"state": "completed"}))
    (run / "trainer_log.jsonl").write_text(json.dumps({"step": 10, "loss": 0.5}) + "\n")
    (run / CHECKPOINT_SCORES_FILE).write_text(json.dumps({
        "metric": "rouge_l", "greater_is_better": True, "samples": 4,
        "scores": [{"step": 10, "checkpoint": "checkpoint-10", "value": 0.3, "seconds": 1}],
        "best": {"step": 10, "checkpoint": "checkpoint-10", "value": 0.3}}))
    return run


def test_table_and_messages(tmp_path):
    run = _run(tmp_path)
    assert checkpoint_names(run) == ["checkpoint-5", "checkpoint-10"]
    frame = checkpoint_frame(run)
    assert list(frame.columns) == ["step", "checkpoint", "loss", "rouge_l", "adapter"]
    assert frame.values.tolist() == [[5, "checkpoint-5 (incomplete)", "", "", ""],
                                     [10, "checkpoint-10", "0.5000", "0.3000 ★", ""]]
    assert list(checkpoint_frame(run, "de").columns)[:3] == ["Schritt", "Checkpoint", "Loss"]
    assert checkpoint_frame(None).empty

    ok, message = promote_checkpoint(run, "checkpoint-5")
    assert not ok and message.startswith("✖ Cannot promote: checkpoint-5: incomplete checkpoint")
    assert promote_checkpoint(run, None) == (False, "Pick a checkpoint.")
    ok, message = promote_checkpoint(run, "checkpoint-10", lang="de")
    assert ok and "`checkpoint-10` ist jetzt der Adapter" in message
    assert checkpoint_frame(run)["adapter"].tolist() == ["", "✓"]
    assert (run / "adapter_model.safetensors").read_bytes() == _weights("ten")
    ok, message = promote_checkpoint(run, None, undo=True)
    assert ok and "has its own final adapter again" in message
    assert (run / "adapter_model.safetensors").read_bytes() == _weights("final")
    assert promote_checkpoint(run, None, undo=True)[0] is False
