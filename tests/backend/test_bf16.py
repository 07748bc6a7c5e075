"""bf16 on CPUs with native bf16 matmul: `bf16: true` is honoured there (the model loads in bf16, trained
weights stay fp32, the Trainer runs under autocast) and falls back to fp32 with a warning elsewhere; the loss
drift against fp32 on the default model is measured and bounded."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backend.training.adapters import apply_finetuning
from backend.training.models import compute_dtype, cpu_bf16_supported, install_chunked_loss, load_model, resolve_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (a GPU decides bf16 by itself)")

TEXTS = ["The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
         "Extract the product as JSON: Product: Aero Desk Lamp | Price: $42.50 | In stock | SKU: B1234"]


def test_bf16_request_follows_the_cpu():
    warnings = []
    dtype = compute_dtype(SimpleNamespace(bf16=True), warnings.append)
    if cpu_bf16_supported():
        assert dtype == torch.bfloat16 and warnings == []
    else:
        assert dtype == torch.float32 and "bf16" in warnings[0]
    # fp16 stays a GPU-only setting
    assert compute_dtype(SimpleNamespace(fp16=True), warnings.append) == torch.float32


def test_trainer_gets_bf16_only_where_the_model_is_bf16(tmp_path):
    from backend.core.spec import RunSpec
    from backend.stages.base import training_arguments

    args = training_arguments(RunSpec(bf16=True), tmp_path, has_eval=False)
    assert args.bf16 is cpu_bf16_supported()
    assert training_arguments(RunSpec(), tmp_path, has_eval=False).bf16 is False


def one_lora_step(model_dir, bf16: bool, batch) -> tuple[float, dict]:
    from transformers import set_seed

    set_seed(0)
    spec = SimpleNamespace(model_name_or_path=str(model_dir), bf16=bf16, lora_rank=8, lora_target="all",
                           gradient_checkpointing=False)
    model = apply_finetuning(load_model(spec, resolve_model(str(model_dir))), spec)
    assert install_chunked_loss(model) is None
    with torch.no_grad():  # non-zero B so the A matrices get a gradient to compare
        gen = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01, generator=gen)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # fp32 master weights
    if bf16:
        assert model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight.dtype == torch.bfloat16
    return loss.item(), grads


@pytest.mark.skipif(not cpu_bf16_supported(), reason="this CPU has no native bf16 matmul: it trains in fp32")
def test_bf16_loss_drift_against_fp32(default_model_dir, capsys):
    """One LoRA step on the default model (SmolLM2-135M) in fp32 and in bf16 autocast: the loss drifts by well
    under 1%, the LoRA gradients point the same way (cosine > 0.98). The measured figures are printed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    loss32, grads32 = one_lora_step(default_model_dir, False, batch)
    loss16, grads16 = one_lora_step(default_model_dir, True, batch)
    drift = abs(loss16 - loss32) / loss32
    flat32 = torch.cat([g.flatten() for g in grads32.values()])
    flat16 = torch.cat([grads16[n].flatten() for n in grads32])
    cosine = torch.nn.functional.cosine_similarity(flat32, flat16, dim=0).item()
    with capsys.disabled():
        print(f"\nbf16 vs fp32 on SmolLM2-135M, one LoRA step: loss {loss16:.5f} vs {loss32:.5f} "
              f"(drift {100 * drift:.3f}%), LoRA gradient cosine {cosine:.5f}")
    assert drift < 1e-2
    assert cosine > 0.98
    assert loss16 != loss32  # really computed in bf16


