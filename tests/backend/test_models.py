"""backend.training.models on real (tiny and bundled) models: resolution, GGUF materialization, loading with
fallbacks, bitsandbytes QLoRA on the CPU, and which parameters each finetuning type trains."""
import os
import shutil
import time

import pytest
import torch

from backend.core import registry
from backend.training import models
from backend.training.adapters import apply_finetuning, count_parameters, find_all_linear_modules
from backend.training.models import load_model, load_tokenizer, materialize_gguf, resolve_model
from backend.core.model_files import gguf_cache_folder
from backend.core.paths import DEFAULT_MODEL_ID, default_model_file
from backend.core.registry import lookup_registry
from backend.core.spec import RunSpec

FAMILIES = ["llama", "qwen2", "gemma2", "mistral"]


def spec(**kwargs):
    return RunSpec(**kwargs)


def load(tiny_dir, warn=None, **kwargs):
    """Load a tiny model for training the way the stage does; returns (model, warnings)."""
    warnings = []
    s = spec(model_name_or_path=str(tiny_dir), **kwargs)
    model = load_model(s, resolve_model(str(tiny_dir)), warn=warnings.append)
    return model, warnings, s


def batch(model, n=2, length=12):
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (n, length))
    return {"input_ids": ids, "labels": ids.clone()}


def linear_names(model):
    """Full names of every nn.Linear except the output head."""
    head = model.get_output_embeddings()
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


# ---------------------------------------------------------------------------------------- registry
def test_registry_lookup_by_id_and_by_file_name():
    entry = lookup_registry("qwen/qwen2.5-7b-instruct")
    assert (entry.family, entry.template, entry.instruct) == ("qwen2", "qwen", True)
    assert lookup_registry("Qwen/Qwen2.5-7B").instruct is False
    # a file name containing the id's last component; the longest component wins (Instruct over base)
    entry = lookup_registry("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (entry.model_id, entry.template, entry.instruct) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", True)
    assert lookup_registry("/models/smollm2-360m").model_id == "HuggingFaceTB/SmolLM2-360M"
    assert lookup_registry("meta-llama-3.1-8b-instruct-q8_0.gguf").template == "llama3"
    assert lookup_registry("gemma-2-2b-it").template == "gemma"
    # whole components only: 72B is not 7B, and an unknown name matches nothing
    assert lookup_registry("Qwen2.5-72B-Instruct").model_id == "Qwen/Qwen2.5-72B-Instruct"
    assert lookup_registry("my-own-model") is None


def test_registry_templates_exist_as_names():
    known = {"qwen", "qwen3", "llama3", "llama2", "mistral", "gemma", "phi3", "phi4", "deepseek3", "glm4", "yi",
             "zephyr", "smollm2", "cohere", "falcon", "olmo", "granite3", "chatml", None}
    entries = registry.load_registry().values()
    assert len(entries) > 100
    assert {e.template for e in entries} <= known


# ---------------------------------------------------------------------------------------- resolve
def test_resolve_default_id_is_the_bundled_gguf():
    for name in (DEFAULT_MODEL_ID, DEFAULT_MODEL_ID.lower()):
        r = resolve_model(name)
        assert r.is_default and r.gguf_path == default_model_file()
        assert (r.model_id, r.family, r.template, r.instruct) == (DEFAULT_MODEL_ID, "llama", "smollm2", True)


def test_resolve_gguf_path_and_folder(tmp_path, tiny_llama):
    gguf = default_model_file()
    r = resolve_model(str(gguf))
    assert r.gguf_file == gguf.name and r.path == gguf.parent and not r.is_default
    assert (r.family, r.template, r.instruct) == ("llama", "smollm2", True)

    r = resolve_model(str(tiny_llama))
    assert r.gguf_file is None and r.path == tiny_llama.resolve()
    assert (r.family, r.template, r.instruct, r.model_id) == ("llama", None, None, "tiny_llama")

    # a folder holding one .gguf file is that file
    (tmp_path / "one").mkdir()
    os.symlink(gguf, tmp_path / "one" / gguf.name)
    assert resolve_model(str(tmp_path / "one")).gguf_file == gguf.name


