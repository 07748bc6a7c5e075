"""Chat templates: golden renders (string-exact, written out by hand from the official formats,
independent of the template files), masks, tools, errors, and id-exact parity with the SmolLM2
tokenizer's own chat template."""
from __future__ import annotations

import pytest

from backend.dataprep.templates import Segment, Template, TokenizerTemplate, get_template, list_templates, validate_messages

SYS = [{"role": "system", "content": "You are terse."},
       {"role": "user", "content": "Hi"},
       {"role": "assistant", "content": "Hello!"},
       {"role": "user", "content": "What is 2+2?"},
       {"role": "assistant", "content": "4"}]
NOSYS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]

QWEN_SYS = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOL_SYS = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
VICUNA_SYS = ("A chat between a curious user and an artificial intelligence assistant. "
              "The assistant gives helpful, detailed, and polite answers to the user's questions.")
ALPACA_SYS = ("Below is an instruction that describes a task. "
              "Write a response that appropriately completes the request.")

# name -> (render of SYS, render of NOSYS): the official strings, typed out.
GOLDEN = {
    "chatml": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"),
    "yi": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"),
    "qwen": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        f"<|im_start|>system\n{QWEN_SYS}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"),
    "qwen3": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"),
    "qwen3_nothink": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"),
    "smollm2": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        f"<|im_start|>system\n{SMOL_SYS}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"),
    "llama2": (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] What is 2+2? [/INST] 4 </s>",
        "<s>[INST] Hi [/INST] Hello! </s>"),
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"),
    "mistral": (  # v0.3: system folded into the LAST user turn
        "<s>[INST] Hi[/INST] Hello!</s>[INST] You are terse.\n\nWhat is 2+2?[/INST] 4</s>",
        "<s>[INST] Hi[/INST] Hello!</s>"),
    "gemma": (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"),
    "phi3": (
        "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4<|end|>\n<|endoftext|>",
        "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|endoftext|>"),
    "phi4": (
        "<|im_start|>system<|im_sep|>You are terse.<|im_end|><|im_start|>user<|im_sep|>Hi<|im_end|>"
        "<|im_start|>assistant<|im_sep|>Hello!<|im_end|><|im_start|>user<|im_sep|>What is 2+2?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>4<|im_end|>",
        "<|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant<|im_sep|>Hello!<|im_end|>"),
    "deepseek3": (
        "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"),
    "glm4": (
        "[gMASK]<sop><|system|>\nYou are terse.<|user|>\nHi<|assistant|>\nHello!<|user|>\nWhat is 2+2?<|assistant|>\n4",
        "[gMASK]<sop><|user|>\nHi<|assistant|>\nHello!"),
    "zephyr": (
        "<|system|>\nYou are terse.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
        "<|user|>\nWhat is 2+2?</s>\n<|assistant|>\n4</s>\n",
        "<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"),
    "cohere": (
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are terse.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is 2+2?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>4<|END_OF_TURN_TOKEN|>",
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>"),
    "falcon": (
        "System: You are terse.\nUser: Hi\nFalcon: Hello!\nUser: What is 2+2?\nFalcon: 4\n",
        "User: Hi\nFalcon: Hello!\n"),
    "olmo": (
        "<|endoftext|><|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\nHello!<|endoftext|>\n"
        "<|user|>\nWhat is 2+2?\n<|assistant|>\n4<|endoftext|>",
        "<|endoftext|><|user|>\nHi\n<|assistant|>\nHello!<|endoftext|>"),
    "granite3": (
        "<|start_of_role|>system<|end_of_role|>You are terse.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Hello!<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>What is 2+2?<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>4<|end_of_text|>\n",
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Hello!<|end_of_text|>\n"),
    "vicuna": (
        "<s>You are terse. USER: Hi ASSISTANT: Hello!</s>USER: What is 2+2? ASSISTANT: 4</s>",
        f"<s>{VICUNA_SYS} USER: Hi ASSISTANT: Hello!</s>"),
    "alpaca": (
        "You are terse.\n\n### Instruction:\nHi\n\n### Response:\nHello!</s>\n\n"
        "### Instruction:\nWhat is 2+2?\n\n### Response:\n4</s>\n\n",
        f"{ALPACA_SYS}\n\n### Instruction:\nHi\n\n### Response:\nHello!</s>\n\n"),
    "default": (
        "System: You are terse.</s>\nHuman: Hi</s>\nAssistant:Hello!</s>\nHuman: What is 2+2?</s>\nAssistant:4</s>\n",
        "Human: Hi</s>\nAssistant:Hello!</s>\n"),
    "empty": ("You are terse.HiHello!What is 2+2?4", "HiHello!"),
}

# End-of-turn marker each template trains after the content ("" = the family has none).
EOT = {"chatml": "<|im_end|>", "yi": "<|im_end|>", "qwen": "<|im_end|>", "qwen3": "<|im_end|>",
       "qwen3_nothink": "<|im_end|>", "smollm2": "<|im_end|>", "llama2": " </s>", "llama3": "<|eot_id|>",
       "mistral": "</s>", "gemma": "<end_of_turn>", "phi3": "<|end|>", "phi4": "<|im_end|>",
       "deepseek3": "<｜end▁of▁sentence｜>", "glm4": "", "zephyr": "</s>", "cohere": "<|END_OF_TURN_TOKEN|>",
       "falcon": "\n", "olmo": "<|endoftext|>", "granite3": "<|end_of_text|>", "vicuna": "</s>",
       "alpaca": "</s>", "default": "</s>", "empty": ""}
# What the model emits before the content (trained together with it).
LEAD = {"llama2": " ", "mistral": " ", "vicuna": " ", "falcon": " ", "glm4": "\n"}
BOS = {"llama2": "<s>", "llama3": "<|begin_of_text|>", "mistral": "<s>", "gemma": "<bos>",
       "deepseek3": "<｜begin▁of▁sentence｜>", "glm4": "[gMASK]<sop>", "cohere": "<BOS_TOKEN>",
       "olmo": "<|endoftext|>", "vicuna": "<s>"}


def test_every_template_has_a_golden_render():
    assert sorted(GOLDEN) == list_templates()
    assert len(list_templates()) >= 22


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_render(name):
    t = get_template(name)
    with_sys, without_sys = GOLDEN[name]
    assert t.render_text(SYS) == with_sys
    assert t.render_text(NOSYS) == without_sys


def _turns(segs):
    """Trained text grouped per contiguous trained run."""
    runs, cur = [], ""
    for s in segs:
        if s.trained:
            cur += s.text
        elif cur:
            runs.append(cur)
            cur = ""
    return runs + ([cur] if cur else [])


def _expected_outputs(name, answers):
    think = "<think>\n\n</think>\n\n"
    out = [LEAD.get(name, "") + a + EOT[name] for a in answers]
    if name == "qwen3":  # the final turn's empty reasoning block is model output in thinking mode
        out[-1] = think + out[-1]
    return out


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_segments_concatenate_and_train_only_answers(name):
    t = get_template(name)
    segs = t.render(SYS)
    assert "".join(s.text for s in segs) == t.render_text(SYS)
    assert all(isinstance(s, Segment) and s.text for s in segs)
    if name == "empty":  # no markers: the system, user and assistant texts abut, so runs merge
        assert [s.text for s in segs if s.trained] == ["Hello!", "4"]
        return
    assert _turns(segs) == _expected_outputs(name, ["Hello!", "4"])
    assert all(s.role == "assistant" for s in segs if s.trained)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_bos_exactly_once(name):
    segs = get_template(name).render(SYS)
    bos = [s for s in segs if s.role == "bos"]
    if name in BOS:
        assert [s.text for s in bos] == [BOS[name]] and segs[0] is bos[0]
        assert not bos[0].trained
        # nowhere else in the text; except llama2, which repeats <s> before every [INST] (turn scaffolding),
        # and olmo, whose BOS string is also its eos
        if name not in ("llama2", "olmo"):
            assert BOS[name] not in "".join(s.text for s in segs[1:])
    else:
        assert bos == []


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_mask_history_trains_only_last_turn(name):
    segs = get_template(name).render(SYS, mask_history=True)
    if name == "empty":
        assert [s.text for s in segs if s.trained] == ["4"]
        return
    assert _turns(segs) == _expected_outputs(name, ["Hello!", "4"])[-1:]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_train_on_prompt_trains_everything_but_bos(name):
    segs = get_template(name).render(SYS, train_on_prompt=True)
    assert all(s.trained == (s.role != "bos") for s in segs)


GEN = {  # prompt for [system, user "Hi"] + generation prompt
    "chatml": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "qwen3_nothink": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "llama2": "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST]",
    "mistral": "<s>[INST] You are terse.\n\nHi[/INST]",
    "gemma": "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n",
    "glm4": "[gMASK]<sop><|system|>\nYou are terse.<|user|>\nHi<|assistant|>",
    "falcon": "System: You are terse.\nUser: Hi\nFalcon:",
    "olmo": "<|endoftext|><|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\n",
}


@pytest.mark.parametrize("name", sorted(GEN))
def test_generation_prompt(name):
    msgs = SYS[:2] if name not in ("qwen3", "qwen3_nothink") else SYS[1:2]
    segs = get_template(name).render(msgs, add_generation_prompt=True)
    assert "".join(s.text for s in segs) == GEN[name]
    assert not any(s.trained for s in segs)
    if get_template(name).generation_prompt:
        assert segs[-1].role == "generation_prompt" and segs[-1].text == get_template(name).generation_prompt


def test_generation_prompt_after_history_keeps_history_untrained():
    segs = get_template("smollm2").render(SYS[:4], add_generation_prompt=True)
    assert segs[-1].text == "<|im_start|>assistant\n" and not any(s.trained for s in segs)


def test_fold_system_segment_is_marked_system():
    segs = get_template("gemma").render(SYS)
    assert [s.text for s in segs if s.role == "system"] == ["You are terse.\n\n"]


def test_qwen3_history_reasoning_dropped_last_kept():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"}]
    assert get_template("qwen3").render_text(msgs) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n")
    # nothink: a real reasoning block in the data is still the model's output
    assert _turns(get_template("qwen3_nothink").render(msgs, mask_history=True)) == ["<think>\nr2\n</think>\n\nA2<|im_end|>"]
    assert _turns(get_template("qwen3_nothink").render(NOSYS)) == ["Hello!<|im_end|>"]


def test_placeholder_tokens_follow_the_tokenizer():
    class Tok:
        bos_token = "<|begin_of_text|>"
        eos_token = "<|eot_id|>"
    assert get_template("alpaca", Tok()).render_text(NOSYS).endswith("Hello!<|eot_id|>\n\n")
    assert get_template("vicuna", Tok()).render_text(NOSYS).startswith("<|begin_of_text|>A chat")
    assert get_template("default", Tok()).stop_words == ["<|eot_id|>"]


# ------------------------------------------------------------------------------------------ tools
TOOLS = [{"name": "get_weather", "description": "Get the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
TOOL_ROW = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 degrees."}]
TOOL_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
             '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}')
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_qwen_tool_row():
    segs = get_template("qwen").render(TOOL_ROW, TOOLS)
    assert "".join(s.text for s in segs) == (
        f"<|im_start|>system\n{QWEN_SYS}\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{TOOL_JSON}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>\n{CALL_JSON}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 21 degrees.<|im_end|>\n")
    assert _turns(segs) == [f"<tool_call>\n{CALL_JSON}\n</tool_call><|im_end|>", "It is 21 degrees.<|im_end|>"]
    assert [s.text for s in segs if s.role == "tool"] == ["<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"]


def test_qwen_groups_consecutive_tool_results_and_content_before_calls():
    row = [{"role": "user", "content": "q"},
           {"role": "assistant", "content": "Let me check.", "tool_calls": [
               {"name": "a", "arguments": {}}, {"type": "function", "function": {"name": "b", "arguments": '{"x": 1}'}}]},
           {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
           {"role": "assistant", "content": "done"}]
    text = get_template("qwen").render_text(row)
    assert ("<|im_start|>assistant\nLet me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n") in text


def test_default_tool_row():
    segs = get_template("default").render(TOOL_ROW, TOOLS)
    tool_line = TOOL_JSON[len('{"type": "function", "function": '):-1]  # default format lists bare schemas
    assert "".join(s.text for s in segs) == (
        "System: You have access to the following tools:\n" + tool_line + "\n\n"
        "To call a tool, reply with one JSON object per call, each on its own line: "
        "{\"name\": <tool name>, \"arguments\": <arguments object>}. The results come back in the next turn.</s>\n"
        "Human: Weather in Paris?</s>\nAssistant:" + CALL_JSON + "</s>\n"
        "Human: {\"temp\": 21}</s>\nAssistant:It is 21 degrees.</s>\n")
    assert _turns(segs) == [CALL_JSON + "</s>", "It is 21 degrees.</s>"]
    assert [s.role for s in segs if s.text.startswith("Human: {")] == ["tool"]


def test_llama3_tool_row_uses_ipython_and_parameters():
    text = get_template("llama3").render_text(TOOL_ROW, TOOLS)
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 21}<|eot_id|>' in text
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou have access to the "
                           "following functions.")


def test_mistral_tool_row():
    assert get_template("mistral").render_text(TOOL_ROW, TOOLS) == (
        f"<s>[AVAILABLE_TOOLS] [{TOOL_JSON}][/AVAILABLE_TOOLS][INST] Weather in Paris?[/INST]"
        f"[TOOL_CALLS] [{CALL_JSON}]</s>[TOOL_RESULTS] {{\"content\": {{\"temp\": 21}}}}[/TOOL_RESULTS]"
        " It is 21 degrees.</s>")


# ----------------------------------------------------------------------------------------- errors
def test_unknown_template_names_close_matches():
    with pytest.raises(ValueError, match=r"unknown template 'lama3'.*llama3"):
        get_template("lama3")


@pytest.mark.parametrize("msgs,agp,match", [
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
     False, r"messages\[2\]: two assistant turns in a row"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}],
     False, r"messages\[1\]: a system message must be the first"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}, {"role": "assistant", "content": "b"}],
     False, r"messages\[1\]: a tool result must follow an assistant turn with tool_calls"),
    ([{"role": "user", "content": "a"}], False, r"messages\[0\]: .*no assistant turn to train"),
    ([{"role": "assistant", "content": "b"}], False, r"messages\[0\]: the conversation must start with a user turn"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], True, r"messages\[1\]: two user turns"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], False, r"messages\[1\]: unknown role 'bot'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], True, r"messages\[1\]: .*already ends"),
    ([], False, "non-empty list"),
])
def test_bad_messages(msgs, agp, match):
    for name in ("chatml", "llama3"):
        with pytest.raises(ValueError, match=match):
            get_template(name).render(msgs, add_generation_prompt=agp)


