"""What validate reads of a model or adapter without loading it (backend.core.model_files, model_modules): every model
and adapter a run loads exists here, and every module a method key names is a module of the model; the module
names read from the files are the ones the loader finds on the loaded model (so validate never refuses a name the
run would take)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from backend.core.model_modules import model_folder, names_in_folder
from backend.core.paths import DEFAULT_MODEL_ID
from backend.core.spec import SpecError, validate_spec
from backend.training.adapters import _decoder_layers, _module_short_names, find_all_linear_modules


def _outer(model) -> set[str]:
    """adapters._setup_freeze's modules outside the decoder layers."""
    layers_name, _ = _decoder_layers(model)
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if name and name != layers_name and not name.startswith(layers_name + ".")
            and any(True for _ in module.parameters(recurse=False))}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral", "default"])
def test_names_read_from_the_files_are_the_loaded_models(family, tiny_models, default_model_dir):
    from transformers import AutoModelForCausalLM

    folder = default_model_dir if family == "default" else tiny_models[family]
    if family == "default":
        assert model_folder(DEFAULT_MODEL_ID) == default_model_dir  # the bundled GGUF, read from its converted folder
    names = names_in_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    _, layers = _decoder_layers(model)
    assert names.linear == set(find_all_linear_modules(model))
    assert names.layer_parts == {name for name, _ in layers[0].named_children()}
    assert names.outer == _outer(model)
    assert names.modules <= _module_short_names(model) and names.linear | names.outer <= names.modules


def _messages(data: dict) -> dict[str, str]:
    try:
        validate_spec({"dataset": "extraction_demo", **data})
    except SpecError as exc:
        return dict(exc.errors)
    return {}


def test_a_module_the_model_lacks_is_refused_at_validate(tiny_llama):
    model = str(tiny_llama)
    assert _messages({"model_name_or_path": model, "lora_target": "q_proj,v_proj", "additional_target": "embed_tokens"}) == {}
    m = _messages({"model_name_or_path": model, "lora_target": "q_proj,qproj"})
    assert m["lora_target"].startswith("unknown module 'qproj' in ") and "available: down_proj, gate_proj" in m["lora_target"]
    m = _messages({"model_name_or_path": model, "lora_target": "embed_tokens", "additional_target": "embed_token"})
    assert "unknown module 'embed_tokens'" in m["lora_target"]  # an embedding is no linear layer: LoRA cannot adapt it
    assert "unknown module 'embed_token'" in m["additional_target"]
    m = _messages({"model_name_or_path": model, "finetuning_type": "oft", "oft_target": "o_proj,c_attn"})
    assert "unknown module 'c_attn'" in m["oft_target"]
    m = _messages({"model_name_or_path": model, "finetuning_type": "freeze", "freeze_trainable_modules": "mlp,attn",
                   "freeze_extra_modules": "norm,embeddings"})
    assert "unknown module 'attn'" in m["freeze_trainable_modules"] and "self_attn" in m["freeze_trainable_modules"]
    assert "unknown module 'embeddings'" in m["freeze_extra_modules"] and "embed_tokens" in m["freeze_extra_modules"]
    m = _messages({"model_name_or_path": model, "finetuning_type": "full", "use_galore": True, "galore_target": "mlp"})
    assert "unknown module 'mlp'" in m["galore_target"]


