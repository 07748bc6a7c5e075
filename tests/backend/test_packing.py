"""Packing: packed rows give exactly the loss and logits of the same rows run one by one (block-diagonal
attention from restarting position_ids, no label across a row boundary)."""
from __future__ import annotations

import random

import pytest
import torch

from backend.dataprep.preprocess import IGNORE_INDEX, PackedCollator, pack_rows


def make_rows(n: int, vocab: int, seed: int = 0) -> list[dict]:
    """Rows of different lengths with a masked prompt and a trained answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, answer = rng.randint(2, 20), rng.randint(1, 15)
        ids = [rng.randrange(vocab) for _ in range(prompt + answer)]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:],
                     "attention_mask": [1] * len(ids)})
    return rows


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def tiny_model(request):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=request.param)
    assert config.use_cache  # the default: the collator must still get block-diagonal attention
    return LlamaForCausalLM(config).eval()


def test_pack_rows_structure():
    rows = make_rows(25, 97)
    packed = pack_rows(rows, 48)
    assert all(len(p["input_ids"]) == len(p["labels"]) == len(p["position_ids"]) <= 48 for p in packed)
    # every row appears exactly once, intact, starting where its position ids restart
    found = []
    for p in packed:
        starts = [i for i, pos in enumerate(p["position_ids"]) if pos == 0] + [len(p["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert p["position_ids"][a:b] == list(range(b - a))
            assert p["labels"][a] == IGNORE_INDEX  # no label crosses a boundary
            found.append((tuple(p["input_ids"][a:b]), tuple(p["labels"][a + 1:b])))
    assert sorted(found) == sorted((tuple(r["input_ids"]), tuple(r["labels"][1:])) for r in rows)
    # best-fit decreasing is close to the bound on this data
    assert len(packed) <= -(-sum(len(r["input_ids"]) for r in rows) // 48) + 1


def test_pack_rows_rejects_a_row_longer_than_cutoff():
    with pytest.raises(ValueError, match="row 0 has 5 tokens, more than cutoff_len=4"):
        pack_rows([{"input_ids": [1] * 5, "labels": [1] * 5}], 4)


def assert_packed_equals_unpacked(model, rows, cutoff_len):
    packed = pack_rows(rows, cutoff_len)
    assert len(packed) < len(rows)
    batch = PackedCollator(flash_attn_kwargs=True)(packed)  # every packed row flattened into one
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    num_items = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert num_items == sum(sum(1 for x in r["labels"][1:] if x != IGNORE_INDEX) for r in rows)

    with torch.no_grad():
        out = model(**batch, num_items_in_batch=num_items)
        packed_sum = out.loss.item() * num_items
        logits = out.logits[0]
        unpacked_sum = 0.0
        flat_ids = batch["input_ids"][0].tolist()
        offset_of = {}
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [len(flat_ids)]
        for a, b in zip(starts, starts[1:]):
            offset_of.setdefault(tuple(flat_ids[a:b]), []).append(a)
        for r in rows:
            ids = torch.tensor([r["input_ids"]])
            single = model(input_ids=ids, labels=torch.tensor([r["labels"]]), num_items_in_batch=1)
            unpacked_sum += single.loss.item()
            a = offset_of[tuple(r["input_ids"])].pop()
            torch.testing.assert_close(logits[a:a + ids.shape[1]], single.logits[0], rtol=1e-5, atol=1e-5)
    assert packed_sum == pytest.approx(unpacked_sum, rel=1e-5)


def test_packed_equals_unpacked(tiny_model):
    rows = make_rows(12, tiny_model.config.vocab_size, seed=1)
    for r in rows[::2]:
        r["labels"] = list(r["input_ids"])  # train_on_prompt rows: their first label must not leak across
    assert_packed_equals_unpacked(tiny_model, rows, 64)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral"])
def test_packed_equals_unpacked_across_families(family, request):
    """The shared tiny models, each with its default attention (gemma2: eager, soft-capping, sliding window)."""
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(f"tiny_{family}")
    extra = {"sliding_window": 8} if family == "gemma2" else {}  # shorter than the rows: the window matters
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()  # default attention
    rows = make_rows(10, model.config.vocab_size, seed=4)
    assert_packed_equals_unpacked(model, rows, 64)


def test_packed_collator_flattens_plain_rows_too(tiny_model):
    """Padding-free without pre-packing: plain rows get position ids 0..n-1 and start labels -100."""
    rows = make_rows(3, tiny_model.config.vocab_size, seed=2)
    for r in rows:
        r["labels"] = list(r["input_ids"])  # fully trained rows: the start labels must be masked
    batch = PackedCollator()(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    assert batch["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    starts = [sum(lengths[:k]) for k in range(3)]
    assert [batch["labels"][0, s].item() for s in starts] == [IGNORE_INDEX] * 3
    assert batch["use_cache"] is False
