"""OFT (finetuning_type: oft, LLaMA-Factory's keys oft_block_size / oft_rank / oft_target / module_dropout),
added through the method contract alone: trained by `tuneboard train`, merged by `tuneboard export` (the
merged model computes what base + adapter computes), and answered by `tuneboard chat` like its merge."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from backend.core import methods
from backend.exporting.export import export
from backend.core.spec import validate_spec

pytestmark = pytest.mark.slow
TUNEBOARD = [sys.executable, "-m", "backend.cli"]


@pytest.fixture(scope="module")
def oft_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("oft") / "run"
    proc = subprocess.run(TUNEBOARD + [
        "train", f"model_name_or_path={tiny_llama}", f"output_dir={out}", "template=llama3", "dataset=identity",
        "finetuning_type=oft", "oft_block_size=16", "oft_target=q_proj,v_proj,down_proj", "cutoff_len=96",
        "per_device_train_batch_size=2", "logging_steps=1", "learning_rate=0.05", "max_steps=4"],
        cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def merged(tiny_llama, oft_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("oft-merged") / "export"
    report = export(validate_spec({"model_name_or_path": str(tiny_llama), "adapter_name_or_path": str(oft_run),
                                   "finetuning_type": "oft", "template": "llama3", "export_dir": str(out)}))
    assert report["ok"], report["checks"]
    return out


def test_oft_trains_an_oft_adapter_on_the_targeted_layers(oft_run):
    status = json.loads((oft_run / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 4
    config = json.loads((oft_run / "adapter_config.json").read_text())
    assert config["peft_type"] == "OFT" and methods.method_of_adapter(oft_run) == "oft"
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"] and config["oft_block_size"] == 16
    rows = [json.loads(line) for line in (oft_run / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows)


def test_oft_merged_export_computes_what_base_plus_adapter_computes(tiny_llama, oft_run, merged):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 15, 27, 300, 42, 7, 99]])
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, str(oft_run)).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
    assert (tuned - plain).abs().max() > 1e-3  # training moved the rotations away from the identity
    assert (tuned - got).abs().max() < 1e-4


def test_chat_with_the_oft_adapter_answers_like_its_merge(tiny_llama, oft_run, merged):
    def ask(*spec):
        proc = subprocess.run(TUNEBOARD + ["chat", *spec, "template=llama3", "do_sample=false", "max_new_tokens=12",
                                           "--query", "Who are you?"],
                              cwd="/tmp", capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip()

    with_adapter = ask(f"model_name_or_path={tiny_llama}", f"adapter_name_or_path={oft_run}", "finetuning_type=oft")
    assert with_adapter and with_adapter == ask(f"model_name_or_path={merged}")
