"""Labels by char offsets, truncation, dropped rows and pt chunking, on the real SmolLM2 tokenizer
(pad == eos == <|im_end|>, the case where labels derived from pad ids would unlearn the stop token)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from backend.dataprep.preprocess import (
    IGNORE_INDEX,
    build_pt_dataset,
    build_sft_dataset,
    encode_example,
    encode_segments,
    encode_text,
)

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_dir):
    """The bundled model's own tokenizer (from the shared GGUF -> HF folder fixture in conftest)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@dataclass
class Seg:
    """A hand-made segment (text, trained, role), for cases no template produces."""

    text: str
    trained: bool
    role: str


@pytest.fixture(scope="session")
def chatml(smol_tokenizer):
    """SmolLM2's own format (ChatML + its default system prompt) from backend/templates."""
    from backend.dataprep.templates import get_template

    return get_template("smollm2", smol_tokenizer)


def trained_spans(tokenizer, enc) -> list[str]:
    """Decode each run of consecutive trained labels."""
    spans, run = [], []
    for label in enc.labels + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            run.append(label)
        elif run:
            spans.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return spans


def whole_ids(tokenizer, segments) -> list[int]:
    return tokenizer("".join(s.text for s in segments), add_special_tokens=False)["input_ids"]


def test_single_turn_trains_answer_and_stop_token(smol_tokenizer, chatml):
    tok = smol_tokenizer
    assert tok.pad_token_id == tok.eos_token_id  # the case this design exists for
    segments = chatml.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}])
    enc = encode_segments(segments, tok, 1024, return_tokens=True)
    assert enc.input_ids == whole_ids(tok, segments)
    assert tok.decode(enc.input_ids).startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")  # default system
    assert trained_spans(tok, enc) == ["Hello there!<|im_end|>"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # the last <|im_end|> (after the answer) is trained, the earlier ones (system, user) are not
    ends = [i for i, t in enumerate(enc.input_ids) if t == im_end]
    assert [enc.labels[i] for i in ends] == [IGNORE_INDEX, IGNORE_INDEX, im_end]
    assert enc.labels[-1] == IGNORE_INDEX and enc.tokens[-1] == "Ċ"  # the newline after it is not
    assert enc.num_trained == len(tok("Hello there!")["input_ids"]) + 1
    assert not enc.truncated and enc.tokens == tok.convert_ids_to_tokens(enc.input_ids)


MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]


def test_multi_turn_every_assistant_turn_trained(smol_tokenizer, chatml):
    enc = encode_example({"messages": MULTI}, chatml, smol_tokenizer, 1024)
    assert trained_spans(smol_tokenizer, enc) == ["4.<|im_end|>", "6, of course.<|im_end|>"]
    assert enc.input_ids == whole_ids(smol_tokenizer, chatml.render(MULTI))


def test_mask_history_trains_only_last_turn(smol_tokenizer, chatml):
    enc = encode_example({"messages": MULTI}, chatml, smol_tokenizer, 1024, mask_history=True)
    assert trained_spans(smol_tokenizer, enc) == ["6, of course.<|im_end|>"]


def test_train_on_prompt_trains_everything(smol_tokenizer, chatml):
    enc = encode_example({"messages": MULTI}, chatml, smol_tokenizer, 1024, train_on_prompt=True)
    assert enc.labels == enc.input_ids
    assert enc.num_trained == len(enc.input_ids) - 1  # position 0 is never predicted


