"""The Distill tab's "from a local teacher model (logits)": its button's spec is a stage kd run of the top bar's model
from the teacher model / adapter, one the Train form's validate accepts; the Runs tab continues a kd run with DPO."""
from __future__ import annotations

import json

from backend.core.spec import validate_spec
from webui import jobs
from webui.tabs import distill as tab
from webui.tabs import runs


def test_logits_teacher_sets_up_a_kd_run(tiny_llama, random_llama_adapter):
    spec, message = tab.kd_spec(str(tiny_llama), "", str(random_llama_adapter), "lora", "none")
    assert spec.stage == "kd" and spec.teacher_model_name_or_path == str(tiny_llama)
    assert spec.teacher_adapter == str(random_llama_adapter) and spec.finetuning_type == "lora"
    assert str(random_llama_adapter) in message
    validate_spec(spec.flat_dict(include_defaults=False))  # with the files checked: the teacher shares the tokenizer
    spec, _ = tab.kd_spec(str(tiny_llama), str(tiny_llama), "", "lora", "4")
    assert spec.quantization_bit == 4 and spec.teacher_adapter is None
    spec, message = tab.kd_spec(str(tiny_llama), " ", "", "lora", None)
    assert spec is None and "teacher" in message


def test_a_finished_kd_run_continues_with_dpo(root):
    run = root / "kd-lora"
    jobs.write_spec_yaml(run, json.dumps({"model_name_or_path": "m", "output_dir": str(run), "stage": "kd",
                                          "teacher_model_name_or_path": "t", "kd_alpha": 0.5, "lora_rank": 4}))
    (run / "status.json").write_text(json.dumps({"state": "completed", "step": 1, "total_steps": 1}))
    (run / "adapter_config.json").write_text("{}")
    spec, message = runs.continue_dpo_spec(str(run))
    assert spec is not None, message
    assert spec.stage == "dpo" and spec.adapter_name_or_path == str(run) and spec.lora_rank == 4
    assert spec.teacher_model_name_or_path is None and spec.kd_alpha == 0  # kd's own keys stay behind
