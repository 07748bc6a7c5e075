"""The Train tab's device picker (issue 12): the GPUs `nvidia-smi -L` lists (the UI never imports torch), hidden
on a machine without; the picked indices become the launched run's CUDA_VISIBLE_DEVICES, also when the run
was queued and another process launches it."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from backend.core import launch
from webui import jobs
from webui.tabs import train as T

FAKE_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-aaaa)"
echo "GPU 1: NVIDIA H200 (UUID: GPU-11111111-bbbb)"
"""
# the "training" process: writes the CUDA_VISIBLE_DEVICES it was given into its run folder
ENV_PROBE = ("import json, os, sys; from pathlib import Path; spec = Path(sys.argv[1]);"
             "(spec.parent / 'env.json').write_text(json.dumps(os.environ.get('CUDA_VISIBLE_DEVICES')))")


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # the GPU count is cached per process: the fake GPUs must not outlive this test (a later test in the same
    # worker then saw 2 GPUs, so world size 2, and its eval was refused do_predict)
    launch._nvidia_gpus.cache_clear()
    yield
    launch._nvidia_gpus.cache_clear()


def probe(spec_path, overrides=None):
    return [sys.executable, "-c", ENV_PROBE, str(spec_path)]


def seen_env(run_dir):
    pid = jobs.read_json(run_dir / jobs.LAUNCH_FILE)["pid"]
    while jobs.pid_alive(pid):  # the probe writes env.json and exits
        time.sleep(0.1)
    return json.loads((run_dir / "env.json").read_text())


def test_no_nvidia_smi_no_picker(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    assert T.device_choices() == []


def test_the_picker_offers_the_gpus_and_start_sets_cuda_visible_devices(fake_gpus, root, tiny_llama, monkeypatch):
    from webui.app import create_app

    assert T.device_choices() == [("GPU 0: NVIDIA H200", "0"), ("GPU 1: NVIDIA H200", "1")]
    real_launch, launched = jobs.launch, []

    def launch(run_dir, argv, env=None):  # the real launch of the probe instead of `tuneboard train`
        launched.append(run_dir)
        return real_launch(run_dir, probe(argv[-1]), env=env)

    monkeypatch.setattr(jobs, "launch", launch)
    demo = create_app()
    picker = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "train-devices")
    assert picker.visible and [c[1] for c in picker.choices] == ["0", "1"]
    start = next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "do_start")
    assert start.inputs[3] is picker
    args = [getattr(c, "value", None) for c in start.inputs]
    model = next(i for i, c in enumerate(start.inputs) if c.elem_id == "top-model_name_or_path")
    template = next(i for i, c in enumerate(start.inputs) if c.elem_id == "top-template")
    # the tiny Llama's own template: with "auto" the pre-flight data check warns (no chat template, not in the
    # registry) and holds a Start once, whenever its lint is done in time (webui/data_check.py)
    args[model], args[template], args[3] = str(tiny_llama), "default", ["1"]
    out = start.fn(*args)
    assert len(launched) == 1, out[0]
    assert seen_env(launched[0]) == "1"
    # none picked: the run inherits the UI's environment (here: unset)
    args[3] = []
    start.fn(*args)
    assert len(launched) == 2 and seen_env(launched[1]) is None


def test_a_queued_run_keeps_its_devices(root):
    """The entry carries its environment: the QueueWorker (another JobQueue) that launches it later sets it."""
    busy, queued = root / "busy", root / "queued"
    sleeper = lambda spec_path, overrides=None: [sys.executable, "-c", "import time; time.sleep(600)"]  # noqa: E731
    assert jobs.start_or_queue(f"output_dir: {busy}\n", busy, root=root, command=sleeper)[0] == "started"
    try:
        how, _ = jobs.start_or_queue(f"output_dir: {queued}\n", queued, root=root, command=probe,
                                     env=T.devices_env(["0", "1"]))
        assert how == "queued"
    finally:
        jobs.abort(busy, term_after_s=0.5, kill_after_s=2, wait=True)
    worker = jobs.JobQueue(root, command=probe)
    assert worker.pump() == [str(queued)]
    assert seen_env(queued) == "0,1"
