"""Issue 23 item 4, the KV cache reused across a chat's turns (backend.serving.batching: KVStore, Batcher._reuse):
a chat's next turn, whose prompt starts with the previous turn's prompt and answer, is prefilled from the saved
cache of that turn and answers exactly as when prefilled in full (TUNEBOARD_KV_REUSE=0), greedy and seeded; a
prompt that diverges from the saved one reuses only the tokens before the divergence, and answers as in full."""
import pytest

from backend.core.spec import load_spec
from backend.serving.batching import KV_MIN_REUSE, KVStore, common_prefix
from backend.serving.engine import load_engines

HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
MORE = {"role": "user", "content": "Tell me more about that, please."}


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    spec = load_spec(None, [f"model_name_or_path={tiny_qwen2}", "do_sample=false", "template=qwen"])
    engine = load_engines(spec, log=lambda m: None)[str(tiny_qwen2)]
    assert engine.batcher is not None
    yield engine
    engine.batcher.close()


def _ask(engine, monkeypatch, messages, reuse: bool, **sampling):
    """The reply with reuse on or off, and how the batcher's reuse counters moved."""
    monkeypatch.setenv("TUNEBOARD_KV_REUSE", "1" if reuse else "0")
    keys = ("kv_hits", "kv_misses", "kv_reused_tokens")
    before = {k: engine.batcher.stats[k] for k in keys}
    reply = engine.chat(messages, max_new_tokens=12, **sampling)
    return reply.text, {k: engine.batcher.stats[k] - before[k] for k in keys}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.9, "seed": 5, "do_sample": True}],
                         ids=["greedy", "seeded"])
def test_next_turn_reuses_the_turn_before_and_answers_as_without(engine, monkeypatch, sampling):
    first, _ = _ask(engine, monkeypatch, HELLO, True, **sampling)
    turn2 = HELLO + [{"role": "assistant", "content": first}, MORE]
    with_reuse, moved = _ask(engine, monkeypatch, turn2, True, **sampling)
    assert moved["kv_hits"] == 1 and moved["kv_misses"] == 0, moved
    # at least the whole first prompt came from the saved turn (its answer too, where it tokenizes back the same)
    assert moved["kv_reused_tokens"] >= len(engine.prompt_ids(HELLO)) - 1, moved
    without, moved_off = _ask(engine, monkeypatch, turn2, False, **sampling)
    assert moved_off == {"kv_hits": 0, "kv_misses": 0, "kv_reused_tokens": 0}
    assert with_reuse == without


def test_a_prompt_that_diverges_reuses_only_the_common_part(engine, monkeypatch):
    first, _ = _ask(engine, monkeypatch, HELLO, True)
    saved = engine.prompt_ids(HELLO)
    other = [{"role": "user", "content": "Hello there, what is this place?"}]  # diverges mid-way
    ids = engine.prompt_ids(other)
    with_reuse, moved = _ask(engine, monkeypatch, other, True)
    assert KV_MIN_REUSE <= common_prefix(ids, saved) < len(saved) - 4  # the system prompt and "Hello there,"
    assert moved["kv_hits"] == 1 and 0 < moved["kv_reused_tokens"] <= common_prefix(ids, saved), moved
    without, _ = _ask(engine, monkeypatch, other, False)
    assert with_reuse == without
    # an earlier turn re-rendered differently (another answer than the one generated): the same answer as in full
    turn2 = HELLO + [{"role": "assistant", "content": first + " Indeed."}, MORE]
    assert _ask(engine, monkeypatch, turn2, True)[0] == _ask(engine, monkeypatch, turn2, False)[0]


def test_the_store_keeps_the_longest_turn_and_stays_bounded():
    import torch

    def layers(n, size=4):
        return [(torch.zeros(1, 1, n, size), torch.zeros(1, 1, n, size))]

    store = KVStore(entries=2, max_bytes=10_000)
    store.put("a", [1, 2, 3], layers(3))
    store.put("a", [1, 2, 3, 4, 5], layers(5))  # the next turn: the earlier entry is a prefix of it, and goes
    assert len(store) == 1 and store.get("a", [1, 2, 3, 9])[0] == 3
    assert store.get("b", [1, 2, 3, 4, 5, 6]) == (0, None)  # another adapter state: nothing
    store.put("b", [7, 8], layers(2))
    assert store.get("a", [1, 2, 3, 4, 5, 6])[0] == 5  # read: now the most recently used
    store.put("a", [9], layers(1))  # a third entry: the least recently used ("b") goes
    assert len(store) == 2 and store.get("b", [7, 8])[0] == 0 and store.get("a", [1, 2, 3, 4, 5])[0] == 5
    store.put("a", [5] * 100, layers(100))  # 3,200 bytes of 10,000: kept, and the total stays under the cap
    assert store.bytes <= 10_000
    store.put("a", [6] * 1000, layers(1000))  # 32,000 bytes: over the cap, not kept
    assert store.get("a", [6] * 1000)[0] == 0


def test_the_batch_cache_grows_in_place_with_the_same_numbers():
    """make_roomy: the batch's cache layers write each step's keys and values into spare room (no copy of the whole
    cache per step), hold what concatenation holds, and take a replaced tensor (a row left the batch) as it is."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    from backend.serving.batching import make_roomy

    torch.manual_seed(0)
    steps = [torch.randn(3, 2, n, 4) for n in (5, 1, 1, 2)]
    plain, roomy = DynamicLayer(), DynamicLayer()
    cache = DynamicCache()
    cache.layers = [roomy]
    make_roomy(cache)
    grown = cache.layers[0]
    assert type(grown).__name__ == "RoomyLayer"
    storage = set()
    for k in steps:
        pk, pv = plain.update(k, -k)
        gk, gv = grown.update(k, -k)
        assert torch.equal(pk, gk) and torch.equal(pv, gv) and grown.get_seq_length() == pk.shape[-2]
        storage.add(gk.untyped_storage().data_ptr())
    assert len(storage) == 1  # one buffer: written in place, never copied
    keep = torch.tensor([0, 2])
    for layer in (plain, grown):  # a row leaves: Batcher._drop replaces the tensors
        layer.keys, layer.values = layer.keys[keep], layer.values[keep]
    k = torch.randn(2, 2, 1, 4)
    assert torch.equal(plain.update(k, k)[0], grown.update(k, k)[0])
    assert torch.equal(plain.values, grown.values)
