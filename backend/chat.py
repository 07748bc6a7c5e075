"""Generation with a model (+ LoRA adapters) through the same template code as training.

`tuneboard chat` uses it as a terminal REPL or for one `--query`; the OpenAI-compatible server
(a later issue) builds on the same functions.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from backend.models import apply_finetuning, load_model, load_tokenizer, resolve_model
from backend.resolve import pick_template


@dataclass
class ChatModel:
    model: object
    tokenizer: object
    template: object


def load_chat_model(spec, warn=print) -> ChatModel:
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer, warn=warn)
    model = load_model(spec, resolved, for_training=False, warn=warn)
    if spec.adapter_name_or_path:  # merged into a full-precision base; kept separate on a 4/8-bit one
        model = apply_finetuning(model, spec, for_training=False, warn=warn)
    model.eval()
    return ChatModel(model, tokenizer, template)


def stop_token_ids(tokenizer, template) -> list[int]:
    """The template's end-of-turn strings that are single tokens, plus the tokenizer's eos."""
    ids = set()
    for word in getattr(template, "stop_words", []) or []:
        tokens = tokenizer(word, add_special_tokens=False).input_ids
        if len(tokens) == 1:
            ids.add(tokens[0])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def generate(chat: ChatModel, messages: list[dict], *, max_new_tokens=256, do_sample=False,
             temperature=0.95, top_p=0.7, top_k=50, repetition_penalty=1.0) -> str:
    import torch

    text = chat.template.render_text(messages, add_generation_prompt=True)
    inputs = chat.tokenizer(text, add_special_tokens=False, return_tensors="pt")
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, repetition_penalty=repetition_penalty,
                  eos_token_id=stop_token_ids(chat.tokenizer, chat.template),
                  pad_token_id=chat.tokenizer.pad_token_id)
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    with torch.no_grad():
        output = chat.model.generate(**inputs.to(chat.model.device), **kwargs)
    reply = chat.tokenizer.decode(output[0][inputs.input_ids.shape[1]:], skip_special_tokens=True)
    for word in getattr(chat.template, "stop_words", []) or []:
        reply = reply.split(word)[0]
    return reply.strip()


def main(spec, query: str | None = None) -> int:
    chat = load_chat_model(spec, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    sampling = dict(max_new_tokens=spec.max_new_tokens, do_sample=spec.do_sample, temperature=spec.temperature,
                    top_p=spec.top_p, top_k=spec.top_k, repetition_penalty=spec.repetition_penalty)
    system = [{"role": "system", "content": spec.default_system}] if spec.default_system else []
    if query is not None:
        print(generate(chat, system + [{"role": "user", "content": query}], **sampling))
        return 0
    history: list[dict] = []
    print("TuneBoard chat. Type 'clear' to start over, 'exit' to quit.")
    while True:
        try:
            text = input("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text == "exit":
            return 0
        if text == "clear":
            history = []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        reply = generate(chat, system + history, **sampling)
        history.append({"role": "assistant", "content": reply})
        print(f"Assistant: {reply}")