def test_system_prompt_is_not_trained(smol_tokenizer, chatml):
    messages = [{"role": "system", "content": "You speak like a pirate."},
                {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Arr, ahoy!"}]
    enc = encode_example({"messages": messages}, chatml, smol_tokenizer, 1024)
    assert trained_spans(smol_tokenizer, enc) == ["Arr, ahoy!<|im_end|>"]
    text = smol_tokenizer.decode(enc.input_ids)
    assert text.startswith("<|im_start|>system\nYou speak like a pirate.<|im_end|>\n")


def test_tool_call_row(smol_tokenizer, chatml):
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 °C in Paris."},
    ]
    tools = [{"name": "get_weather", "description": "Current weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    enc = encode_example({"messages": messages, "tools": tools}, chatml, smol_tokenizer, 1024)
    # the call (smollm2's documented JSON format) and the final answer are targets; the tool schema
    # in the system prompt and the tool's output are context
    assert trained_spans(smol_tokenizer, enc) == [json.dumps(call) + "<|im_end|>", "It is 21 °C in Paris.<|im_end|>"]
    text = smol_tokenizer.decode(enc.input_ids)
    assert '"temp_c": 21' in text and "get_weather" in text.split("<|im_start|>user")[0]


@pytest.mark.parametrize("mask_history", [False, True])
def test_auto_template_is_id_exact_with_apply_chat_template(smol_tokenizer, mask_history):
    from backend.dataprep.templates import get_template

    auto = get_template("auto", smol_tokenizer)
    enc = encode_example({"messages": MULTI}, auto, smol_tokenizer, 1024, mask_history=mask_history)
    expected = smol_tokenizer.apply_chat_template(MULTI, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert enc.input_ids == list(expected)
    spans = ["4.<|im_end|>", "6, of course.<|im_end|>"]
    assert trained_spans(smol_tokenizer, enc) == (spans[1:] if mask_history else spans)


def test_token_straddling_into_the_answer_is_trained(smol_tokenizer):
    """'Assistant: ' + 'Hello' tokenizes as ':' 'ĠHello': the space belongs to the scaffold, but the
    token carries the answer's first word, so it must be trained (else the first word never is)."""
    segments = [Seg("User: Hi\n", False, "user"), Seg("Assistant: ", False, "scaffold"),
                Seg("Hello there!", True, "assistant"), Seg("\n\n", False, "scaffold")]
    enc = encode_segments(segments, smol_tokenizer, None)
    assert enc.input_ids == whole_ids(smol_tokenizer, segments)
    assert "ĠHello" in smol_tokenizer.convert_ids_to_tokens(enc.input_ids)
    assert trained_spans(smol_tokenizer, enc) == [" Hello there!"]


def test_slow_tokenizer_fallback_tokenizes_per_segment(smol_tokenizer, chatml):
    class NoOffsets:  # a tokenizer without offset mapping, as slow tokenizers are
        is_fast = False

        def encode(self, text, add_special_tokens=False):
            return smol_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    segments = chatml.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}])
    enc = encode_segments(segments, NoOffsets(), None)
    assert enc.input_ids == whole_ids(smol_tokenizer, segments)  # ChatML segments meet at special tokens
    assert trained_spans(smol_tokenizer, enc) == ["Hello there!<|im_end|>"]


def test_truncation_cuts_the_prompt_and_keeps_the_answer(smol_tokenizer, chatml):
    long_question = " ".join(f"word{i}" for i in range(300))
    messages = [{"role": "user", "content": long_question}, {"role": "assistant", "content": "Short answer."}]
    full = encode_example({"messages": messages}, chatml, smol_tokenizer, None)
    assert len(full.input_ids) > 200
    enc = encode_example({"messages": messages}, chatml, smol_tokenizer, 64, return_tokens=True)
    assert enc.truncated and len(enc.input_ids) == 64
    assert trained_spans(smol_tokenizer, enc) == ["Short answer.<|im_end|>"]
    text = smol_tokenizer.decode(enc.input_ids)
    # the start (system prompt) and the role header right before the answer survive; the middle is cut
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\nShort answer.<|im_end|>\n")
    assert "word299" in text and "word0 " not in text


def test_truncation_keeps_the_beginning_of_a_long_answer(smol_tokenizer, chatml):
    answer = " ".join(f"step{i}" for i in range(300))
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": answer}]
    enc = encode_example({"messages": messages}, chatml, smol_tokenizer, 64)
    assert enc.truncated and len(enc.input_ids) == 64
    text = smol_tokenizer.decode(enc.input_ids)
    assert "<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\nstep0 step1" in text  # whole prompt kept
    (span,) = trained_spans(smol_tokenizer, enc)
    assert span.startswith("step0 step1 ") and not span.endswith("<|im_end|>")


def test_truncation_drops_oldest_turns_first(smol_tokenizer, chatml):
    old = " ".join(f"old{i}" for i in range(100))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": old}, {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]
    enc = encode_example({"messages": messages}, chatml, smol_tokenizer, 60)
    assert enc.truncated and len(enc.input_ids) <= 60
    text = smol_tokenizer.decode(enc.input_ids)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n6.<|im_end|>\n")
    assert trained_spans(smol_tokenizer, enc) == ["6.<|im_end|>"]


def test_build_sft_dataset_counts_truncated_and_skipped_rows(smol_tokenizer, chatml):
    rows_in = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
         "_source": "demo", "_row": 0},
        {"messages": [{"role": "user", "content": "A question with no answer"}], "_source": "demo", "_row": 1},
        {"messages": [{"role": "user", "content": "x " * 400}, {"role": "assistant", "content": "Ok."}],
         "_source": "demo", "_row": 2},
    ]
    lines = []
    rows, stats = build_sft_dataset(rows_in, chatml, smol_tokenizer, 48, log=lines.append)
    assert (stats.rows_in, stats.rows, stats.truncated, stats.dropped, stats.failed) == (3, 2, 1, 0, 1)
    assert lines == ["1 rows could not be rendered and were skipped: demo row 1: messages[0]: the conversation "
                     "ends with a user turn, so there is no assistant turn to train "
                     "(render with add_generation_prompt=True for a prompt)",
                     "1 rows truncated to cutoff_len=48: demo row 2"]
    assert all(len(r["input_ids"]) == len(r["labels"]) == len(r["attention_mask"]) <= 48 for r in rows)
    assert stats.total_tokens == sum(len(r["input_ids"]) for r in rows)
    assert stats.trained_tokens == sum(sum(1 for x in r["labels"][1:] if x != IGNORE_INDEX) for r in rows)
    # "Hello!" and "Ok." plus one <|im_end|> each
    assert stats.trained_tokens == sum(len(smol_tokenizer(a)["input_ids"]) + 1 for a in ("Hello!", "Ok."))
    assert str(stats) == (f"2 rows from 3 (1 truncated, 0 dropped, 1 skipped), {stats.total_tokens:,} tokens, "
                          f"{stats.trained_tokens} trained")

    with pytest.raises(ValueError, match="all 1 rows were dropped or skipped .demo row 1: messages.0."):
        build_sft_dataset([rows_in[1]], chatml, smol_tokenizer, 48)


