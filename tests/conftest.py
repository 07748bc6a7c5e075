"""Shared test setup: an offline environment and tiny random models of four families."""
import os

# Offline and quiet before anything imports huggingface_hub / gradio. TUNEBOARD_CACHE is deliberately left
# alone: the default model converted from GGUF is cached there and reused across test runs.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# bf16 left unset trains in fp32 here on every CPU (on one with native bf16 matmul it is on by default:
# backend.training.models.bf16_by_default), so the exactness checks compare fp32 with fp32 on any machine;
# tests/backend/test_bf16.py takes the default path itself; TUNEBOARD_BF16_AUTO=1 runs any test under the default.
os.environ.setdefault("TUNEBOARD_BF16_AUTO", "0")
# `make test` runs the non-browser tests in two pytest-xdist workers on the 2 cores: each worker and every
# process it starts (training runs, servers) computes on one thread, so two runs side by side share the
# cores instead of oversubscribing them (OpenMP threads spinning against each other slow both far more).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402


BROWSER_TESTS = "tests/e2e/"


def pytest_collection_modifyitems(config, items):
    """The browser tests first: under `make test` they are the first unit of work (see below)."""
    items.sort(key=lambda item: not item.nodeid.startswith(BROWSER_TESTS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs in two pytest-xdist workers (-n 2 --dist loadfile --no-loadscope-reorder): the browser
    tests are one unit, queued first, so one worker drives the one browser from the start while the other takes
    the rest; every other module is a unit of its own (its module fixtures, e.g. the distributed runs, run once).
    (xdist's own --dist loadgroup would do this with marks, but with pytest 9 it no longer reads them.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class BrowserTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return BROWSER_TESTS if module.startswith(BROWSER_TESTS) else module

    return BrowserTestsTogether(config, log)


def built_once(tmp_path_factory, name: str, build):
    """A folder that `build(folder)` fills once per test session, shared by the pytest-xdist workers (each worker
    has its own session: a trained fixture would otherwise be trained once per worker). The first worker builds
    it under a file lock in the folder the workers' temp folders share; the others wait and reuse it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not (folder / ".built").exists():
            folder.mkdir(exist_ok=True)
            build(folder)
            (folder / ".built").touch()
    return folder

# ======================================================================== tiny model fixtures (models)
# Tiny random Llama / Qwen2 / Gemma2 / Mistral models (hidden 64, 2 layers, 4 heads, 2 kv heads), built
# once per test session in a temp dir. Their tokenizers are the SmolLM2 tokenizer (from the bundled GGUF)
# plus each family's special tokens, so templates and masks see the real markers. Only the qwen2 one
# carries a chat template (ChatML): the others exercise the registry / named-template path.

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# family -> (added special tokens, bos, eos, pad, chat template)
TINY_FAMILIES = {
    "llama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
              "<|begin_of_text|>", "<|eot_id|>", None, None),
    "qwen2": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE),
    "gemma2": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>"], "<bos>", "<eos>", "<pad>", None),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", None, None),
}


@pytest.fixture(scope="session")
def default_model_dir():
    """The bundled SmolLM2-135M-Instruct GGUF as a plain HF folder (converted once, cached across runs)."""
    from backend.training.models import materialize_gguf
    from backend.core.paths import default_model_file

    return materialize_gguf(default_model_file())


def _tiny_config(family: str, tokenizer):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma2": Gemma2Config, "mistral": MistralConfig}[family]
    return cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _build_tiny(family: str, base_tokenizer_dir, out_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    added, bos, eos, pad, chat_template = TINY_FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": added}, replace_extra_special_tokens=False)
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = bos, eos, pad
    tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    config = _tiny_config(family, tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model_dir):
    """{family: folder} for llama, qwen2, gemma2, mistral."""
    def build(root):
        for family in TINY_FAMILIES:
            _build_tiny(family, default_model_dir, root / f"tiny_{family}")

    root = built_once(tmp_path_factory, "tiny_models", build)  # one path per model for every worker
    return {family: root / f"tiny_{family}" for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def wide_llama(tiny_llama, tmp_path_factory):
    """A random one-layer Llama 256 wide, tiny_llama's tokenizer: llama.cpp's k-quants take its matrices (their
    rows are a multiple of 256), so a q4_k_m export of it is a real Q4_K file (tests of llama.cpp exports, Chat on one)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    # a context of 2048: Chat's default max_new_tokens (512) fits it, whatever the slider is set to
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("wide_llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models):
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def tiny_gemma2(tiny_models):
    return tiny_models["gemma2"]


@pytest.fixture(scope="session")
def tiny_mistral(tiny_models):
    return tiny_models["mistral"]


# ==================================================================== end of tiny model fixtures (models)


# ======================================================== a Hugging Face cache of our own (hub ids)
@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A function putting a model under its hub id into a Hugging Face cache of this test's own (HF_HUB_CACHE, as
    huggingface_hub lays it out: refs/main naming a snapshot), so a spec naming it by id validates and loads:
    hub_cache("Qwen/Qwen2.5-7B-Instruct") (a config.json only) or hub_cache(id, folder) (a copy of that model)."""
    import json
    import shutil

    import huggingface_hub.constants as constants

    root = tmp_path / "hf_hub_cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))

    def add(model_id: str, folder=None):
        repo = root / ("models--" + model_id.replace("/", "--"))
        snapshot = repo / "snapshots" / ("0" * 40)
        if folder is not None:
            shutil.copytree(folder, snapshot)
        else:
            snapshot.mkdir(parents=True)
            (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
        return snapshot

    return add


# ============================================================ the identity demo adapter (slow tests)
@pytest.fixture(scope="session")
def identity_adapter(tmp_path_factory):
    """examples/sft_lora_identity.yaml trained once per session on the bundled default model through
    `tuneboard train` (the `make demo` run, a few minutes on 2 CPU cores); shared by the slow tests
    that need a really trained adapter (chat identity, export of the default model)."""
    import subprocess
    import sys

    from backend.core.paths import REPO_ROOT

    def build(folder):
        proc = subprocess.run([sys.executable, "-m", "backend.cli", "train", "examples/sft_lora_identity.yaml",
                               f"output_dir={folder / 'run'}", "plot_loss=false"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    run = built_once(tmp_path_factory, "identity", build) / "run"
    assert (run / "adapter_config.json").is_file()
    return run


# ============================================ a tiny LoRA run with two checkpoints (checkpoint evals)
@pytest.fixture(scope="session")
def random_llama_adapter(tiny_llama, tmp_path_factory):
    """A LoRA adapter with random (not identity) weights on tiny_llama (seeded): the tuned model differs from the
    base without a training run."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    out = tmp_path_factory.mktemp("random_llama_adapter") / "adapter"
    get_peft_model(model, LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"],
                                     init_lora_weights=False, task_type="CAUSAL_LM")).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def lora_checkpoints_run(tiny_qwen2, tmp_path_factory):
    """A tiny LoRA SFT run through `tuneboard train` with checkpoint-2, checkpoint-4 and its final adapter
    (4 steps at a high learning rate, so the checkpoints' weights differ); trained once per session. Copy it
    before changing it."""
    import subprocess
    import sys

    def build(folder):
        proc = subprocess.run(
            [sys.executable, "-m", "backend.cli", "train", f"model_name_or_path={tiny_qwen2}",
             f"output_dir={folder / 'lora'}", "dataset=identity", "cutoff_len=64", "per_device_train_batch_size=2",
             "gradient_accumulation_steps=1", "logging_steps=1", "learning_rate=0.01", "max_steps=4",
             "save_steps=2", "lora_rank=4", "plot_loss=false"],
            cwd="/tmp", capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    return built_once(tmp_path_factory, "ckpt_run", build) / "lora"