def test_a_small_lora_update_reaches_the_output_under_bf16_autocast(tiny_llama):
    """The adapter's contribution in the first steps is ~1e-3 of a layer's output: summed with it in bf16 it was
    rounded away (bench/README.md, bf16 over 30 steps). Under bf16 autocast, what a small LoRA B changes in an adapted
    layer's output must be what it changes in fp32 (apply_finetuning's LoRA layers add their branch in fp32)."""
    from transformers import AutoModelForCausalLM

    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(0))

    def lora_effect(dtype) -> torch.Tensor:
        spec = SimpleNamespace(model_name_or_path=str(tiny_llama), bf16=dtype == torch.bfloat16, lora_rank=8,
                               lora_target="all", gradient_checkpointing=False)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype)
        torch.manual_seed(0)  # the same LoRA A in both
        model = apply_finetuning(base, spec).eval()
        layer = model.get_base_model().model.layers[0].mlp.up_proj
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for name, param in layer.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 2e-4)
            inputs = x[..., :layer.in_features].to(dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                tuned = layer(inputs).float()
                with model.disable_adapter():
                    plain = layer(inputs).float()
        return (tuned - plain).flatten()

    fp32, bf16 = lora_effect(torch.float32), lora_effect(torch.bfloat16)
    assert fp32.abs().max() > 0
    assert torch.nn.functional.cosine_similarity(fp32, bf16, dim=0) > 0.99


def _answer_batches(tokenizer, rows) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One [1, T] row per example, chatml, labels on the answer tokens only."""
    out = []
    for row in rows:
        prompt = tokenizer(f"<|im_start|>user\n{row['instruction']}\n{row['input']}<|im_end|>\n"
                           "<|im_start|>assistant\n").input_ids
        answer = tokenizer(f"{row['output']}<|im_end|>").input_ids
        ids = torch.tensor([prompt + answer])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100
        out.append((ids, labels))
    return out


def _answer_loss(model, batches, bf16: bool) -> float:
    total = count = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for ids, labels in batches:
            n = int((labels[0, 1:] != -100).sum())
            total += model(input_ids=ids, labels=labels).loss.item() * n
            count += n
    return total / count


@pytest.mark.skipif(not cpu_bf16_supported(), reason="this CPU has no native bf16 matmul: it trains in fp32")
def test_bf16_learns_like_fp32_read_by_the_same_forward(default_model_dir, capsys):
    """Issue 26 item 3. Four LoRA steps of the default model on extraction rows, in fp32 and in bf16 (the model
    loaded in bf16, autocast, LoRA weights and AdamW's state fp32), from the same start: both adapters, read by the
    same fp32 forward on held-out rows, score within 1% of each other and both well below the base. The losses a
    bf16 run logs are its own bf16 forward's reading, which is itself off fp32's by about that much on the same
    weights (bench/README.md, 2026-12-04), so the learning is compared through one forward."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer, set_seed

    rows = json.loads((Path(__file__).resolve().parents[2] / "data" / "extraction_demo.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    train, held_out = _answer_batches(tokenizer, rows[:8]), _answer_batches(tokenizer, rows[-8:])

    def trained(bf16: bool):
        set_seed(0)
        spec = SimpleNamespace(model_name_or_path=str(default_model_dir), bf16=bf16, lora_rank=8, lora_target="all",
                               gradient_checkpointing=False)
        model = apply_finetuning(load_model(spec, resolve_model(str(default_model_dir))), spec)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.0)
        logged = []
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                losses = [model(input_ids=ids, labels=labels).loss for ids, labels in train[2 * step:2 * step + 2]]
            loss = sum(losses) / len(losses)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            logged.append(round(loss.item(), 4))
        return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}, logged

    lora32, logged32 = trained(False)
    lora16, logged16 = trained(True)
    reader = apply_finetuning(load_model(SimpleNamespace(bf16=False), resolve_model(str(default_model_dir))),
                              SimpleNamespace(lora_rank=8, lora_target="all"))
    reader.eval()

    def read(weights) -> float:
        with torch.no_grad():
            for name, param in reader.named_parameters():
                if name in weights:
                    param.copy_(weights[name])
        return _answer_loss(reader, held_out, bf16=False)

    base = read({n: torch.zeros_like(w) if "lora_B" in n else w for n, w in lora32.items()})
    loss32, loss16 = read(lora32), read(lora16)
    with capsys.disabled():
        print(f"\nlogged losses fp32 {logged32} bf16 {logged16}; held-out answer loss (fp32 forward): base "
              f"{base:.5f}, fp32-trained {loss32:.5f}, bf16-trained {loss16:.5f} ({100 * (loss16 / loss32 - 1):+.2f}%)")
    assert logged16 != logged32  # the bf16 run really computed in bf16
    assert loss32 < 0.9 * base and loss16 < 0.9 * base  # both learned something to compare
    assert abs(loss16 / loss32 - 1) < 0.01


def test_bf16_is_the_default_for_training_where_the_cpu_has_it(monkeypatch, tmp_path):
    """Issue 26 item 3: bf16 left unset trains LoRA SFT / PT in bf16 on a CPU with native bf16 matmul (the run log
    says so: BF16_DEFAULT_NOTE), fp32 elsewhere and for the other stages and methods; `bf16: false` keeps fp32;
    inference keeps fp32."""
    from backend.core.spec import RunSpec
    from backend.stages.base import training_arguments
    from backend.training.models import bf16_by_default

    monkeypatch.delenv("TUNEBOARD_BF16_AUTO", raising=False)  # conftest keeps the suite in fp32
    native = cpu_bf16_supported()
    assert bf16_by_default(RunSpec()) is native
    assert compute_dtype(RunSpec()) == (torch.bfloat16 if native else torch.float32)
    assert training_arguments(RunSpec(), tmp_path, has_eval=False).bf16 is native
    assert compute_dtype(RunSpec(), training=False) == torch.float32
    assert compute_dtype(RunSpec(bf16=False)) == torch.float32
    assert training_arguments(RunSpec(bf16=False), tmp_path, has_eval=False).bf16 is False
    assert not bf16_by_default(RunSpec(quantization_bit=4, finetuning_type="lora"))
    assert not bf16_by_default(RunSpec(pure_bf16=True))
    # only where it was measured to learn like fp32: LoRA (not DoRA), stages sft and pt (their declarations say so)
    assert bf16_by_default(SimpleNamespace(stage="pt", finetuning_type="lora")) is native
    for other in ({"stage": "dpo"}, {"stage": "grpo"}, {"stage": "rm"}, {"finetuning_type": "freeze"},
                  {"finetuning_type": "full"}, {"use_dora": True}):
        assert not bf16_by_default(SimpleNamespace(**{"stage": "sft", "finetuning_type": "lora", **other})), other
    monkeypatch.setenv("TUNEBOARD_BF16_AUTO", "0")
    assert compute_dtype(RunSpec()) == torch.float32