def test_models_and_adapters_a_run_loads_exist(tmp_path, tiny_llama, hub_cache):
    m = _messages({"model_name_or_path": "someone/some-model"})
    assert "'someone/some-model' is not in this machine's Hugging Face cache" in m["model_name_or_path"]
    hub_cache("someone/some-model", tiny_llama)
    assert _messages({"model_name_or_path": "someone/some-model"}) == {}
    assert "unknown module 'x'" in _messages({"model_name_or_path": "someone/some-model", "lora_target": "x"})["lora_target"]

    m = _messages({"adapter_name_or_path": str(tmp_path / "nope")})
    assert m["adapter_name_or_path"].startswith(f"{tmp_path / 'nope'} does not exist: give an adapter folder")
    run = tmp_path / "run"  # a run stopped after its second checkpoint: no adapter of its own
    for step in (2, 4):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
    assert f"give one of them ({run / 'checkpoint-4'})" in _messages({"adapter_name_or_path": str(run)})["adapter_name_or_path"]
    assert _messages({"adapter_name_or_path": str(run / "checkpoint-4")}) == {}
    assert "is a full model" in _messages({"adapter_name_or_path": str(tiny_llama)})["adapter_name_or_path"]
    assert _messages({"adapter_name_or_path": str(run), "checkpoints": "all"}).get("adapter_name_or_path") is None

    m = _messages({"stage": "kd", "teacher_model_name_or_path": str(tmp_path / "teacher")})
    assert m["teacher_model_name_or_path"] == f"{tmp_path / 'teacher'} does not exist"
    shutil.copytree(tiny_llama, tmp_path / "ref")
    (tmp_path / "ref" / "config.json").unlink()
    m = _messages({"stage": "dpo", "dataset": "dpo_en_demo", "ref_model": str(tmp_path / "ref"),
                   "finetuning_type": "full"})
    assert m["ref_model"] == f"{tmp_path / 'ref'} is not a model folder (no config.json and no .gguf file)"
    (tmp_path / "ref" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "ref_model" not in _messages({"stage": "dpo", "dataset": "dpo_en_demo", "ref_model": str(tmp_path / "ref"),
                                         "finetuning_type": "full"})


def test_an_adapter_config_peft_cannot_read_is_named(tmp_path):
    """validate said ok to an adapter_config.json holding `{bad` (or `[]`); train, chat and api then failed with
    json's bare "Expecting property name ..." naming no file."""
    from backend.core.model_files import adapter_problem

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{bad")
    assert adapter_problem(str(adapter)) == (f"{adapter / 'adapter_config.json'} is not valid JSON (line 1, column 2: "
                                             "Expecting property name enclosed in double quotes)")
    (adapter / "adapter_config.json").write_text("[]")
    assert "must hold a JSON object" in adapter_problem(str(adapter))
    (adapter / "adapter_config.json").write_text("{}")
    assert adapter_problem(str(adapter)) is None


def test_an_adapter_of_another_base_is_refused_at_validate(tmp_path, tiny_llama, wide_llama, tiny_gemma2, tiny_qwen2):
    """An adapter trained on tiny_llama (64 wide) given a 256-wide base passed validate; eval, chat, api and a
    resume then stopped after the model loaded with one peft 'size mismatch' line per matrix. validate reads both
    safetensors headers: it names the adapter and the first module that does not fit, for adapter_name_or_path, each
    checkpoint `checkpoints=` picks and resume_from_checkpoint; an adapter whose r is not its matrices' is named too.
    A base it fits (its own, and tiny_gemma2 of the same sizes, which peft loads it on) passes."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def lora(folder, **kwargs):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM", **kwargs)).save_pretrained(folder)
        return folder

    adapter = lora(tmp_path / "run" / "checkpoint-2", target_modules=["q_proj", "down_proj", "embed_tokens"],
                   modules_to_save=["lm_head"])
    (adapter / "trainer_state.json").write_text("{}")
    for base in (tiny_llama, tiny_gemma2):
        assert _messages({"model_name_or_path": str(base), "adapter_name_or_path": str(adapter)}) == {}
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_gemma2), str(adapter))  # it does fit

    def refusal(base, key="adapter_name_or_path", **data):
        return _messages({"model_name_or_path": str(base), "adapter_name_or_path": str(adapter), **data})[key]

    hint = f": give the base model it was trained on ({tiny_llama}, its adapter_config.json says)"
    assert refusal(wide_llama) == (f"adapter {adapter} does not fit {wide_llama}: its lm_head.weight is [49157, 64], "
                                   f"the base model's is [49157, 256]{hint}")
    assert refusal(tiny_qwen2).startswith(f"adapter {adapter} does not fit {tiny_qwen2}: its lm_head.weight is "
                                          "[49157, 64], the base model's is [49152, 64]")  # another vocabulary
    assert refusal(wide_llama, "checkpoints", adapter_name_or_path=str(tmp_path / "run"), checkpoints="all") \
        .startswith(f"checkpoint-2 of {tmp_path / 'run'} cannot be loaded: adapter {adapter} does not fit")
    assert refusal(wide_llama, "resume_from_checkpoint", adapter_name_or_path=None, output_dir=str(tmp_path / "run"),
                   resume_from_checkpoint=str(adapter), lora_rank=4).startswith(f"adapter {adapter} does not fit")

    plain = lora(tmp_path / "plain", target_modules=["down_proj"])
    m = _messages({"model_name_or_path": str(wide_llama), "adapter_name_or_path": str(plain)})["adapter_name_or_path"]
    assert m == (f"adapter {plain} does not fit {wide_llama}: its model.layers.0.mlp.down_proj takes 128 and gives 64 "
                 f"(lora_A [4, 128], lora_B [64, 4]), the base model's model.layers.0.mlp.down_proj.weight is "
                 f"[256, 512]{hint}")
    # a pre-quantized base (bnb, GPTQ, AWQ) stores its matrices packed: no shapes to compare, nothing refused here
    import shutil
    packed = shutil.copytree(wide_llama, tmp_path / "packed")
    base_config = json.loads((packed / "config.json").read_text())
    (packed / "config.json").write_text(json.dumps({**base_config, "quantization_config": {"quant_method": "bnb"}}))
    assert "adapter_name_or_path" not in _messages({"model_name_or_path": str(packed),
                                                    "adapter_name_or_path": str(plain)})
    config = json.loads((plain / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    m = _messages({"model_name_or_path": str(tiny_llama), "adapter_name_or_path": str(plain)})["adapter_name_or_path"]
    assert m == (f"adapter {plain}: its model.layers.0.mlp.down_proj has rank 4 (lora_A [4, 128]) and its "
                 "adapter_config.json says r 8: the files are not one adapter's")