def test_rows_without_trained_tokens_are_dropped_and_counted(smol_tokenizer):
    """With the "empty" template nothing marks the end of a turn: an empty answer trains nothing."""
    from backend.dataprep.templates import get_template

    empty = get_template("empty", smol_tokenizer)
    rows_in = [{"messages": [{"role": "user", "content": "Who are you?\n"}, {"role": "assistant", "content": a}],
                "_source": "identity", "_row": i} for i, a in enumerate(["I am Tune.", "", "A bot.", ""])]
    lines = []
    rows, stats = build_sft_dataset(rows_in, empty, smol_tokenizer, 64, log=lines.append)
    assert (stats.rows, stats.dropped, stats.dropped_ids) == (2, 2, ["identity row 1", "identity row 3"])
    assert lines == ["2 rows left with no trained token were dropped: identity row 1, identity row 3"]


def test_bad_example_names_the_row(smol_tokenizer, chatml):
    with pytest.raises(ValueError, match="alpaca_en_demo row 7: 'messages'"):
        encode_example({"messages": [], "_source": "alpaca_en_demo", "_row": 7}, chatml, smol_tokenizer, 64)


def test_pt_text_is_chunked_not_cut(smol_tokenizer):
    tok = smol_tokenizer
    text = " ".join(f"token{i}" for i in range(100))
    chunks = encode_text(text, tok, 32, add_bos=False, add_eos=True)
    expected = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [i for c in chunks for i in c.input_ids] == expected[: sum(len(c.input_ids) for c in chunks)]
    assert len(expected) - sum(len(c.input_ids) for c in chunks) <= 1  # only a 1-token tail can be left out
    assert all(len(c.input_ids) <= 32 and c.labels == c.input_ids and not c.truncated for c in chunks)
    assert len(chunks) == -(-len(expected) // 32) or len(expected) % 32 == 1

    lines = []
    rows, stats = build_pt_dataset([{"text": text, "_source": "c4", "_row": 0}, {"text": "", "_source": "c4", "_row": 1}],
                                   tok, 32, log=lines.append)
    assert len(rows) == len(chunks) and stats.dropped == 1 and stats.truncated == 0
    assert lines == ["1 rows left with no trained token were dropped: c4 row 1"]
