"""`tuneboard api` in a subprocess on a free port, driven by the real `openai` client (and raw httpx
for requests the client would refuse to send)."""
import json
import os
import socket
import subprocess
import re
import sys
import threading

import httpx
import openai
import pytest
from api_server import start_server, stop_server
from waiting import wait_for

from backend.core.paths import REPO_ROOT

KEY = "sk-test-123"
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]


@pytest.fixture(scope="module")
def adapter_dir(tiny_qwen2, tmp_path_factory):
    """A LoRA adapter with random non-zero weights on tiny_qwen2 (so it answers unlike the base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("api_adapter") / "my-adapter"
    torch.manual_seed(2)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(tiny_qwen2, adapter_dir):
    # template qwen (Qwen2.5's official format, tools included): the tiny model's own template has no tools block
    proc, url = start_server(f"model_name_or_path={tiny_qwen2}", "do_sample=false", "template=qwen",
                             "--adapter", str(adapter_dir),
                             env={"TUNEBOARD_API_KEY": KEY})
    yield url, str(tiny_qwen2), proc.log
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_lists_the_base_and_the_adapter(client, server):
    assert [m.id for m in client.models.list()] == [server[1], "my-adapter"]


def test_non_streaming_and_streaming_completions_agree(client):
    reply = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8 and reply.usage.prompt_tokens > 5

    chunks = list(client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 8


def test_the_model_field_picks_base_or_adapter(client, server):
    base = client.chat.completions.create(model=server[1], messages=HELLO, max_tokens=12, temperature=0)
    tuned = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=12, temperature=0)
    assert base.choices[0].message.content != tuned.choices[0].message.content
    assert base.model == server[1] and tuned.model == "my-adapter"


def test_stop_strings_cut_the_answer(client):
    full = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 12


def test_tools_reach_the_template_and_tool_history_is_accepted(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    plain = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=2, temperature=0)
    with_tools = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=2, temperature=0,
                                                tools=tools)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the schema is in the prompt
    history = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    reply = client.chat.completions.create(model="my-adapter", messages=history, max_tokens=2, temperature=0,
                                           tools=tools, stream=False)
    assert reply.usage.prompt_tokens > with_tools.usage.prompt_tokens


def test_api_key_is_required_and_checked(server):
    url = server[0]
    for key in ("wrong-key",):
        bad = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "my-adapter", "messages": HELLO})
    assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").json()["status"] == "ok"  # health needs no key


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "my-adapter" in err.value.body["message"]


def test_malformed_requests_get_openai_style_4xx_json(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="my-adapter", messages=HELLO, n=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:  # a conversation the template refuses
        client.chat.completions.create(model="my-adapter", messages=[{"role": "assistant", "content": "hi"}])
    assert "messages[0]" in err.value.body["message"]

    url, headers = server[0] + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"model": "my-adapter"}).encode(), 400, "messages: required field missing"),
        (json.dumps({"model": "my-adapter", "messages": HELLO, "temprature": 1}).encode(), 400, "temprature: unknown field"),
        (json.dumps({"model": "my-adapter", "messages": HELLO, "top_p": 7}).encode(), 400, "top_p"),
        (json.dumps({"model": "my-adapter", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps([1, 2]).encode(), 400, "JSON object"),
    ]
    for body, status, words in cases:
        r = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error"
        assert "Traceback" not in r.text
    r = httpx.get(server[0] + "/v1/nowhere", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_what_the_server_would_not_do_is_refused_naming_the_field(client, server):
    """Client mistakes and unsupported options: 400 (413 for a huge body) naming the field as OpenAI does,
    never a 500 or a silently ignored option; the neutral values and OpenAI's nulls pass."""
    url, headers = server[0], {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    chat = {"model": "my-adapter", "messages": HELLO, "max_tokens": 2}
    text = {"model": "my-adapter", "prompt": "Hi", "max_tokens": 2}
    cases = [  # (route, body, status, param, words)
        ("chat", {**chat, "messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
        ("chat", {**chat, "messages": [{"role": "user", "content": []}]}, 400, "messages[0].content", "required"),
        ("chat", {**chat, "messages": [{"role": "user", "content": 123}]}, 400, "messages[0].content",
         "valid string or"),
        ("chat", {**chat, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
        ("chat", {**chat, "temperature": True}, 400, "temperature", "valid number"),
        ("chat", {**chat, "frequency_penalty": 3}, 400, "frequency_penalty", "less than or equal to 2"),
        ("chat", {**chat, "presence_penalty": "1"}, 400, "presence_penalty", "valid number"),
        ("chat", {**chat, "logit_bias": {"42": 101}}, 400, "logit_bias.42", "less than or equal to 100"),
        ("chat", {**chat, "logit_bias": {"42": "1"}}, 400, "logit_bias.42", "valid number"),
        ("chat", {**chat, "logit_bias": {"hello": 1}}, 400, "logit_bias", "key 'hello' is not a token id"),
        ("chat", {**chat, "logit_bias": {"49152": 1}, "stream": True}, 400, "logit_bias",
         "key '49152' is not a token id of this model's vocabulary (0 to 49151)"),
        ("text", {**text, "logit_bias": {"-1": 1}}, 400, "logit_bias", "key '-1' is not a token id"),
        ("text", {**text, "logit_bias": {"99999999999": 1}}, 400, "logit_bias", "key '99999999999'"),
        ("chat", {**chat, "response_format": {"type": "json_object"}}, 400, "response_format", "not enforced"),
        ("chat", {**chat, "tool_choice": "auto"}, 400, "tool_choice", "only allowed when tools"),
        ("chat", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
         400, "tool_choice", "force a tool call"),
        ("chat", {**chat, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream: true"),
        ("text", {**text, "prompt": ""}, 400, "prompt", "empty"),
        ("text", {**text, "prompt": [""]}, 400, "prompt", "empty"),
        ("text", {**text, "prompt": [True, False]}, 400, "prompt", "valid"),
        ("text", {**text, "logprobs": True}, 400, "logprobs", "valid integer"),
    ]
    routes = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
    for route, body, status, param, words in cases:
        r = httpx.post(url + routes[route], content=json.dumps(body), headers=headers, timeout=60)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
        assert "list[" not in error["message"] and "Traceback" not in r.text

    raw = [  # bodies json.dumps would not write
        ('{"model": "my-adapter", "messages": [{"role": "user", "content": "Hi \\ud800"}]}', 400,
         "messages[0].content", "unpaired surrogate"),
        ('{"model": "x", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None, "nested too deeply"),
        ('{"model": "' + "x" * (9 << 20) + '"}', 413, None, "larger than 8 MiB"),
    ]
    for body, status, param, words in raw:
        r = httpx.post(url + routes["chat"], content=body.encode(), headers=headers, timeout=60)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text[:300]
        assert r.json()["error"]["param"] == param
    for body in ({**chat, "n": None, "stream": None, "presence_penalty": 0, "response_format": {"type": "text"},
                  "logit_bias": {}, "frequency_penalty": None},
                 {**chat, "service_tier": "auto", "user": "u1"}):
        r = httpx.post(url + routes["chat"], content=json.dumps(body), headers=headers, timeout=60)
        assert r.status_code == 200, r.text

    assert client.models.retrieve("my-adapter").id == "my-adapter"
    assert client.models.retrieve(server[1]).id == server[1]  # a path as the id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.get(url + routes["chat"], headers=headers)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert server[2] and not any("Traceback" in line for line in server[2])


def penalty_tokens(model_dir) -> tuple[int, int]:
    """The ids of " cat" and " dog" in the tiny models' vocabulary (SmolLM2's), one token each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    (cat,), (dog,) = tok(" cat", add_special_tokens=False).input_ids, tok(" dog", add_special_tokens=False).input_ids
    return cat, dog


def test_logit_bias_and_the_penalties_apply_as_openai_defines_them(client, server):
    """logit_bias adds to the logits, frequency_penalty takes count x penalty from a token generated so far and
    presence_penalty takes the penalty once; the prompt's tokens are not counted. The tiny model's own logits lie
    within about +-1, so biases of 6 and 5 on " cat" and " dog" decide every greedy token, and OpenAI's arithmetic
    gives each answer exactly: unpenalised, " cat" every time (a repetitive greedy answer, the same when asked
    again); with frequency_penalty 2, " cat" (6) " dog" (5 > 6-2) " cat" (4 > 5-2) " dog" (3 > 6-4); with
    presence_penalty 2, " cat" " dog" (5 > 4) then " cat" (4 > 3) for good. The prompt's three " cat"s counted would
    start both with " dog"."""
    cat, dog = penalty_tokens(server[1])
    bias = {str(cat): 6, str(dog): 5}

    def complete(**extra):
        return client.completions.create(model=server[1], prompt=" cat cat cat", max_tokens=4, temperature=0,
                                         logit_bias=bias, **extra).choices[0].text

    assert complete() == complete() == " cat cat cat cat"
    assert complete(frequency_penalty=2) == " cat dog cat dog"
    assert complete(presence_penalty=2) == " cat dog cat cat"
    assert complete(frequency_penalty=0, presence_penalty=0) == " cat cat cat cat"
    # on the chat route, streamed or not, and on an adapter: a bias of 100 makes its token come out
    ask = dict(messages=HELLO, max_tokens=3, temperature=0, logit_bias={str(dog): 100})
    for model in (server[1], "my-adapter"):
        assert client.chat.completions.create(model=model, **ask).choices[0].message.content == " dog" * 3
    chunks = client.chat.completions.create(model="my-adapter", **ask, stream=True, frequency_penalty=-2)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " dog" * 3
    ask["logit_bias"] = {str(cat): 6, str(dog): 5}
    streamed = client.chat.completions.create(model=server[1], **ask, stream=True, presence_penalty=2)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == " cat dog cat"


def sse(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed answer, as sent (before [DONE])."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def test_stream_chunks_carry_usage_as_openai_does(server):
    """With stream_options.include_usage every chunk has "usage": null but the last, which has no choices and the
    counts; without it no chunk has the field (OpenAI's ChatCompletionChunk.usage), on both routes."""
    url = server[0]
    for path, body in (("/v1/chat/completions", {"model": "my-adapter", "messages": HELLO, "max_tokens": 3}),
                       ("/v1/completions", {"model": "my-adapter", "prompt": "Hello", "max_tokens": 3, "echo": True})):
        chunks = sse(url, path, {**body, "stream_options": {"include_usage": True}})
        *pieces, last = chunks
        assert len(pieces) >= 3 and all("usage" in c and c["usage"] is None for c in pieces), (path, chunks)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3, (path, last)
        chunks = sse(url, path, body)
        assert chunks and not any("usage" in c for c in chunks), (path, chunks)
        chunks = sse(url, path, {**body, "stream_options": {"include_usage": False}})
        assert chunks and not any("usage" in c for c in chunks), (path, chunks)


def test_a_character_cut_by_max_tokens_ends_as_decoded_streamed_or_not(client, server):
    """A two-byte character whose second byte max_tokens cuts off: the text is what the tokens decode to (U+FFFD
    for the half character, no byte made up), the same streamed and not, on both routes. logit_bias makes the
    answer " cat" then the token of the byte 0xC3 (the first of "é"'s two)."""
    from transformers import AutoTokenizer

    cat, _ = penalty_tokens(server[1])
    half = AutoTokenizer.from_pretrained(server[1]).convert_tokens_to_ids("Ã")  # byte-level BPE's name of byte 0xC3
    ask = dict(max_tokens=2, temperature=0, logit_bias={str(cat): 6, str(half): 5}, frequency_penalty=2)
    chat = client.chat.completions.create(model="my-adapter", messages=HELLO, **ask).choices[0].message.content
    streamed = client.chat.completions.create(model="my-adapter", messages=HELLO, **ask, stream=True)
    assert chat == "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == " cat\ufffd"
    text = client.completions.create(model="my-adapter", prompt="Hello", **ask).choices[0].text
    streamed = client.completions.create(model="my-adapter", prompt="Hello", **ask, stream=True)
    assert text == "".join(c.choices[0].text for c in streamed if c.choices) == " cat\ufffd"


def test_logprobs_cover_the_text_a_stop_string_cut(client, server):
    """A stop string cuts the text; the logprobs end with it (the last token kept may hold the stop string's
    start): the text of one token fewer is shorter than the answer, of as many is not."""
    def answer(max_tokens, **extra):
        return client.chat.completions.create(model=server[1], messages=HELLO, max_tokens=max_tokens,
                                              temperature=0, **extra).choices[0]

    def stop_in_second_half(text):  # 3 characters from the middle on, whose first place is where they stand
        at = next(i for i in range(len(text) // 2, len(text) - 3) if text.find(text[i:i + 3]) == i)
        return at, text[at:at + 3]

    full = answer(12).message.content
    at, stop = stop_in_second_half(full)
    cut = answer(12, stop=[stop], logprobs=True)
    assert cut.message.content == full[:at], (full, stop)
    kept = len(cut.logprobs.content)
    assert cut.finish_reason == "stop" and 0 < kept < 12
    assert answer(kept).message.content.startswith(cut.message.content)
    assert len(answer(kept - 1).message.content) < len(cut.message.content) if kept > 1 else True

    def complete(**extra):
        return client.completions.create(model=server[1], prompt="Hello there", max_tokens=12, temperature=0,
                                         **extra).choices[0]

    at, stop = stop_in_second_half(complete().text)
    cut = complete(stop=[stop], logprobs=0)
    assert cut.finish_reason == "stop" and len(cut.logprobs.tokens) < 12
    assert "".join(cut.logprobs.tokens).startswith(cut.text)
    assert all(offset < len(cut.text) for offset in cut.logprobs.text_offset)  # none past the text's end


def test_bad_server_options_are_one_line_even_when_ending_with_stdin(tiny_qwen2, tmp_path):
    """--exit-with-stdin (how the web UI starts its chat server) used to abort the interpreter on any startup
    error ("could not acquire lock for <stdin>", rc 134)."""
    def api(*args, env=None):
        proc = subprocess.Popen([sys.executable, "-m", "backend.cli", "api", f"model_name_or_path={tiny_qwen2}",
                                 *args], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        try:
            err = proc.stderr.read()  # stdin stays open until the process has ended (communicate would close it)
            proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.stdin.close()
        return proc.returncode, err.strip().splitlines()

    rc, err = api("--adapter", str(tmp_path / "missing"), "--port", "0", "--exit-with-stdin")
    assert rc == 1 and len(err) == 1 and "does not exist" in err[0], err
    assert api("--port", "99999", "--exit-with-stdin") == (2, ["error: --port must be 0-65535 (got 99999)"])
    rc, err = api("--port", "0", env={"TUNEBOARD_API_KEY": "sëkret"})
    assert rc == 2 and err[0].startswith("error: the API key holds characters other than printable ASCII")
    assert api("--host", "", "--port", "0")[1][0].startswith("error: --host is empty")


def test_a_bad_adapter_path_fails_fast_with_a_clear_message(tiny_qwen2, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "api", f"model_name_or_path={tiny_qwen2}",
                           "--adapter", str(tmp_path / "missing"), "--port", "0"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr and "missing" in proc.stderr


def test_streaming_with_tools_and_client_disconnect_stops_generation(client, server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    whole = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=6, temperature=0, tools=tools)
    chunks = list(client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=6, temperature=0,
                                                 tools=tools, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content

    # A 900-token stream dropped after 3 chunks: the server must stop generating, and says after how many
    # tokens once the generation thread has ended (a server that kept going would report 900, or nothing).
    body = {"model": "my-adapter", "messages": HELLO, "max_tokens": 900, "temperature": 0, "stream": True,
            "stop": ["never-seen-stop"]}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    log = server[2]
    wait_for(lambda: any("client disconnected" in line for line in log), timeout=150, what="disconnect log line")
    said = next(line for line in log if "client disconnected" in line)
    generated = int(re.search(r"stopped after (\d+) tokens", said).group(1))
    # left alone, the same request runs far past that: the count above is the server stopping, not the model
    full = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=900, temperature=0,
                                          stop=["never-seen-stop"])
    assert generated < 450 < full.usage.completion_tokens, (said, full.usage)
    # and the model is free again at once
    after = client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=2, temperature=0)
    assert after.usage.completion_tokens <= 2


def test_text_completions_raw_prompt_stream_echo_and_refusals(client, server, adapter_dir):
    """/v1/completions: no chat template, so the text is the model's own continuation of the raw prompt
    (checked against transformers' greedy generate with the same adapter); streaming gives the same text;
    echo puts the prompt in front; several prompts / suffix are refused naming the field."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox"
    whole = client.completions.create(model="my-adapter", prompt=prompt, max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 8
    text = whole.choices[0].text
    tok = AutoTokenizer.from_pretrained(server[1])
    base = AutoModelForCausalLM.from_pretrained(server[1], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
    direct = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text and direct.startswith(text), (text, direct)

    chunks = list(client.completions.create(model="my-adapter", prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    echoed = client.completions.create(model="my-adapter", prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + text

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="my-adapter", prompt=["a", "b"], max_tokens=2)
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="my-adapter", prompt="a", suffix="b", max_tokens=2)
    assert err.value.body["param"] == "suffix"


# ------------------------------------------------------------------ one request cannot hold the server
def disconnect_lines(log) -> list[str]:
    return [line for line in list(log) if "client disconnected" in line]


def stopped_after(line: str) -> int:
    return int(re.search(r"stopped after (\d+) tokens", line).group(1))


def health(url) -> dict:
    return httpx.get(url + "/health").json()


def drop_non_streamed(url: str, path: str, body: dict, key: str | None = KEY) -> None:
    """POST `body` on a raw socket and close it while the server generates the (non-streamed) answer: once
    /health says its prompt was handed to the model, so the close is a disconnect mid-request."""
    raw = json.dumps(body).encode()
    host, port = url.split("//")[1].split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n")
    before = health(url)["generating"]
    with socket.create_connection(("127.0.0.1", int(port))) as sock:
        sock.sendall(head.encode() + raw)
        wait_for(lambda: health(url)["generating"] > before, timeout=60, what="the request generating")


def test_max_tokens_is_bounded_by_the_models_context(client, server):
    """The tiny model's context is 1024 tokens: a max_tokens past it is a 400 naming the field (as OpenAI
    answers), streamed or not, on both routes; a prompt alone past it names the prompt; left out,
    max_tokens is what fits."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="my-adapter", prompt="Hi", max_tokens=1_000_000_000)
    body = err.value.body
    assert body["param"] == "max_tokens" and body["code"] == "context_length_exceeded"
    assert body["message"].startswith("max_tokens: 1000000000 is too large") and "context is 1024" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="my-adapter", messages=HELLO, max_completion_tokens=1020, stream=True)
    assert err.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=1_000_000_000)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="my-adapter", prompt=" hello" * 1100, max_tokens=1)
    assert err.value.body["param"] == "prompt" and "1100 tokens" in err.value.body["message"]
    # no max_tokens (the spec's default, 512) and a 1000-token prompt: the answer fills the 24 tokens left
    reply = client.chat.completions.create(model="my-adapter", messages=[{"role": "user", "content": " hello" * 990}],
                                           temperature=0, stop=["never-seen-stop"])
    assert reply.usage.total_tokens == 1024 and reply.choices[0].finish_reason == "length", reply.usage
    # fit_context (the Chat tab's slider): the max_tokens refused above runs to the end of the context instead
    reply = client.chat.completions.create(model="my-adapter", messages=[{"role": "user", "content": " hello" * 990}],
                                           max_tokens=1020, temperature=0, stop=["never-seen-stop"],
                                           extra_body={"fit_context": True})
    assert reply.usage.total_tokens == 1024 and reply.choices[0].finish_reason == "length", reply.usage
    # ... but a ceiling past the server's per-request cap (1024 here) is still refused, naming the cap
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="my-adapter", messages=HELLO, max_tokens=5000,
                                       extra_body={"fit_context": True})
    assert err.value.body["code"] == "max_tokens_exceeded" and "1024" in err.value.body["message"]


def test_every_route_stops_generating_when_its_client_leaves(client, server):
    """Non-streamed requests on both routes and a /v1/completions stream, each asking for 900 tokens,
    dropped mid-generation: the server stops each (it logs how many tokens it generated); left alone the
    same requests run far past that, so the counts are the server stopping, not the model."""
    url, log = server[0], server[2]
    prompt = "The quick brown fox"
    full = client.completions.create(model="my-adapter", prompt=prompt, max_tokens=900, temperature=0,
                                     stop=["never-seen-stop"])
    assert full.usage.completion_tokens > 450
    chat = {"model": "my-adapter", "messages": HELLO, "max_tokens": 900, "temperature": 0, "stop": ["never-seen-stop"]}
    text = {"model": "my-adapter", "prompt": prompt, "max_tokens": 900, "temperature": 0, "stop": ["never-seen-stop"]}
    for path, body in (("/v1/completions", text), ("/v1/chat/completions", chat)):
        seen = len(disconnect_lines(log))
        drop_non_streamed(url, path, body)
        wait_for(lambda: len(disconnect_lines(log)) > seen, timeout=150, what=f"disconnect log line for {path}")
        assert stopped_after(disconnect_lines(log)[-1]) < 450, (path, disconnect_lines(log)[-1])

    seen = len(disconnect_lines(log))
    with httpx.stream("POST", url + "/v1/completions", json={**text, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    wait_for(lambda: len(disconnect_lines(log)) > seen, timeout=150, what="disconnect log line for the stream")
    said = disconnect_lines(log)[-1]
    assert said.startswith("cmpl-") and stopped_after(said) < 450, said
    wait_for(lambda: health(url)["requests"] == 0, timeout=60, what="the server idle again")
    assert client.completions.create(model="my-adapter", prompt=prompt, max_tokens=2).usage.completion_tokens <= 2


def test_host_beyond_loopback_needs_a_key_and_the_queue_is_bounded(tiny_qwen2):
    """`--host 0.0.0.0` without a key is refused (exit 2, saying how to allow it); with --insecure-no-auth
    it serves. With --max-queue 0 (one request at a time) a request that comes while another is in
    progress gets 503 at once, with Retry-After; once that one is gone the next is served."""
    env = {k: v for k, v in os.environ.items() if k != "TUNEBOARD_API_KEY"}
    refused = subprocess.run([sys.executable, "-m", "backend.cli", "api", f"model_name_or_path={tiny_qwen2}",
                              "--host", "0.0.0.0", "--port", "0"], cwd=REPO_ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "without an API key" in refused.stderr and "--insecure-no-auth" in refused.stderr
    assert "Traceback" not in refused.stderr

    cmd = [sys.executable, "-m", "backend.cli", "api", f"model_name_or_path={tiny_qwen2}", "do_sample=false",
           "--host", "0.0.0.0", "--insecure-no-auth", "--max-queue", "0", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving on "):
                break
        assert lines and lines[-1].startswith("serving on http://0.0.0.0:"), "".join(lines)
        port = int(lines[-1].rsplit(":", 1)[1])
        url = f"http://127.0.0.1:{port}"
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        keyless = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        # a request in progress for as long as this test likes: its body is still being sent
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": ")
            wait_for(lambda: health(url)["requests"] == 1, timeout=60, what="the slow request admitted")
            with pytest.raises(openai.InternalServerError) as err:
                keyless.completions.create(model=str(tiny_qwen2), prompt="Hi", max_tokens=2)
            assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
            assert err.value.body["code"] == "server_overloaded" and "--max-queue 0" in err.value.body["message"]
        wait_for(lambda: health(url)["requests"] == 0, timeout=60, what="the slow request gone")
        assert keyless.completions.create(model=str(tiny_qwen2), prompt="Hi", max_tokens=2).usage.completion_tokens <= 2
        assert "Traceback" not in "".join(lines)
    finally:
        stop_server(proc)
