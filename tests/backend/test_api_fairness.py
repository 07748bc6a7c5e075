"""Security issue #25, one long request starves everyone: a real `tuneboard api` on the tiny model, driven by
the real `openai` client. Requests on one model take turns (a 5-token request is answered while a maximal one
generates), --max-tokens-per-request caps max_tokens (400 naming the field and the cap; left out, the cap),
and --max-request-seconds ends a generation with finish_reason "time_limit", streamed or not.

No assertion on a duration: fairness is asserted on token counts (how far the long request had got when the
short one was answered), the time limit on the finish reason."""
import re
import threading

import openai
import pytest
from api_server import start_server, stop_server
from test_api import KEY, adapter_dir  # noqa: F401  (adapter_dir: a fixture)
from waiting import wait_for

from backend.serving.engine import load_engines
from backend.training.scheduler import TurnLock
from backend.core.spec import load_spec

CAP = 240  # the cap of the server below, and the long request's max_tokens: the most it may ask
PROMPT = "The quick brown fox"  # greedy, the tiny model runs on from it without an end of turn
NEVER = ["never-seen-stop"]
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]


@pytest.fixture(scope="module")
def fair_server(tiny_qwen2):
    """The spec's max_new_tokens (1000) is above the cap: a request without max_tokens gets the cap."""
    proc, url = start_server(f"model_name_or_path={tiny_qwen2}", "do_sample=false", "template=qwen",
                             "max_new_tokens=1000", "--max-tokens-per-request", str(CAP),
                             env={"TUNEBOARD_API_KEY": KEY})
    yield url, str(tiny_qwen2), proc.log
    stop_server(proc)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def stopped_after(log, cid: str) -> int | None:
    """Tokens the server had generated for request `cid` when its client left (its log line), or None."""
    for line in list(log):
        if line.startswith(cid) and "client disconnected" in line:
            return int(re.search(r"stopped after (\d+) tokens", line).group(1))
    return None


def test_a_short_request_is_answered_while_a_maximal_one_generates(fair_server):
    """A streamed request for CAP tokens (the most this server allows) is generating; a 5-token chat request
    sent beside it completes while the long one is still running: the long stream has not ended when the
    short answer is in, and the server, told to stop the long one right then, had generated well under half
    of it. With one generation at a time per model (the old lock) the short request could only start once
    the long one had ended."""
    url, model, log = fair_server
    client = client_of(url)
    long = client.completions.create(model=model, prompt=PROMPT, max_tokens=CAP, temperature=0, stop=NEVER,
                                     stream=True)
    chunks = iter(long)
    first = [next(chunks) for _ in range(3)]  # the long one is generating
    short: dict = {}

    def ask_short():
        short["reply"] = client.chat.completions.create(model=model, messages=HELLO, max_tokens=5, temperature=0)

    asker = threading.Thread(target=ask_short)
    asker.start()
    long_ended = False
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].finish_reason:
            long_ended = True
        if "reply" in short:
            break
    long.close()  # the client leaves: the server logs how far the long one had got
    asker.join(timeout=300)
    assert "reply" in short and not long_ended, "the short request was answered only after the long one ended"
    reply = short["reply"]
    assert reply.choices[0].finish_reason in ("stop", "length") and 1 <= reply.usage.completion_tokens <= 5
    wait_for(lambda: stopped_after(log, first[0].id) is not None, timeout=150, what="the long request's stop line")
    assert stopped_after(log, first[0].id) < CAP // 2, [line for line in log if first[0].id in line]


def test_max_tokens_above_the_cap_is_a_400_naming_the_cap_and_left_out_is_the_cap(fair_server):
    url, model, _ = fair_server
    client = client_of(url)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="Hi", max_tokens=CAP + 1)
    body = err.value.body
    assert body["param"] == "max_tokens" and body["code"] == "max_tokens_exceeded", body
    assert body["message"] == (f"max_tokens: {CAP + 1} is more than this server allows per request: at most {CAP} "
                               "(its --max-tokens-per-request)")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=HELLO, max_completion_tokens=CAP + 1, stream=True)
    assert err.value.body["param"] == "max_completion_tokens" and f"at most {CAP}" in err.value.body["message"]
    # past the context as well: the context's 400 (the cap would not make it fit either)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="Hi", max_tokens=5000)
    assert err.value.body["code"] == "context_length_exceeded"
    # left out: the spec's 1000 is cut to the cap
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                           temperature=0, stop=NEVER)
    assert reply.usage.completion_tokens == CAP and reply.choices[0].finish_reason == "length", reply.usage


