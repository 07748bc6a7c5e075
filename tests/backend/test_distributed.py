"""The distributed keys without training (fast tier): process counts, multi-node commands, the shipped DeepSpeed
and accelerate (FSDP) configs, and what validate refuses. The runs themselves: test_distributed_runs.py."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from backend.core import launch
from backend.core.spec import REFUSED, SpecError, load_spec

REPO = Path(__file__).resolve().parents[2]
DS_NAMES = ("ds_z0_config.json", "ds_z2_config.json", "ds_z2_offload_config.json", "ds_z3_config.json",
            "ds_z3_offload_config.json")


def errors(*overrides: str, path=None) -> dict[str, str]:
    try:
        load_spec(path, list(overrides), check_files=True)
    except SpecError as exc:
        return dict(exc.errors)
    return {}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(launch, "visible_accelerators", lambda: 0)


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(launch, "visible_accelerators", lambda: 4)


def test_process_count_auto_is_one_per_gpu_and_one_on_a_cpu(monkeypatch):
    spec = load_spec(None, [])
    assert spec.nproc_per_node == "auto"
    monkeypatch.setattr(launch, "visible_accelerators", lambda: 0)
    assert launch.nproc(spec) == 1 and not launch.needs_launcher(spec)
    monkeypatch.setattr(launch, "visible_accelerators", lambda: 4)
    assert launch.nproc(spec) == 4 and launch.world_size(spec) == 4 and launch.needs_launcher(spec)
    assert launch.world_size(load_spec(None, ["nproc_per_node=2"])) == 2


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(launch, "_nvidia_gpus", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert launch.visible_accelerators() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launch.visible_accelerators() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launch.visible_accelerators() == 8


def test_bad_process_layouts_are_refused_with_the_field(no_gpu):
    assert "auto or a number of processes" in errors("nproc_per_node=0")["nproc_per_node"]
    assert "auto or a number of processes" in errors("nproc_per_node=many")["nproc_per_node"]
    assert "below nnodes" in errors("node_rank=1")["node_rank"]
    assert "node 0's address" in errors("nnodes=2")["master_addr"]
    assert errors("nnodes=2", "node_rank=1", "master_addr=10.0.0.1", "master_port=29400") == {}
    # unset across machines: torchrun's 29500 on every node (none could learn a port picked at random)
    spec = load_spec(None, ["nnodes=2", "node_rank=1", "master_addr=10.0.0.1"])
    assert launch.rendezvous_port(spec) == 29500
    assert launch.rendezvous_port(load_spec(None, ["master_port=29411"])) == 29411


def test_more_processes_than_gpus_is_refused(four_gpus):
    assert "4 GPU(s) visible" in errors("nproc_per_node=8")["nproc_per_node"]
    assert errors("nproc_per_node=4") == {}


def test_print_launch_gives_every_node_the_same_spec_and_rendezvous():
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "train", "--print-launch",
                           "examples/sft_lora_identity.yaml", "nnodes=3", "master_addr=10.1.2.3", "nproc_per_node=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("tuneboard train")]
    assert len(lines) == 3
    argvs = [shlex.split(line) for line in lines]
    for node, argv in enumerate(argvs):
        assert argv[2] == "examples/sft_lora_identity.yaml"
        assert f"node_rank={node}" in argv and "nnodes=3" in argv and "master_addr=10.1.2.3" in argv
        assert "nproc_per_node=2" in argv
    ports = {a for argv in argvs for a in argv if a.startswith("master_port=")}
    assert len(ports) == 1, "every node must meet at one port"
    outs = {a for argv in argvs for a in argv if a.startswith("output_dir=")}
    assert len(outs) <= 1
    # each line is a valid spec for its node (the other nodes need master_port: it is there)
    for argv in argvs:
        load_spec(argv[2] if Path(REPO / argv[2]).exists() else None, argv[3:], check_files=False)


def test_print_launch_keeps_an_unset_output_dir_identical_on_every_node(tmp_path):
    spec = load_spec(None, ["nnodes=2", "master_addr=h0"])
    lines = launch.launch_commands(["nnodes=2", "master_addr=h0"], spec)
    outs = [next(a for a in shlex.split(line) if a.startswith("output_dir=")) for line in lines]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", DS_NAMES)
def test_shipped_deepspeed_configs(name, no_gpu):
    path = f"examples/deepspeed/{name}"
    config = json.loads((REPO / path).read_text())
    stage = int(name.split("_z")[1][0])
    assert config["zero_optimization"]["stage"] == stage
    assert config["train_micro_batch_size_per_gpu"] == "auto"  # filled in by the Trainer from the spec
    offload = "offload" in name
    assert ("offload_optimizer" in config["zero_optimization"]) == offload
    spec = load_spec(None, [f"deepspeed={path}", "nproc_per_node=2"])
    assert launch.zero_stage(spec) == stage and launch.needs_launcher(spec)
    assert f"ZeRO-{stage}" in launch.describe(spec)


def test_deepspeed_config_is_checked(tmp_path, no_gpu):
    assert "not found" in errors("deepspeed=examples/deepspeed/nope.json")["deepspeed"]
    bad = tmp_path / "bad.json"
    bad.write_text("{ 'stage': 3 }")
    assert "not valid JSON: line 1" in errors(f"deepspeed={bad}")["deepspeed"]
    nvme = tmp_path / "nvme.json"
    nvme.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    assert errors(f"deepspeed={nvme}")["deepspeed"].startswith(REFUSED)


def test_the_guides_zero3_qlora_command_validates(no_gpu):
    """QLoRA + ZeRO-3 (the guide's command) runs here (test_distributed_runs.py trains it), as do ZeRO-2 and LoRA."""
    recipe = REPO / "examples/sft_qlora_extraction.yaml"
    for config in ("ds_z3_config.json", "ds_z3_offload_config.json", "ds_z2_config.json"):
        assert errors(f"deepspeed=examples/deepspeed/{config}", "nproc_per_node=2", path=recipe) == {}, config
    assert errors("deepspeed=examples/deepspeed/ds_z3_config.json", "nproc_per_node=2", "quantization_bit=8",
                  path=recipe) == {}
    assert errors("deepspeed=examples/deepspeed/ds_z3_config.json", "nproc_per_node=2", "quantization_bit=",
                  path=recipe) == {}


def test_predictions_need_one_whole_model(no_gpu):
    assert errors("nproc_per_node=2", "do_predict=true", "val_size=0.1")["do_predict"].startswith(REFUSED)
    assert errors("deepspeed=examples/deepspeed/ds_z3_config.json", "do_predict=true",
                  "val_size=0.1")["do_predict"].startswith(REFUSED)


def test_fsdp_is_refused_on_a_cpu_with_the_reason(no_gpu):
    for key in ("accelerate_config=examples/accelerate/fsdp_config.yaml", "fsdp=full_shard"):
        found = errors(key, "nproc_per_node=2")
        message = found.get(key.split("=")[0])
        assert message and message.startswith(REFUSED) and "does not run on a CPU" in message, found


@pytest.mark.parametrize("name", ["fsdp_config.yaml", "fsdp_config_offload.yaml", "fsdp2_config.yaml"])
def test_fsdp_configs_validate_and_reach_the_trainer_on_gpus(name, four_gpus):
    """FSDP needs GPUs (none here: the training run is GPU-only); on a machine that has them the shipped
    configs validate and become the Trainer's fsdp / fsdp_config arguments."""
    from transformers import TrainingArguments

    from backend.stages.base import distributed_arguments

    spec = load_spec(None, [f"accelerate_config=examples/accelerate/{name}", "nproc_per_node=2"])
    kwargs = distributed_arguments(spec)
    version = 2 if "fsdp2" in name else 1
    assert kwargs["fsdp_config"]["version"] == version
    assert "full_shard" in kwargs["fsdp"] and "auto_wrap" in kwargs["fsdp"]
    assert ("offload" in kwargs["fsdp"]) == ("offload" in name)
    assert not any(k.startswith("fsdp_") for k in kwargs["fsdp_config"])
    assert set(kwargs) <= set(TrainingArguments.__dataclass_fields__)
    assert "FSDP" in launch.describe(spec)


def test_fsdp_config_must_agree_with_the_spec(tmp_path, four_gpus):
    config = tmp_path / "fsdp.yaml"
    config.write_text("distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\n"
                      "fsdp_config:\n  fsdp_version: 2\n")
    message = errors(f"accelerate_config={config}", "nproc_per_node=2")["accelerate_config"]
    assert "num_processes 8" in message or "mixed_precision bf16" in message
    config.write_text("distributed_type: MULTI_GPU\n")
    assert "TuneBoard takes FSDP" in errors(f"accelerate_config={config}")["accelerate_config"]
    assert "choose one" in errors(f"accelerate_config={tmp_path / 'x.yaml'}",
                                  "deepspeed=examples/deepspeed/ds_z2_config.json")["deepspeed"]


def test_trainer_arguments_of_a_launched_cpu_run(no_gpu):
    """On a CPU, DeepSpeed and multi-process runs need use_cpu (else each rank trains alone)."""
    from backend.stages.base import distributed_arguments

    assert distributed_arguments(load_spec(None, [])) == {}
    ddp = distributed_arguments(load_spec(None, ["nproc_per_node=2"]))
    assert ddp == {"use_cpu": True, "ddp_find_unused_parameters": False}
    assert "ddp_find_unused_parameters" not in distributed_arguments(load_spec(None, ["nproc_per_node=2",
                                                                                     "finetuning_type=full"]))
    zero = distributed_arguments(load_spec(None, ["deepspeed=examples/deepspeed/ds_z3_config.json"]))
    assert zero["use_cpu"] and zero["deepspeed"] == str(REPO / "examples/deepspeed/ds_z3_config.json")


def test_a_full_disk_is_named_as_the_cause_over_a_peer_failing_in_the_same_second(tmp_path, monkeypatch):
    """ZeRO-3 on a full disk: the rank whose write failed removes the shared checkpoint folder and its peer then
    fails on the missing folder, often in the same second (the error files' timestamps are whole seconds); the
    launcher names the full disk, not the peer's consequence, even though the peer is rank 0."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from backend.core.launch import record_worker_failure, root_failures

    def failed(rank: int, message: str) -> ProcessFailure:
        error_file = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        record_worker_failure(message)
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(error_file))

    peer = failed(0, "error while saving checkpoint-2 (could not save checkpoint-2: RuntimeError: .saving-2 was removed "
                     "while this rank wrote into it (another rank's save failed))")
    full = failed(1, "no space left on device while saving checkpoint-2 (could not save checkpoint-2: OSError: ...)")
    assert [r for r, _ in root_failures({0: peer, 1: full})] == [1]
    other = failed(1, "ValueError: something else")
    assert [r for r, _ in root_failures({0: peer, 1: other})] == [0]  # no write failure: the earliest, then rank
