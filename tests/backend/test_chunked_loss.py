"""Chunked linear + cross-entropy (backend.training.losses): the same loss and gradients as transformers' plain
causal-LM loss, without ever holding the [tokens x vocab] logits; installed on the four tiny families
(Gemma 2 with its logit soft-capping), refused by the probe where the head is not a plain projection."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from backend.training import losses
from backend.training.losses import causal_lm_loss
from backend.training.models import install_chunked_loss

FAMILIES = ["llama", "qwen2", "gemma2", "mistral"]


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def plain_loss(hidden, weight, bias, labels, num_items, softcap=None):
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100, reduction=reduction)
    return loss if num_items is None else loss / num_items


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("num_items", [None, 29])
@pytest.mark.parametrize("with_bias", [False, True])
def test_same_loss_and_grads_as_the_plain_loss(monkeypatch, softcap, num_items, with_bias):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 7 * 50)  # 7 tokens a chunk: several chunks and a ragged last one
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=gen)
    weight = torch.randn(50, 16, generator=gen) * 0.5
    bias = torch.randn(50, generator=gen) if with_bias else None
    labels = torch.randint(0, 50, (3, 11), generator=gen)
    labels[0, :4] = -100
    labels[2, :] = -100  # a row with nothing to learn
    results = []
    for fn in (plain_loss, lambda h, w, b, y, n, s: causal_lm_loss(h, w, b, y, num_items_in_batch=n, softcap=s)):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
        loss = fn(leaves[0], leaves[1], leaves[2] if with_bias else None, labels, num_items, softcap)
        loss.backward()
        results.append((loss.detach(), [t.grad for t in leaves]))
    (loss_plain, grads_plain), (loss_chunked, grads_chunked) = results
    torch.testing.assert_close(loss_chunked, loss_plain, rtol=1e-6, atol=1e-6)
    for chunked, plain in zip(grads_chunked, grads_plain):
        torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
    # positions with no label to predict (shifted: hidden t predicts label t+1) get no gradient
    assert grads_chunked[0][2].abs().sum() == 0 and grads_chunked[0][0, :3].abs().sum() == 0
    assert grads_chunked[0][0, 3].abs().sum() > 0


def test_frozen_head_gets_no_gradient_and_no_work():
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(30, 8)  # frozen (LoRA leaves the head alone)
    loss = causal_lm_loss(hidden, weight, None, torch.randint(0, 30, (2, 5)))
    loss.backward()
    assert hidden.grad is not None and weight.grad is None


def family_pair(folder, extra):
    """Two copies of one tiny model: plain loss, and chunked loss installed."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).train()
    chunked = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).train()
    assert install_chunked_loss(chunked) is None
    assert chunked.training  # the probe left the mode alone
    return plain, chunked


@pytest.mark.parametrize("family", FAMILIES)
def test_installed_on_the_tiny_families_same_loss_and_grads(tiny_models, family):
    extra = {"final_logit_softcapping": 2.0} if family == "gemma2" else {}  # a cap the logits really reach
    plain, chunked = family_pair(tiny_models[family], extra)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, plain.config.vocab_size, (2, 40), generator=gen)
    labels = ids.clone()
    labels[:, :25] = -100
    batch = {"input_ids": ids, "labels": labels, "num_items_in_batch": torch.tensor(int((labels[:, 1:] != -100).sum()))}
    out_plain = plain(**batch)
    out_plain.loss.backward()
    with LargestTensor() as seen:
        out_chunked = chunked(**batch)
        out_chunked.loss.backward()
    torch.testing.assert_close(out_chunked.loss, out_plain.loss, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in chunked.named_parameters()}
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-5, msg=f"{family}: {name}")
    vocab = plain.config.vocab_size
    assert out_chunked.logits.numel() == 0
    assert seen.largest < ids.numel() * vocab  # never the full logits, forward or backward
    # eval keeps the plain forward (logits for the evaluation loop)
    chunked.eval()
    with torch.no_grad():
        assert chunked(**batch).logits.shape == (2, 40, vocab)


def test_probe_keeps_the_plain_loss_where_the_head_does_more(tiny_llama):
    """A head the chunked path does not reproduce (here: a logit soft-capping Llama does not apply) is
    caught by the probe, and the model keeps its plain forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.config.final_logit_softcapping = 0.5
    forward = model.forward
    problem = install_chunked_loss(model)
    assert problem and "not a plain projection" in problem
    assert model.forward == forward


def test_lora_model_and_liger_gate(tiny_llama):
    """Through the peft wrapper the LM inside is patched; a model Liger already patched is left alone."""
    from types import SimpleNamespace

    from backend.training.adapters import apply_finetuning
    from backend.training.models import load_model, resolve_model

    spec = SimpleNamespace(model_name_or_path=str(tiny_llama), lora_rank=4, gradient_checkpointing=False)
    model = apply_finetuning(load_model(spec, resolve_model(str(tiny_llama))), spec)
    assert install_chunked_loss(model) is None
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.get_base_model().tuneboard_chunked_loss
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    model.tuneboard_liger = True
    assert "Liger" in install_chunked_loss(model)