def test_a_request_past_the_time_limit_ends_with_finish_reason_time_limit(tiny_qwen2):
    """--max-request-seconds 0.2 and requests for 950-1000 tokens (allowed: --max-tokens-per-request 0 leaves
    only the context): it ends early with finish_reason "time_limit", non-streamed, streamed (chat and text,
    usage included), never "length"."""
    proc, url = start_server(f"model_name_or_path={tiny_qwen2}", "do_sample=false", "template=qwen",
                             "--max-request-seconds", "0.2", "--max-tokens-per-request", "0",
                             env={"TUNEBOARD_API_KEY": KEY})
    try:
        client, model = client_of(url), str(tiny_qwen2)
        text = client.completions.create(model=model, prompt=PROMPT, max_tokens=1000, temperature=0, stop=NEVER)
        assert text.choices[0].finish_reason == "time_limit" and text.usage.completion_tokens < 1000, text
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                     max_tokens=950, temperature=0, stop=NEVER, stream=True,
                                                     stream_options={"include_usage": True}))
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["time_limit"] and chunks[-1].usage.completion_tokens < 950, chunks[-3:]
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=1000, temperature=0,
                                                stop=NEVER, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["time_limit"]
        # a short request still ends on its own terms
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"
        bad = [line for line in proc.log if "Traceback" in line]
        assert not bad, "".join(proc.log)
    finally:
        stop_server(proc)


def test_turn_lock_serves_waiters_in_order_and_a_passed_turn_comes_back():
    """The scheduler on its own: FIFO waiters; pass_turn with nobody waiting keeps the turn, with waiters
    hands it to the first and returns once the turn has gone round."""
    lock, order, started = TurnLock(), [], []
    assert lock.acquire() and lock.pass_turn() is False  # nobody waits: kept

    def waiter(name):
        started.append(name)
        with lock:
            order.append(name)

    threads = []
    for name in ("a", "b"):
        threads.append(threading.Thread(target=waiter, args=(name,)))
        threads[-1].start()
        wait_for(lambda: lock.waiting() == len(threads), timeout=30, what=f"{name} in line")
    assert lock.pass_turn() is True  # a and b went first, then the turn came back
    assert order == ["a", "b"] and lock.locked()
    assert lock.acquire(timeout=0) is False and lock.acquire(cancelled=lambda: True) is False
    assert lock.waiting() == 0  # who gave up left the line
    lock.release()
    for t in threads:
        t.join()


def test_requests_taking_turns_get_the_answers_they_get_alone(tiny_qwen2, adapter_dir):  # noqa: F811
    """The engines of one model (base and adapter) share its TurnLock (and its batcher). Four requests, greedy
    and seeded sampling, on both, all wait in line (the test holds the model) and then share its decode batches
    (one adapter state a batch; without batching: take turns a few tokens at a time): each answer is the one it
    gets alone. So each turn runs with its own adapter, and a seeded request
    keeps its own random state while the others sample."""
    spec = load_spec(None, [f"model_name_or_path={tiny_qwen2}", "do_sample=false", "template=qwen"])
    served = load_engines(spec, [str(adapter_dir)], log=lambda m: None)
    base, tuned = served[str(tiny_qwen2)], served["my-adapter"]
    assert base.lock is tuned.lock
    sampled = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    asks = [(base, {}), (tuned, {}), (tuned, dict(sampled, seed=7)), (base, dict(sampled, seed=3))]

    def answer(i):
        engine, sampling = asks[i]
        return engine.chat(HELLO, max_new_tokens=16, stop=NEVER, **sampling)

    alone = [answer(i) for i in range(len(asks))]
    assert alone[0].text != alone[1].text  # base and adapter differ, else this could not tell them apart
    assert min(r.completion_tokens for r in alone) > 4  # each needs more than one turn
    together: list = [None] * len(asks)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, answer(i))) for i in range(len(asks))]
    # all four queue behind the test, then share the model's batches (backend.serving.batching: a batch holds
    # one adapter state) or, without batching, take turns
    queued = base.batcher.waiting if base.batcher is not None else base.lock.waiting
    with base.lock:
        for t in threads:
            t.start()
        wait_for(lambda: queued() == len(asks), timeout=60, what="all four requests in line")
    for t in threads:
        t.join(timeout=300)
    assert [r.text for r in together] == [r.text for r in alone]
