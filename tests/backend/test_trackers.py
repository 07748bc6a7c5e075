"""report_to (issue 23 item 5): TensorBoard, MLflow and W&B report a real tiny run into its run folder (event
files a TensorBoard reader parses, MLflow's local file store, W&B's offline run), with no server and no account;
a tracker whose package is missing is refused at validate with what to install."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from backend.core.spec import SpecError, validate_spec
from backend.core.trackers import local_logs, tracker_environment

TRACKER_VARIABLES = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR", "MLFLOW_TRACKING_URI",
                     "TENSORBOARD_LOGGING_DIR", "SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_LOG_DIR")
SWANLAB = importlib.util.find_spec("swanlab") is not None  # its own extra: tested where it is installed


@pytest.fixture(scope="module")
def tracked_run(tiny_llama, tmp_path_factory):
    """One 3-step LoRA run reporting to tensorboard, mlflow and wandb at once; its losses as our log has them."""
    from backend.training import train

    saved = dict(os.environ)
    for key in TRACKER_VARIABLES:
        os.environ.pop(key, None)
    out = tmp_path_factory.mktemp("tracked") / "run"
    spec = validate_spec({"model_name_or_path": str(tiny_llama), "template": "llama3", "dataset": "identity",
                          "max_samples": 8, "cutoff_len": 64, "max_steps": 3, "per_device_train_batch_size": 2,
                          "gradient_accumulation_steps": 1, "logging_steps": 1, "save_strategy": "no",
                          "plot_loss": False, "report_to": "tensorboard, mlflow, wandb" + (", swanlab" if SWANLAB else ""),
                          "output_dir": str(out)})
    try:
        assert train.run(spec) == 0, (out / "running_log.txt").read_text()[-3000:]
        import wandb  # optional: the trackers extra

        wandb.finish()  # what the training process's exit does (wandb's atexit hook): this run is in-process
        if SWANLAB:
            import swanlab  # optional: the swanlab extra

            swanlab.finish()  # the same for SwanLab
    finally:
        os.environ.clear()
        os.environ.update(saved)
    losses = [json.loads(line)["loss"] for line in (out / "trainer_log.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 3
    return out, losses


def test_tensorboard_event_files_hold_the_loss(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, losses = tracked_run
    events = list((out / "runs").rglob("events.out.tfevents.*"))
    assert events, sorted(p.name for p in out.iterdir())
    reader = EventAccumulator(str(events[0].parent))
    reader.Reload()
    points = reader.Scalars("train/loss")
    assert [p.step for p in points] == [1, 2, 3]
    assert [p.value for p in points] == pytest.approx(losses, rel=1e-4)
    assert ("tensorboard", f"tensorboard --logdir {out / 'runs'}") in local_logs(out)
    assert f"report_to tensorboard: tensorboard --logdir {out / 'runs'}" in (out / "running_log.txt").read_text()
    from webui.tabs.runs import trackers_md  # the Runs tab's line for the picked run

    assert f"- tensorboard: `tensorboard --logdir {out / 'runs'}`" in trackers_md(str(out)).splitlines()


def test_mlflow_local_store_gets_the_loss(tracked_run):
    from mlflow.tracking import MlflowClient

    out, losses = tracked_run
    client = MlflowClient(tracking_uri=f"file:{out / 'mlruns'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    history = sorted((m.step, m.value) for m in history)
    assert [step for step, _ in history] == [1, 2, 3]
    assert [value for _, value in history] == pytest.approx(losses, rel=1e-4)


def _wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file: a LevelDB-style log (a 7-byte :W&B header, 32 KiB blocks of
    records: crc32, length, kind, bytes) of wandb's protobuf Records; wandb 0.2x+ has no Python reader of its own."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb  # optional: the trackers extra

    data, pos, chunk, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_runs_offline_in_the_run_folder(tracked_run):
    out, losses = tracked_run
    offline = list((out / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, sorted(p.name for p in (out / "wandb").iterdir())
    rows = _wandb_history(next(offline[0].glob("run-*.wandb")))
    logged = [(row["train/global_step"], row["train/loss"]) for row in rows if "train/loss" in row]
    assert [step for step, _ in logged] == [1, 2, 3]
    assert [loss for _, loss in logged] == pytest.approx(losses, rel=1e-4)
    assert ("wandb", f"wandb sync {out / 'wandb'}/offline-run-*") in local_logs(out)


@pytest.mark.skipif(not SWANLAB, reason="swanlab is not installed (pip install -e '.[swanlab]')")
def test_swanlab_runs_locally_in_the_run_folder(tracked_run):
    out, losses = tracked_run
    runs = list((out / "swanlog").glob("run-*"))
    assert len(runs) == 1, sorted(p.name for p in (out / "swanlog").iterdir())
    series = [[json.loads(line)["data"] for line in log.read_text().splitlines()]  # one folder per logged key
              for log in runs[0].glob("logs/*/1000.log")]
    assert any(values == pytest.approx(losses, rel=1e-4) for values in series), series
    assert ("swanlab", f"swanlab watch {out / 'swanlog'}") in local_logs(out)


def test_a_tracker_without_its_package_is_refused_at_validate(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own mark of a module that cannot be imported
    with pytest.raises(SpecError) as exc:
        validate_spec({"report_to": "wandb"}, check_files=False)
    assert str(exc.value) == ("report_to: not supported: report_to wandb needs the wandb package, which is not "
                              "installed: pip install wandb (or pip install -e '.[trackers]' for tensorboard, wandb "
                              "and mlflow)")
    for value, why in (("comet_ml", "not a tracker TuneBoard sets up"), ("all", "name the trackers")):
        with pytest.raises(SpecError, match=f"report_to: not supported: .*{why}"):
            validate_spec({"report_to": value}, check_files=False)
    assert validate_spec({"report_to": "none"}, check_files=False).training_arguments()["report_to"] == "none"


def test_a_configured_server_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("WANDB_API_KEY", "k")
    env = tracker_environment(["mlflow", "wandb"], tmp_path)
    assert "MLFLOW_TRACKING_URI" not in env and "WANDB_MODE" not in env and env["WANDB_DIR"] == str(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("WANDB_API_KEY")
    env = tracker_environment("mlflow,wandb", tmp_path)
    assert env["MLFLOW_TRACKING_URI"] == f"file:{tmp_path / 'mlruns'}" and env["WANDB_MODE"] == "offline"