def test_resolve_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"model 'someone/some-model' is not in this machine's Hugging Face cache "
                                         r"and nothing can be downloaded here: .*huggingface-cli download"):
        resolve_model("someone/some-model")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing" / "model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="is a LoRA adapter, not a model"):
        resolve_model(str(tmp_path / "adapter"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf model file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_resolve_hub_id_from_local_cache(tmp_path, monkeypatch, tiny_qwen2):
    """A hub id already in the HF cache resolves to its snapshot folder (no network)."""
    hub = tmp_path / "hub"
    snapshot = hub / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_qwen2, snapshot)
    (hub / "models--Qwen--Qwen2.5-0.5B-Instruct" / "refs").mkdir()
    (hub / "models--Qwen--Qwen2.5-0.5B-Instruct" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    r = resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    assert r.path == snapshot and r.gguf_file is None
    assert (r.model_id, r.family, r.template, r.instruct) == ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2", "qwen", True)


# ---------------------------------------------------------------------------------------- GGUF
def test_materialized_gguf_matches_direct_gguf_load(default_model_dir):
    """The cached folder is the GGUF model: same logits as transformers' own GGUF load, and cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_file()
    start = time.perf_counter()
    assert materialize_gguf(gguf) == default_model_dir  # second call: the same folder, no conversion
    assert time.perf_counter() - start < 2
    assert (default_model_dir / "chat_template.jinja").is_file() or "chat_template" in (
        default_model_dir / "tokenizer_config.json").read_text()

    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    cached = AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    assert getattr(cached.config, "quantization_config", None) is None
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2, 198]])
    with torch.no_grad():
        diff = (direct(ids).logits - cached(ids).logits).abs().max().item()
    assert diff <= 1e-5

    tok_direct = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok_cached = load_tokenizer(resolve_model(DEFAULT_MODEL_ID))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok_cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok_direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (tok_cached.pad_token, tok_cached.eos_token, tok_cached.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")


def test_materialize_is_atomic_and_reuses_a_finished_folder(tmp_path, monkeypatch, default_model_dir):
    """The cache key follows the file; a finished folder is reused, leftovers of a crash are ignored."""
    monkeypatch.setenv("TUNEBOARD_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "m.gguf"
    shutil.copy2(default_model_file(), copy)
    target = gguf_cache_folder(copy)
    assert target.parent == tmp_path / "cache" / "models" and target.name.startswith("m-")
    # pretend another process finished first: its folder is used as is
    shutil.copytree(default_model_dir, target)
    (target.parent / f".tmp-{target.name}-1-dead").mkdir()  # a crashed conversion's leftovers
    start = time.perf_counter()
    assert materialize_gguf(copy) == target
    assert time.perf_counter() - start < 2
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        materialize_gguf(tmp_path / "nope.gguf")


def test_full_finetuned_gguf_model_saves_and_reloads(tmp_path, default_model_dir):
    """A model loaded from a GGUF (via the cache) is a plain model: save_pretrained works, reload is equal."""
    s = spec(finetuning_type="full")
    model = apply_finetuning(load_model(s, resolve_model(DEFAULT_MODEL_ID), warn=print), s)
    assert count_parameters(model)[0] == count_parameters(model)[1]
    with torch.no_grad():
        model.model.norm.weight.add_(0.01)  # "training" changed something
    model.save_pretrained(tmp_path / "out")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(again.model.norm.weight, model.model.norm.weight)


# ---------------------------------------------------------------------------------------- loading
def test_load_tokenizer_sets_pad_only_when_missing(tiny_llama, tiny_qwen2):
    tok = load_tokenizer(resolve_model(str(tiny_llama)))  # llama-3 style: no pad token of its own
    assert tok.pad_token == tok.eos_token == "<|eot_id|>"
    tok = load_tokenizer(resolve_model(str(tiny_qwen2)))
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.chat_template


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallbacks")
@pytest.mark.parametrize("request_kwargs, expected", [
    pytest.param({"bf16": True}, "bf16 requested but not supported on this machine: training in fp32",
                 marks=pytest.mark.skipif(models.cpu_bf16_supported(), reason="honoured on this CPU: test_bf16.py")),
    pytest.param({"pure_bf16": True}, "bf16 requested but not supported on this machine: training in fp32",
                 marks=pytest.mark.skipif(models.cpu_bf16_supported(), reason="honoured on this CPU: test_bf16.py")),
    ({"fp16": True}, "fp16 requested but not supported on this machine: training in fp32"),
    ({"flash_attn": "fa2"}, "flash_attn=fa2 requested but flash-attn is not installed / no GPU: using SDPA"),
    ({"enable_liger_kernel": True}, "enable_liger_kernel requested but liger-kernel is not installed / no GPU"),
])
def test_unavailable_accelerations_warn_once_and_fall_back(tiny_llama, request_kwargs, expected):
    model, warnings, _ = load(tiny_llama, **request_kwargs)
    assert len(warnings) == 1 and warnings[0].startswith(expected)
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    model(**batch(model)).loss.backward()  # and it still trains


def test_attention_choices(tiny_llama):
    assert load(tiny_llama)[0].config._attn_implementation == "sdpa"
    model, warnings, _ = load(tiny_llama, flash_attn="disabled")
    assert model.config._attn_implementation == "eager" and warnings == []


def test_gradient_checkpointing_is_enabled(tiny_llama):
    model, _, s = load(tiny_llama, gradient_checkpointing=True)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    model = apply_finetuning(model, s)
    model.train()
    model(**batch(model)).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------- lora
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_all_targets_every_linear_but_the_head(tiny_models, family):
    model, _, s = load(tiny_models[family], lora_rank=4)
    expected = linear_names(model)
    assert expected and not any(n.endswith("lm_head") for n in expected)
    peft_model = apply_finetuning(model, s)
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == expected
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    peft_model(**batch(peft_model)).loss.backward()
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if p.requires_grad)


def test_lora_options_reach_peft(tiny_llama):
    model, _, s = load(tiny_llama, lora_rank=4, lora_alpha=16, lora_dropout=0.1, lora_target="q_proj,v_proj",
                       use_rslora=True, additional_target="embed_tokens")
    peft_model = apply_finetuning(model, s)
    cfg = peft_model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.use_rslora) == (4, 16, 0.1, True)
    assert set(cfg.target_modules) == {"q_proj", "v_proj"}
    assert cfg.modules_to_save and "embed_tokens" in cfg.modules_to_save
    assert spec(lora_rank=4).lora_alpha is None
    model, _, s = load(tiny_llama, lora_rank=4, use_dora=True)
    assert apply_finetuning(model, s).peft_config["default"].lora_alpha == 8  # default 2 x rank
    model, _, s = load(tiny_llama, lora_rank=4, pissa_init=True, pissa_iter=2)
    assert apply_finetuning(model, s).peft_config["default"].init_lora_weights == "pissa_niter_2"


def test_bad_lora_target_names_the_module_and_the_choices(tiny_llama):
    # validate refuses it from the model's files (test_model_files.py); the loader says the same on its own
    model, _, s = load(tiny_llama)
    with pytest.raises(ValueError, match=r"lora_target: unknown module 'attn_qkv'; available: .*q_proj"):
        apply_finetuning(model, s.model_copy(update={"lora_target": "q_proj,attn_qkv"}))


def test_resume_and_stack_adapters(tmp_path, tiny_llama):
    model, _, s = load(tiny_llama, lora_rank=4, lora_target="q_proj")
    first = apply_finetuning(model, s)
    with torch.no_grad():
        for n, p in first.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)  # a non-zero adapter, as after training
    first.save_pretrained(tmp_path / "a1")

    # resume: the last adapter is loaded trainable
    model, _, s = load(tiny_llama, lora_rank=4, adapter_name_or_path=str(tmp_path / "a1"))
    resumed = apply_finetuning(model, s)
    lora_b = [p for n, p in resumed.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.requires_grad and torch.all(p == 0.01) for p in lora_b)

    # create_new_adapter: the old one is merged into the base, a fresh one (all of them) is trained
    model, _, s = load(tiny_llama, lora_rank=4, adapter_name_or_path=str(tmp_path / "a1"), create_new_adapter=True)
    base_q = model.model.layers[0].self_attn.q_proj.weight.clone()
    fresh = apply_finetuning(model, s)
    merged_q = fresh.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(base_q, merged_q)
    assert all(torch.all(p == 0) for n, p in fresh.named_parameters() if "lora_B" in n)
    assert {n.rsplit(".", 1)[-1] for n, m in fresh.named_modules() if hasattr(m, "lora_A")} >= {"q_proj", "down_proj"}

    model, _, s = load(tiny_llama)  # validate refuses a missing adapter; the loader says the same on its own
    with pytest.raises(ValueError, match="is not an adapter folder"):
        apply_finetuning(model, s.model_copy(update={"adapter_name_or_path": str(tmp_path / "nope")}))


# ---------------------------------------------------------------------------------------- QLoRA
@pytest.mark.parametrize("bits, quant_type", [(4, "nf4"), (4, "fp4"), (8, "nf4")])
def test_qlora_trains_on_bitsandbytes(tiny_llama, bits, quant_type):
    import bitsandbytes as bnb

    model, warnings, s = load(tiny_llama, quantization_bit=bits, quantization_type=quant_type,
                              double_quantization=True, lora_rank=4)
    layer_type = bnb.nn.Linear4bit if bits == 4 else bnb.nn.Linear8bitLt
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, layer_type)
    if bits == 4:
        assert q_proj.weight.quant_state.quant_type == quant_type
        assert q_proj.weight.quant_state.nested  # double quantization
    _, total_before = count_parameters(model)
    peft_model = apply_finetuning(model, s)
    trainable, total = count_parameters(peft_model)
    assert 0 < trainable < total and total > total_before  # 4-bit weights counted as values, plus adapters
    peft_model.train()
    peft_model(**batch(peft_model)).loss.backward()
    lora = [p for n, p in peft_model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lora)
    assert any(p.grad.abs().sum() > 0 for p in lora)


def test_quantization_needs_lora(tiny_llama):
    s = spec(finetuning_type="lora", quantization_bit=4)
    s.finetuning_type = "full"  # bypass the spec's own cross-field check: models.py checks too
    with pytest.raises(ValueError, match="needs finetuning_type: lora"):
        load_model(s, resolve_model(str(tiny_llama)))


# ---------------------------------------------------------------------------------------- freeze / full
def test_freeze_last_layers_trains_exactly_those(tiny_gemma2):
    model, _, s = load(tiny_gemma2, finetuning_type="freeze", freeze_trainable_layers=1)
    apply_finetuning(model, s)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if n.startswith("model.layers.1.")}
    model(**batch(model)).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_freeze_first_layers_named_modules_and_extras(tiny_llama):
    model, _, s = load(tiny_llama, finetuning_type="freeze", freeze_trainable_layers=-1,
                       freeze_trainable_modules="mlp", freeze_extra_modules="embed_tokens,norm")
    apply_finetuning(model, s)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {n for n, _ in model.named_parameters() if n.startswith("model.layers.0.mlp.")}
    assert trainable == expected | {"model.embed_tokens.weight", "model.norm.weight"}
    trained, total = count_parameters(model)
    assert trained == sum(p.numel() for n, p in model.named_parameters() if n in trainable) < total


def test_freeze_bad_module_names_are_named(tiny_llama):
    # validate refuses them from the model's files (test_model_files.py); the loader says the same on its own
    model, _, s = load(tiny_llama, finetuning_type="freeze")
    with pytest.raises(ValueError, match=r"freeze_trainable_modules: unknown module 'attention'; available: .*self_attn"):
        apply_finetuning(model, s.model_copy(update={"freeze_trainable_modules": "mlp,attention"}))
    model, _, s = load(tiny_llama, finetuning_type="freeze")
    with pytest.raises(ValueError, match=r"freeze_extra_modules: unknown module 'wte'; available: .*embed_tokens"):
        apply_finetuning(model, s.model_copy(update={"freeze_extra_modules": "wte"}))


@pytest.mark.parametrize("family", FAMILIES)
def test_full_trains_everything(tiny_models, family):
    model, _, s = load(tiny_models[family], finetuning_type="full")
    apply_finetuning(model, s)
    trainable, total = count_parameters(model)
    assert trainable == total == sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_methods_not_done_yet_say_so(tiny_llama):
    """validate refuses use_llama_pro; a spec that skipped validation still fails clearly. use_galore works now
    (tests/backend/test_features.py)."""
    from types import SimpleNamespace

    model, _, s = load(tiny_llama, finetuning_type="full", use_galore=True)
    apply_finetuning(model, s)
    with pytest.raises(NotImplementedError, match="not implemented yet: use_llama_pro"):
        apply_finetuning(model, SimpleNamespace(finetuning_type="full", use_llama_pro=True))


def test_find_all_linear_modules_excludes_a_tied_head(tiny_gemma2):
    model, _, _ = load(tiny_gemma2)
    assert model.config.tie_word_embeddings
    assert find_all_linear_modules(model) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_models_without_sdpa_fall_back_to_eager(tiny_gemma2):
    """Gemma 2 has no SDPA path in transformers: auto picks eager silently, fa2 warns once."""
    model, warnings, _ = load(tiny_gemma2)
    assert model.config._attn_implementation == "eager" and warnings == []
    if not torch.cuda.is_available():
        model, warnings, _ = load(tiny_gemma2, flash_attn="fa2")
        assert model.config._attn_implementation == "eager"
        assert warnings == ["flash_attn=fa2 requested but flash-attn is not installed / no GPU: using eager attention"]
