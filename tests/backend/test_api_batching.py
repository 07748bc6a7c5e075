"""Issue 23 item 4, continuous batching: concurrent requests to a real `tuneboard api` on the tiny model share
its decode steps (backend.serving.batching) and get the very answers they get alone. A long streamed request
is generating when a short greedy one and a short seeded sampling one arrive: all three answers equal the
sequential ones, and the server's /health says its steps ran with more than one request in the batch (which
the sequential requests before never did); requests with their own logit_bias and penalties, batched together, each
get their own answer (batching.TokenPenalties, one per row). A chat's second turn is prefilled on the first turn's
saved KV cache, as /health counts (tests/backend/test_kv_reuse.py checks the answers against reuse off). No
assertion on a duration."""
import threading

import httpx
import openai
import pytest
from api_server import start_server, stop_server

KEY = "sk-test-123"
PROMPT = "The quick brown fox"  # greedy, the tiny model runs on from it without an end of turn
NEVER = ["never-seen-stop"]
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
LONG = 400  # the long request's tokens: it is still generating when the short ones are answered


@pytest.fixture(scope="module")
def batch_server(tiny_qwen2):
    proc, url = start_server(f"model_name_or_path={tiny_qwen2}", "do_sample=false", "template=qwen",
                             env={"TUNEBOARD_API_KEY": KEY})
    yield url, str(tiny_qwen2)
    stop_server(proc)


def batching(url: str, model: str) -> dict:
    return httpx.get(url + "/health").json()["batching"][model]


def beside_a_long_stream(client, model: str, ask, names, max_tokens: int) -> tuple[dict, str]:
    """Start a long greedy stream, ask `ask(name, out)` for each name from threads once it is generating, then read
    the stream to its end: (the answers, the stream's text)."""
    together: dict = {}
    chunks = iter(client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                            stop=NEVER, stream=True))
    pieces = [next(chunks).choices[0].text for _ in range(3)]  # the long one is generating
    askers = [threading.Thread(target=ask, args=(name, together)) for name in names]
    for t in askers:
        t.start()
    for t in askers:
        t.join(timeout=300)
    pieces += [c.choices[0].text for c in chunks if c.choices]
    return together, "".join(pieces)


def test_concurrent_requests_share_a_batch_and_answer_as_alone(batch_server):
    url, model = batch_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    asks = {"greedy": dict(messages=HELLO, max_tokens=12, temperature=0),
            "seeded": dict(messages=HELLO, max_tokens=12, temperature=0.9, top_p=0.9, seed=5)}

    def ask(name: str, out: dict) -> None:
        out[name] = client.chat.completions.create(model=model, **asks[name]).choices[0].message.content

    alone: dict = {}
    long_alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0,
                                           stop=NEVER).choices[0].text
    for name in asks:
        ask(name, alone)
    assert batching(url, model)["batched_steps"] == 0  # one at a time: never more than one in the batch

    together, streamed = beside_a_long_stream(client, model, ask, asks, LONG)
    stats = batching(url, model)
    assert together == alone, (together, alone)
    assert streamed == long_alone
    assert stats["batched_steps"] > 0 and stats["max_batch"] >= 2, stats


def test_requests_batched_together_each_get_their_own_penalties(batch_server):
    """Three greedy requests on one prompt, each with its own penalties (none, frequency, presence; logit_bias as in
    test_api.test_logit_bias_and_the_penalties_apply_as_openai_defines_them, so each answer is known and the three
    differ), sent together while a long stream runs: each answers as alone, and the long one is untouched."""
    from test_api import penalty_tokens

    url, model = batch_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    cat, dog = penalty_tokens(model)
    bias = {str(cat): 6, str(dog): 5}
    asks = {"plain": {}, "frequency": {"frequency_penalty": 2}, "presence": {"presence_penalty": 2},
            "sampled": {"frequency_penalty": 1.5, "temperature": 0.9, "seed": 3, "logit_bias": {str(dog): 2}}}

    def ask(name: str, out: dict) -> None:
        extra = {"temperature": 0, "logit_bias": bias, **asks[name]}
        out[name] = client.completions.create(model=model, prompt=" cat cat cat", max_tokens=6, **extra).choices[0].text

    alone: dict = {}
    for name in asks:
        ask(name, alone)
    assert alone["plain"] == " cat" * 6 and len(set(alone.values())) == 4, alone
    before = batching(url, model)
    long_alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG // 4, temperature=0,
                                           stop=NEVER).choices[0].text
    together, streamed = beside_a_long_stream(client, model, ask, asks, LONG // 4)
    after = batching(url, model)
    assert together == alone, (together, alone)
    assert streamed == long_alone
    assert after["batched_steps"] > before["batched_steps"], (before, after)


def test_a_chats_next_turn_reuses_its_cache_as_health_counts(batch_server):
    url, model = batch_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    before = batching(url, model)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then what happened?"}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    after = batching(url, model)
    assert after["kv_hits"] == before["kv_hits"] + 1, (before, after)
    # the first turn's prompt (and its answer) came from the cache
    assert after["kv_reused_tokens"] - before["kv_reused_tokens"] >= first.usage.prompt_tokens - 1, (before, after)