def test_bad_tool_call_arguments_name_the_message():
    row = [{"role": "user", "content": "a"},
           {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{not json"}]},
           {"role": "tool", "content": "r"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]: 'arguments' is not valid JSON"):
        validate_messages(row)


def test_template_file_unknown_key(tmp_path, monkeypatch):
    import backend.dataprep.templates as tm
    (tmp_path / "bad.yaml").write_text('user: "{content}"\nasistant_suffix: "x"\n')
    monkeypatch.setattr(tm, "TEMPLATES_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"bad\.yaml: unknown key 'asistant_suffix' \(did you mean 'assistant_suffix'\?\)"):
        tm.get_template("bad")
    (tmp_path / "bad2.yaml").write_text('tool_call: {itme: "{json}"}\n')
    with pytest.raises(ValueError, match=r"bad2\.yaml: tool_call: unknown key 'itme'"):
        tm.get_template("bad2")


def test_auto_needs_a_chat_template():
    class NoTemplate:
        chat_template = None
        def apply_chat_template(self, *a, **k):  # pragma: no cover - never reached
            raise AssertionError
    with pytest.raises(ValueError, match="no chat_template"):
        get_template("auto", NoTemplate())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        get_template("auto")


# ------------------------------------------------------------------------- SmolLM2 tokenizer parity
@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer
    from backend.core.paths import default_model_file
    f = default_model_file()
    return AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)


def _ids(out):
    """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5, a list before."""
    return list(out["input_ids"]) if not isinstance(out, list) else out


PARITY = [
    (SYS, False), (NOSYS, False), (SYS[:4], True), (SYS[1:2], True),
    ([{"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": "multi\nline\n"}], False),
]


@pytest.mark.parametrize("msgs,agp", PARITY)
def test_smollm2_id_parity(smol_tok, msgs, agp):
    text = get_template("smollm2").render_text(msgs, add_generation_prompt=agp)
    assert text == smol_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
    ours = smol_tok(text, add_special_tokens=False).input_ids
    assert ours == _ids(smol_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp))


@pytest.mark.parametrize("msgs,agp", PARITY)
def test_auto_matches_tokenizer(smol_tok, msgs, agp):
    t = get_template("auto", smol_tok)
    assert isinstance(t, TokenizerTemplate)
    segs = t.render(msgs, add_generation_prompt=agp)
    assert "".join(s.text for s in segs) == smol_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert _turns(segs) == ([] if agp else [a + "<|im_end|>" for a in answers])
    if not agp:  # the same segmentation as the named template
        named = get_template("smollm2").render(msgs)
        assert [(s.text, s.trained) for s in _merge(segs)] == [(s.text, s.trained) for s in _merge(named)]
    if not agp:
        assert _turns(t.render(msgs, mask_history=True)) == [answers[-1] + "<|im_end|>"]
        assert all(s.trained == (s.role != "bos") for s in t.render(msgs, train_on_prompt=True))


def _merge(segs):
    out: list[Segment] = []
    for s in segs:
        if out and out[-1].trained == s.trained:
            out[-1] = Segment(out[-1].text + s.text, s.trained, out[-1].role)
        else:
            out.append(Segment(s.text, s.trained, s.role))
    return out


# Official jinja chat templates of other families (as published on the Hub), rendered by transformers'
# own jinja renderer behind a tokenizer-shaped object: the named template must give the same text.
LLAMA3_JINJA = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ZEPHYR_JINJA = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
COHERE_JINJA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message"
    " = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% if system_message != false %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + system_message + "
    "'<|END_OF_TURN_TOKEN|>' }}{% endif %}{% for message in loop_messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'user' %}{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + content.strip() + "
    "'<|END_OF_TURN_TOKEN|>' }}{% elif message['role'] == 'assistant' %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'"
    "  + content.strip() + '<|END_OF_TURN_TOKEN|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}")
PHI3_JINJA = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


class JinjaTokenizer:
    """Just the tokenizer surface TokenizerTemplate uses, rendering with transformers' jinja code."""

    def __init__(self, chat_template, bos_token, eos_token):
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos_token, eos_token

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        from transformers.utils.chat_template_utils import render_jinja_template
        out = render_jinja_template(conversations=[messages], tools=tools, chat_template=self.chat_template,
                                    add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)
        rendered = out[0] if isinstance(out, tuple) else out
        return rendered[0] if isinstance(rendered, list) else rendered


@pytest.mark.parametrize("name,jinja,bos,eos", [
    ("llama3", LLAMA3_JINJA, "<|begin_of_text|>", "<|eot_id|>"),
    ("zephyr", ZEPHYR_JINJA, "<s>", "</s>"),
    ("cohere", COHERE_JINJA, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    ("phi3", PHI3_JINJA, "<s>", "<|endoftext|>"),
])
def test_named_matches_official_jinja_and_auto(name, jinja, bos, eos):
    tok = JinjaTokenizer(jinja, bos, eos)
    named, auto = get_template(name), get_template("auto", tok)
    for msgs, agp in [(SYS, False), (NOSYS, False), (SYS[:2], True),
                      ([{"role": "user", "content": " pad "}, {"role": "assistant", "content": " x "}], False)]:
        official = tok.apply_chat_template(msgs, add_generation_prompt=agp)
        assert named.render_text(msgs, add_generation_prompt=agp) == official
        assert auto.render_text(msgs, add_generation_prompt=agp) == official
    # auto finds the same trained spans as the named template
    assert _turns(auto.render(SYS)) == _turns(named.render(SYS))
    assert [s.role for s in auto.render(SYS) if s.role == "bos"] == (["bos"] if "bos_token" in jinja else [])


def test_template_class_api():
    t = get_template("qwen")
    assert isinstance(t, Template) and t.name == "qwen"
    assert t.default_system == QWEN_SYS and t.stop_words == ["<|im_end|>"] and t.system_style == "native"
    assert get_template("gemma").system_style == "fold"


# ------------------------------------------------------------------------------ export to jinja
@pytest.mark.parametrize("name", sorted(set(GOLDEN) - {"qwen3", "qwen3_nothink"}))
def test_template_to_jinja_renders_the_same(name):
    """The exported jinja, run by transformers' renderer, gives render_text's string (plain turns)."""
    from backend.dataprep.templates import template_to_jinja
    t = get_template(name)
    tok = JinjaTokenizer(template_to_jinja(t), "<unused-bos>", "<unused-eos>")
    spaced = [{"role": "system", "content": " s "}, {"role": "user", "content": " q "},
              {"role": "assistant", "content": " a "}]
    for msgs, agp in [(SYS, False), (NOSYS, False), (SYS[:2], True), (SYS[:4], True), (NOSYS[:1], True),
                      (spaced, False)]:
        assert tok.apply_chat_template(msgs, add_generation_prompt=agp) == t.render_text(msgs, add_generation_prompt=agp)


def test_template_to_jinja_refuses_reasoning_templates():
    from backend.dataprep.templates import template_to_jinja
    with pytest.raises(NotImplementedError, match="qwen3"):
        template_to_jinja(get_template("qwen3"))
