"""The Train tab's "Devices and distribution" accordion: its fields come from the spec, the shipped DeepSpeed and
FSDP configs are offered, the Preview shows every other node's command, and the memory pre-flight divides what
ZeRO shards by the process count."""
from __future__ import annotations

import shlex

import pytest

from backend.core import launch
from backend.core.spec import load_spec
from webui import fields as F
from webui import preflight

DISTRIBUTED = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "deepspeed", "accelerate_config")


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(launch, "visible_accelerators", lambda: 0)


def test_the_accordion_holds_the_distribution_fields():
    assert "distributed" in F.ACCORDIONS
    rows = {r.name: r for r in F.form_rows()}
    assert {n for n, r in rows.items() if r.group == "distributed"} == set(DISTRIBUTED)
    assert F.dropdown_ids(rows["nproc_per_node"])[0] == "auto"
    assert "examples/deepspeed/ds_z3_config.json" in F.dropdown_ids(rows["deepspeed"])
    assert F.dropdown_ids(rows["deepspeed"])[0] == F.NONE_ID
    assert "examples/accelerate/fsdp_config.yaml" in F.dropdown_ids(rows["accelerate_config"])


def test_form_values_become_a_valid_distributed_spec():
    names = list(DISTRIBUTED)
    values = ["2", 1, 0, "", "", "examples/deepspeed/ds_z3_config.json", F.NONE_ID]
    flat, errors = F.values_to_flat(names, values)
    assert not errors and flat["nproc_per_node"] == "2" and flat["accelerate_config"] is None
    spec = load_spec(None, [f"{k}={v}" for k, v in flat.items() if v is not None])
    assert spec.nproc_per_node == 2 and launch.zero_stage(spec) == 3
    back, _, _ = F.spec_to_values(spec, names)
    assert back[0] == "2" and back[5] == "examples/deepspeed/ds_z3_config.json" and back[6] == F.NONE_ID


def test_preview_shows_the_command_of_every_other_node(tmp_path):
    from webui.tabs.train import preview_of

    spec = load_spec(None, ["nnodes=3", "master_addr=10.0.0.5", "nproc_per_node=2", f"output_dir={tmp_path}"])
    command, _ = preview_of(spec)
    lines = [line for line in command.splitlines() if line.startswith("tuneboard train")]
    assert [shlex.split(line)[3:] for line in lines] == [
        ["nnodes=3", f"node_rank={n}", "master_addr=10.0.0.5", "master_port=29500"] for n in (1, 2)]
    single, _ = preview_of(load_spec(None, ["nproc_per_node=2", f"output_dir={tmp_path}"]))
    assert "node_rank" not in single


BASE = {"model_name_or_path": "org/model-1B", "finetuning_type": "full", "per_device_train_batch_size": 1,
        "cutoff_len": 128}


def test_preflight_divides_what_zero_shards_by_the_process_count():
    one = preflight.estimate(BASE)
    ddp = preflight.estimate({**BASE, "nproc_per_node": 2})
    z2 = preflight.estimate({**BASE, "nproc_per_node": 2, "deepspeed": "examples/deepspeed/ds_z2_config.json"})
    z3 = preflight.estimate({**BASE, "nproc_per_node": 2, "deepspeed": "examples/deepspeed/ds_z3_config.json"})
    assert ddp["per_process"] == pytest.approx(one["per_process"])  # DDP: a full copy each
    assert ddp["total"] == pytest.approx(2 * one["total"])  # two CPU processes share this machine's RAM
    assert z2["weights"] == one["weights"] and z2["state"] == pytest.approx(one["state"] * 10 / 16)
    assert z3["weights"] == pytest.approx(one["weights"] / 2) and z3["state"] == pytest.approx(one["state"] / 2)
    assert z3["per_process"] < z2["per_process"] < ddp["per_process"]
    text = preflight.summary_md({**BASE, "nproc_per_node": 2, "deepspeed": "examples/deepspeed/ds_z3_config.json"})
    assert "per process x 2 here" in text and "ZeRO-3 shards weights" in text
    assert set(("nproc_per_node", "nnodes", "deepspeed")) <= set(preflight.FIELDS)
