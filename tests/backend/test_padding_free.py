"""Padding-free batches: the rows of one batch concatenated into one sequence (per-row position ids, no
attention across rows) give the loss and gradients of the same rows right-padded, on the four tiny families;
the probe that decides padding-free for a model says yes for them and no where rows would attend to each other."""
from __future__ import annotations

import random

import pytest
import torch

from backend.training.models import padding_free_problem
from backend.dataprep.preprocess import IGNORE_INDEX, PaddingCollator, PaddingFreeCollator

FAMILIES = ["llama", "qwen2", "gemma2", "mistral"]


def make_rows(n: int, vocab: int, seed: int) -> list[dict]:
    """Rows of very different lengths, masked prompts, some trained on the prompt (first label set)."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        prompt, answer = rng.randint(2, 30), rng.randint(1, 20)
        ids = [rng.randrange(vocab) for _ in range(prompt + answer)]
        labels = list(ids) if k % 3 == 0 else [IGNORE_INDEX] * prompt + ids[prompt:]
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)})
    return rows


def loss_and_grads(model, batch) -> tuple[float, dict]:
    """One forward/backward as the Trainer runs it (sum over tokens / trained tokens of the batch)."""
    model.zero_grad()
    num_items = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    loss = model(**batch, num_items_in_batch=num_items).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(f"tiny_{request.param}")
    extra = {"sliding_window": 8} if request.param == "gemma2" else {}  # shorter than the rows: the window matters
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra)  # its default attention
    model.train()  # dropout is 0 in these configs: train mode changes nothing but is what training runs
    return request.param, model


def test_padding_free_equals_padded(family_model):
    family, model = family_model
    rows = make_rows(6, model.config.vocab_size, seed=5)
    padded = PaddingCollator(0)(rows)
    free = PaddingFreeCollator()(rows)
    assert free["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows)) and "attention_mask" not in free
    assert padded["input_ids"].numel() > free["input_ids"].numel()  # padding was there to save
    assert int((free["labels"] != IGNORE_INDEX).sum()) == int((padded["labels"][:, 1:] != IGNORE_INDEX).sum())

    loss_padded, grads_padded = loss_and_grads(model, padded)
    loss_free, grads_free = loss_and_grads(model, free)
    assert loss_free == pytest.approx(loss_padded, rel=1e-5), family
    assert grads_free.keys() == grads_padded.keys() and grads_free
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_free[name], grad, rtol=1e-5, atol=1e-5, msg=f"{family}: {name}")
    assert padding_free_problem(model) is None, family
    assert model.training  # the probe left the mode alone


def test_probe_refuses_where_rows_would_attend_to_each_other(tiny_llama, monkeypatch):
    """A model whose attention ignores the packed position ids (simulated: transformers' packed-sequence
    detection switched off) must keep padding, and an attention that takes no position ids is refused by name."""
    from transformers import AutoModelForCausalLM, masking_utils

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert padding_free_problem(model) is None
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    problem = padding_free_problem(model)
    assert problem and "attend to each other" in problem
    monkeypatch.undo()
    model.config._attn_implementation = "flex_attention"
    assert "flex_attention" in padding_free_problem(model)


def test_collator_keeps_the_rows_of_the_batch():
    """Unlike packing, the batch is exactly the rows given, in order, each from position 0."""
    rows = make_rows(4, 97, seed=1)
    batch = PaddingFreeCollator()(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"][0].tolist() == [t for r in rows for t in r["input_ids"]]
    assert batch["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    starts = [sum(lengths[:k]) for k in range(len(rows))]
    assert all(batch["labels"][0, s].item() == IGNORE_INDEX for s in starts)
    assert batch["use_cache"] is False


def test_varlen_sdpa_equals_padded(family_model):
    """The varlen SDPA (one causal attention per row, rows from the collator's cu_seq_lens) gives the padded
    batch's loss and gradients; a padded batch through the switched model is unchanged; the model goes back."""
    from backend.training.attention import NAME, use_varlen_attention

    family, model = family_model
    before = model.config._attn_implementation
    rows = make_rows(6, model.config.vocab_size, seed=7)
    padded = PaddingCollator(0)(rows)
    loss_padded, grads_padded = loss_and_grads(model, padded)
    problem = use_varlen_attention(model)
    try:
        if before != "sdpa":
            assert problem and before in problem and model.config._attn_implementation == before
            return
        assert problem is None and model.config._attn_implementation == NAME, family
        free = PaddingFreeCollator(flash_attn_kwargs=True)(rows)
        assert free["cu_seq_lens_q"].tolist() == [0, *torch.tensor([len(r["input_ids"]) for r in rows]).cumsum(0).tolist()]
        loss_free, grads_free = loss_and_grads(model, free)
        assert loss_free == pytest.approx(loss_padded, rel=1e-5), family
        for name, grad in grads_padded.items():
            torch.testing.assert_close(grads_free[name], grad, rtol=1e-5, atol=1e-5, msg=f"{family}: {name}")
        assert loss_and_grads(model, padded)[0] == pytest.approx(loss_padded, rel=1e-6)  # no cu_seq_lens: plain SDPA
        assert model.training
    finally:
        model.set_attn_implementation(before)


def test_varlen_sdpa_equals_the_packed_mask(family_model):
    """Packing (several rows in one sequence, position_ids restarting per row) through the varlen SDPA, one causal
    attention per packed row from the collator's cu_seq_lens, gives the loss and gradients of SDPA with the
    block-diagonal mask transformers builds from the position_ids."""
    from backend.training.attention import NAME, use_varlen_attention
    from backend.dataprep.preprocess import PackedCollator, pack_rows

    family, model = family_model
    before = model.config._attn_implementation
    packed = pack_rows(make_rows(9, model.config.vocab_size, seed=11), 64)
    assert len(packed) >= 2 and any(row["position_ids"].count(0) > 1 for row in packed)
    masked = PackedCollator()(packed)
    loss_masked, grads_masked = loss_and_grads(model, masked)
    if use_varlen_attention(model) is not None:
        assert before != "sdpa", family
        return
    try:
        assert model.config._attn_implementation == NAME
        loss_varlen, grads_varlen = loss_and_grads(model, PackedCollator(flash_attn_kwargs=True)(packed))
        assert loss_varlen == pytest.approx(loss_masked, rel=1e-5), family
        for name, grad in grads_masked.items():
            torch.testing.assert_close(grads_varlen[name], grad, rtol=1e-5, atol=1e-5, msg=f"{family}: {name}")
    finally:
        model.set_attn_implementation(before)


def test_varlen_sdpa_backward_is_linear_in_the_rows():
    """Many rows in one batch (a packed 4096-token sequence holds dozens): the rows are cut from q/k/v with one
    split each, whose backward concatenates the row gradients, never one slice per row, whose backward zero-fills
    a tensor of the whole batch per row (n rows = n full-size fills per layer: 6x the attention time at 80 rows).
    Same gradients as the rows run alone."""
    from types import SimpleNamespace

    from backend.training.attention import varlen_sdpa_forward

    gen = torch.Generator().manual_seed(0)
    sizes = [5, 9, 3, 7, 6]
    q, k, v = (torch.randn(1, 2, sum(sizes), 4, generator=gen, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = varlen_sdpa_forward(SimpleNamespace(is_causal=True), q, k, v, None, cu_seq_lens_q=cu)
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    assert "SliceBackward0" not in names and any(n.startswith("SplitWithSizes") for n in names), names
    out.sum().backward()
    alone = [torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
             for a, b in zip(cu.tolist(), cu.tolist()[1:])]
    grads = torch.autograd.grad(torch.cat(alone, 2).sum(), (q, k, v))
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        torch.testing.assert_close(got, want)
