"""backend.serving.engine on tiny random models: adapters vs merged weights, streaming vs not, stop handling,
prompt ids, tool-call parsing, the vLLM fallback."""
import copy
import subprocess
import sys
import threading

import pytest

from backend.serving.engine import (HFEngine, StopFilter, cut_at_stop, load_engines, make_sampling, parse_tool_calls,
                            plan_served, vllm_unavailable)
from backend.core.spec import load_spec
from backend.dataprep.templates import get_template

HELLO = [{"role": "user", "content": "Hello there, who are you?"}]


def _spec(model, *extra):
    return load_spec(None, [f"model_name_or_path={model}", "do_sample=false", *extra])


@pytest.fixture(scope="module")
def lora_pair(tiny_qwen2, tmp_path_factory):
    """A LoRA adapter with random (non-zero) A and B on tiny_qwen2, and the same adapter merged and saved
    as a full model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lora_pair")
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                        init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(root / "merged")
    AutoTokenizer.from_pretrained(tiny_qwen2).save_pretrained(root / "merged")
    return root / "adapter", root / "merged"


@pytest.fixture(scope="module")
def qwen_engine(tiny_qwen2):
    return load_engines(_spec(tiny_qwen2), log=lambda m: None)[str(tiny_qwen2)]


def test_adapter_greedy_equals_merged_and_shared_base_equals_plain_base(tiny_qwen2, lora_pair):
    adapter, merged = lora_pair
    served = load_engines(_spec(tiny_qwen2), [str(adapter)], log=lambda m: None)
    assert list(served) == [str(tiny_qwen2), "adapter"]
    via_adapter = served["adapter"].chat(HELLO, max_new_tokens=24)
    via_merged = next(iter(load_engines(_spec(merged), log=lambda m: None).values())).chat(HELLO, max_new_tokens=24)
    assert via_adapter.completion_tokens == via_merged.completion_tokens == 24
    assert via_adapter.text == via_merged.text

    # the base engine shares the PeftModel with adapters disabled: same as the base loaded alone,
    # and different from the adapter (else this test could not tell adapter from base)
    shared_base = served[str(tiny_qwen2)].chat(HELLO, max_new_tokens=24)
    plain_base = next(iter(load_engines(_spec(tiny_qwen2), log=lambda m: None).values())).chat(HELLO, max_new_tokens=24)
    assert shared_base.text == plain_base.text
    assert shared_base.text != via_adapter.text
    # and activating the adapter again after the base ran gives the adapter's answer again
    assert served["adapter"].chat(HELLO, max_new_tokens=24).text == via_adapter.text


def test_stacked_adapters_are_one_served_model(tiny_qwen2, lora_pair):
    adapter, _ = lora_pair
    plan = plan_served(_spec(tiny_qwen2), [f"both={adapter},{adapter}", str(adapter), str(adapter)])
    assert [(s.name, len(s.adapters)) for s in plan] == [(str(tiny_qwen2), 0), ("both", 2), ("adapter", 1),
                                                         ("adapter-2", 1)]
    with pytest.raises(ValueError, match="is a full model, not a LoRA adapter"):
        plan_served(_spec(tiny_qwen2), [str(tiny_qwen2)])
    with pytest.raises(ValueError, match="does not exist"):
        plan_served(_spec(tiny_qwen2), ["/nonexistent/adapter"])


@pytest.mark.parametrize("sampling", [dict(), dict(do_sample=True, temperature=0.9, top_p=0.9, top_k=40, seed=7)])
def test_streaming_yields_the_same_text_as_non_streaming(qwen_engine, sampling):
    reply = qwen_engine.chat(HELLO, max_new_tokens=30, **sampling)
    stream = qwen_engine.stream(HELLO, max_new_tokens=30, **sampling)
    pieces = list(stream)
    assert len(pieces) > 1  # really incremental
    assert "".join(pieces) == reply.text
    assert stream.reply.text == reply.text
    assert (stream.reply.finish_reason, stream.reply.completion_tokens, stream.reply.prompt_tokens) == \
           (reply.finish_reason, reply.completion_tokens, reply.prompt_tokens) == ("length", 30, reply.prompt_tokens)


def test_end_of_turn_token_ends_generation(tiny_qwen2):
    """Make <|im_end|> (ChatML's end of turn) win at some step by copying, scaled up, the output row of a
    token greedy decoding emits: generation must end there, without showing the marker, as a prefix of the
    unmodified answer, with finish_reason stop."""
    import torch

    engine = next(iter(load_engines(_spec(tiny_qwen2), log=lambda m: None).values()))
    free = engine.chat(HELLO, max_new_tokens=20)
    assert free.finish_reason == "length"
    ids = engine.tokenizer(free.text, add_special_tokens=False).input_ids
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in engine.eos_ids
    with torch.no_grad():
        head = engine.model.get_output_embeddings().weight
        head[im_end] = 3.0 * head[ids[len(ids) // 2]]
    for reply in (engine.chat(HELLO, max_new_tokens=20), engine.stream(HELLO, max_new_tokens=20)):
        if not isinstance(reply, type(free)):
            text = "".join(reply)
            reply = reply.reply
            assert text == reply.text
        assert reply.finish_reason == "stop"
        assert reply.completion_tokens < 20
        assert "<|im_end|>" not in reply.text
        assert free.text.startswith(reply.text)


def test_stop_strings_end_generation_and_are_never_shown(qwen_engine):
    pieces = list(qwen_engine.stream(HELLO, max_new_tokens=20))
    full = "".join(pieces)
    stop = pieces[6] + pieces[7]
    expected = full[: full.find(stop)]
    reply = qwen_engine.chat(HELLO, max_new_tokens=20, stop=[stop])
    assert (reply.text, reply.finish_reason) == (expected, "stop")
    assert reply.completion_tokens < 20
    stream = qwen_engine.stream(HELLO, max_new_tokens=20, stop=stop)
    assert "".join(stream) == expected
    assert stream.reply.finish_reason == "stop"


def test_stop_event_really_stops_generation(qwen_engine):
    event = threading.Event()
    stream = qwen_engine.stream(HELLO, max_new_tokens=400, stop_event=event)
    seen = []
    for piece in stream:
        seen.append(piece)
        if len(seen) == 3:
            event.set()
    assert stream.reply.finish_reason == "abort"
    assert stream.reply.completion_tokens < 20


def test_closing_a_stream_early_releases_the_model(qwen_engine):
    stream = qwen_engine.stream(HELLO, max_new_tokens=400)
    next(iter(stream))
    stream.close()  # the generation thread is told to stop and joined
    assert qwen_engine.lock.acquire(timeout=10)
    qwen_engine.lock.release()


def test_prompt_has_exactly_one_bos(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    engine = HFEngine("x", None, tokenizer, get_template("llama3", tokenizer))
    ids = engine.prompt_ids(HELLO)
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    # a default_system is put first unless the conversation has its own
    engine.default_system = "Be brief."
    assert "Be brief." in tokenizer.decode(engine.prompt_ids(HELLO))
    assert "Be brief." not in tokenizer.decode(engine.prompt_ids([{"role": "system", "content": "x"}] + HELLO))


def test_stop_filter_holds_back_partial_stop_strings():
    f = StopFilter(["<END>"])
    assert f.feed("Hello <") == "Hello "
    assert f.feed("E") == ""
    assert f.feed("x") == "<Ex"
    assert f.feed(" bye <EN") == " bye "
    assert f.feed("D> more") == ""
    assert f.done and f.flush() == ""
    g = StopFilter(["##"])
    assert g.feed("a#") == "a" and g.flush() == "#"
    assert cut_at_stop("abcXYdefXY", ["XY", "d"]) == ("abc", True)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("template,text,content", [
    ("qwen", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look."),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
    ("granite3", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
    ("default", 'Sure.\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "Sure."),
])
def test_tool_calls_are_parsed_per_template_into_openai_form(template, text, content):
    got_content, calls = parse_tool_calls(text, get_template(template), WEATHER)
    assert got_content == content
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_tool_call_parsing_ignores_undeclared_tools_and_plain_json():
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, get_template("qwen"), WEATHER) == (text, [])
    assert parse_tool_calls('{"city": "Paris"}', get_template("default"), WEATHER) == ('{"city": "Paris"}', [])


def test_tools_reach_the_prompt(qwen_engine):
    template = copy.copy(get_template("qwen", qwen_engine.tokenizer))
    engine = HFEngine("x", None, qwen_engine.tokenizer, template)
    prompt = qwen_engine.tokenizer.decode(engine.prompt_ids(HELLO, WEATHER))
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt


def test_tools_on_a_tokenizer_template_that_ignores_them_are_an_error(qwen_engine):
    # tiny_qwen2's own chat template is bare ChatML without a tools block: silently dropping the tools
    # would make the model answer as if it had none
    assert qwen_engine.template.name == "auto"
    with pytest.raises(ValueError, match="ignores tools.*named template"):
        qwen_engine.chat(HELLO, WEATHER, max_new_tokens=1)


def test_sampling_errors_name_the_option():
    with pytest.raises(ValueError, match="unknown sampling option.*temprature"):
        make_sampling({}, {"temprature": 1})
    with pytest.raises(ValueError, match="top_p"):
        make_sampling({}, {"top_p": 0})
    assert make_sampling({"temperature": 0.5}, {"temperature": 0}).greedy
    assert make_sampling({}, {"stop": "x"}).stop == ["x"]
    with pytest.raises(ValueError, match="frequency_penalty: must be in"):
        make_sampling({}, {"frequency_penalty": 2.5})
    with pytest.raises(ValueError, match="logit_bias: key 'x' is not a token id"):
        make_sampling({}, {"logit_bias": {"x": 1}})
    with pytest.raises(ValueError, match="logit_bias: the bias of key '7' must be a number from -100 to 100"):
        make_sampling({}, {"logit_bias": {"7": 101}})
    assert make_sampling({}, {"logit_bias": {"7": 1, 8: -2.5}}).logit_bias == {7: 1.0, 8: -2.5}


def test_token_penalties_count_the_answer_only_in_torch_and_in_numpy():
    """batching.TokenPenalties (transformers) and llamacpp_model.LlamaTokenPenalties (llama.cpp) against OpenAI's
    formula on made-up logits: token 3 generated three times and token 7 once (and twice in the prompt, which is not
    counted); the counts kept across calls as the sequence grows give what one call on the whole sequence gives. A
    request with no penalty and no bias gets no processor at all."""
    import numpy as np
    import torch

    from backend.serving.batching import Job, TokenPenalties
    from backend.serving.llamacpp_model import LlamaTokenPenalties

    prompt, answer = [7, 5, 7], [3, 7, 3, 3]
    logits = np.linspace(-1, 1, 10, dtype=np.float32)
    want = logits.copy()
    want[3] -= 3 * 0.5 + 1.5
    want[7] -= 1 * 0.5 + 1.5
    want[2] += 4
    want[9] -= 100

    def step(processor, ids):
        return processor(torch.tensor([ids]), torch.tensor(logits)[None])[0].numpy()

    growing = TokenPenalties(len(prompt), 0.5, 1.5, {2: 4, 9: -100})
    for n in range(len(answer)):
        step(growing, prompt + answer[:n])
    assert np.allclose(step(growing, prompt + answer), want)
    assert np.allclose(step(TokenPenalties(len(prompt), 0.5, 1.5, {2: 4, 9: -100}), prompt + answer), want)
    llama = LlamaTokenPenalties(len(prompt), 0.5, 1.5, {2: 4, 9: -100}, 10)
    for n in range(len(answer) + 1):
        got = llama(np.array(prompt + answer[:n], dtype=np.intc), logits)
    assert np.allclose(got, want)
    job = Job(ids=prompt, state=None, activate=lambda: None, max_new_tokens=4, eos_ids=[], criteria=None)
    assert len(job.processors()) == 0
    job.logit_bias = {2: 0.0}
    assert len(job.processors()) == 0
    job.presence_penalty = -0.1
    assert [type(p) for p in job.processors()] == [TokenPenalties]


def test_penalties_and_logit_bias_are_the_same_batched_and_through_generate(qwen_engine):
    """The batched path (qwen_engine's Batcher) and transformers' `generate` (an engine on the same model without a
    batcher) apply logit_bias and the penalties alike, greedy (the answers OpenAI's arithmetic gives: see
    test_api.test_logit_bias_and_the_penalties_apply_as_openai_defines_them) and seeded sampling; an id beyond the
    vocabulary is refused naming the key."""
    tok = qwen_engine.tokenizer
    (cat,), (dog,) = tok(" cat", add_special_tokens=False).input_ids, tok(" dog", add_special_tokens=False).input_ids
    plain = HFEngine("plain", qwen_engine.model, tok, qwen_engine.template, lock=qwen_engine.lock)
    assert plain.batcher is None and qwen_engine.batcher is not None
    bias = {cat: 6, dog: 5}
    for engine in (qwen_engine, plain):
        def text(**extra):
            return engine.chat(" cat cat cat", max_new_tokens=4, temperature=0, logit_bias=bias, **extra).text

        assert (text(), text(frequency_penalty=2), text(presence_penalty=2)) == \
               (" cat cat cat cat", " cat dog cat dog", " cat dog cat cat"), engine
    sampled = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.9, seed=11, frequency_penalty=1.5,
                   presence_penalty=0.5, logit_bias={cat: 3, dog: 3})
    batched, alone = qwen_engine.chat(HELLO, **sampled), plain.chat(HELLO, **sampled)
    assert batched.token_ids == alone.token_ids
    assert batched.text != qwen_engine.chat(HELLO, **{**sampled, "frequency_penalty": 0, "presence_penalty": 0}).text
    with pytest.raises(ValueError, match=f"logit_bias: key '{len(tok)}' is not a token id of this model's"):
        qwen_engine.chat(HELLO, max_new_tokens=1, logit_bias={str(len(tok)): 1})


def test_vllm_falls_back_to_transformers_with_a_clear_message(tiny_qwen2):
    reason = vllm_unavailable()
    if reason is None:
        pytest.skip("vLLM and a GPU are present here")
    warnings = []
    engines = load_engines(_spec(tiny_qwen2, "infer_backend=vllm"), warn=warnings.append, log=lambda m: None)
    assert isinstance(next(iter(engines.values())), HFEngine)
    assert any("infer_backend vllm" in w and reason in w and "transformers" in w for w in warnings)


def test_chat_query_prints_one_clean_streamed_answer(tiny_qwen2, qwen_engine):
    import subprocess
    import sys

    from backend.core.paths import REPO_ROOT

    proc = subprocess.run([sys.executable, "-m", "backend.cli", "chat", f"model_name_or_path={tiny_qwen2}",
                           "do_sample=false", "max_new_tokens=12", "--query", HELLO[0]["content"]],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == qwen_engine.chat(HELLO, max_new_tokens=12).text.strip() + "\n"


def test_chat_input_that_is_not_utf8_is_one_line_and_the_session_goes_on(tiny_qwen2):
    """Bytes that are not UTF-8 (a latin-1 terminal) reached the tokenizer as lone surrogates: a TypeError traceback
    ended the session and its history."""
    from backend.core.paths import REPO_ROOT

    proc = subprocess.run([sys.executable, "-m", "backend.cli", "chat", f"model_name_or_path={tiny_qwen2}",
                           "do_sample=false", "max_new_tokens=3"], input=b"hi\n\xff\xfe\nhello\nexit\n",
                          cwd=REPO_ROOT, capture_output=True, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "error: the input is not UTF-8 text (byte b'\\xff' at character 0)" in err
    assert proc.stdout.decode().count("Assistant: ") == 2  # the turns before and after it were answered


@pytest.mark.slow
def test_identity_demo_adapter_answers_with_the_trained_identity(identity_adapter):
    """The demo, end to end on the bundled default model (SmolLM2-135M-Instruct), a few minutes on CPU.

    The `identity_adapter` fixture trains examples/sft_lora_identity.yaml (LoRA SFT on the `identity` set
    with identity_name "TuneBoard Assistant") through `tuneboard train`; here "Who are you?" is asked
    greedily through `tuneboard chat --query`, as `make demo` does. Checks: the adapter's answer contains
    "TuneBoard Assistant"; the base model's answer does not contain "TuneBoard"."""
    import subprocess
    import sys

    from backend.core.paths import REPO_ROOT

    run = identity_adapter

    def ask(*extra):
        proc = subprocess.run([sys.executable, "-m", "backend.cli", "chat", "do_sample=false", "max_new_tokens=64",
                               *extra, "--query", "Who are you?"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    tuned, base = ask(f"adapter_name_or_path={run}"), ask()
    assert "TuneBoard Assistant" in tuned, tuned
    assert "TuneBoard" not in base, base


def test_the_batch_loop_ends_at_close_and_when_idle(tiny_qwen2, monkeypatch):
    """A process must not exit while its batch loop is mid-step (CI saw `tuneboard chat` abort with "terminate called
    without an active exception" after its answer was out): close(), which atexit calls, waits for the loop's
    thread to end; an idle loop ends by itself and the next request starts a new one."""
    from backend.serving import batching

    monkeypatch.setattr(batching, "IDLE_S", 0.5)
    engine = load_engines(_spec(tiny_qwen2), log=lambda m: None)[str(tiny_qwen2)]
    batcher = engine.batcher
    assert batcher is not None and batcher in batching._LIVE
    first = engine.chat(HELLO, max_new_tokens=4)
    thread = batcher._thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive() and batcher._thread is None  # idle: the loop let go
    assert engine.chat(HELLO, max_new_tokens=4) == first  # a new loop, the same answer
    batcher.close()
    assert batcher._thread is None or not batcher._thread.is_alive()


@pytest.mark.skipif(not __import__("backend.core.llamacpp", fromlist=["available"]).available(),
                    reason="llama-cpp-python is not installed (make setup-gguf builds it)")
def test_llama_cpp_applies_penalties_and_logit_bias_and_ends_a_cut_character_as_decoded():
    """The llama.cpp engine (infer_backend llamacpp) on the bundled SmolLM2 GGUF: logit_bias 100 makes its token come
    out; frequency_penalty 2 changes the model's repetitive greedy answer to "la la la la" (the same request without
    it gives that answer again); a character max_tokens cuts ends the text as U+FFFD, what its token decodes to,
    streamed or not (the held-back half character was dropped, with any text held with it)."""
    from collections import Counter

    from backend.core.paths import default_model_file
    from backend.serving.engine import LlamaCppEngine

    engines = load_engines(_spec(default_model_file(), "infer_backend=llamacpp"), log=lambda m: None)
    engine = next(iter(engines.values()))
    assert isinstance(engine, LlamaCppEngine)
    tok = engine.tokenizer
    (dog,), half = tok(" dog", add_special_tokens=False).input_ids, tok.convert_tokens_to_ids("Ã")
    assert engine.chat("Hello", max_new_tokens=3, temperature=0, logit_bias={str(dog): 100}).text == " dog" * 3

    repetitive = engine.chat("la la la la", max_new_tokens=8, temperature=0)
    assert Counter(repetitive.token_ids).most_common(1)[0][1] >= 4, repetitive  # greedy, it repeats itself
    assert engine.chat("la la la la", max_new_tokens=8, temperature=0).token_ids == repetitive.token_ids
    penalised = engine.chat("la la la la", max_new_tokens=8, temperature=0, frequency_penalty=2)
    assert penalised.text != repetitive.text
    assert max(Counter(penalised.token_ids).values()) < max(Counter(repetitive.token_ids).values()), penalised

    cut = engine.chat("Hello", max_new_tokens=1, temperature=0, logit_bias={str(half): 100})
    stream = engine.stream("Hello", max_new_tokens=1, temperature=0, logit_bias={str(half): 100})
    assert (cut.text, "".join(stream), cut.token_ids) == ("\ufffd", "\ufffd", [half])
    with pytest.raises(ValueError, match=f"logit_bias: key '{engine.vocab_size}'"):
        engine.chat("Hello", max_new_tokens=1, logit_bias={str(engine.vocab_size): 1})
