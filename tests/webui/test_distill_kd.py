"""The Distill tab's "from a local teacher model (logits)": its button's spec is a stage kd run of the top bar's model
from the teacher model / adapter, one the Train form's validate accepts."""
from __future__ import annotations

from backend.core.spec import validate_spec
from webui.tabs import distill as tab


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
