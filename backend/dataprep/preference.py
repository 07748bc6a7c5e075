"""Preference rows: ranking examples -> {prompt_ids, chosen_ids, rejected_ids}; KTO examples ->
{prompt_ids, completion_ids, label}. The token format TRL's DPO, reward and KTO trainers take.

Why our own encoding and not TRL's: the prompt and each answer are rendered by our templates (exact,
tested string-for-string) and tokenized once, like SFT rows, so a DPO run trains on exactly the tokens
SFT and chat use. The answer span is the template's trained span of the last assistant turn (its
end-of-turn token included), the prompt is everything before it.

Truncation keeps the answers, as SFT does: when prompt + the longer answer exceed cutoff_len, the
prompt loses its oldest tokens first (down to half of cutoff_len), then the answers are cut at the end.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from backend.dataprep.preprocess import IGNORE_INDEX, Stats, _finish, _row_name, encode_example, in_workers


def _split_answer(example: dict, answer: dict, template, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of the conversation followed by `answer`, untruncated."""
    conversation = dict(example, messages=list(example["messages"]) + [answer])
    enc = encode_example(conversation, template, tokenizer, None, mask_history=True)
    trained = [i for i, label in enumerate(enc.labels) if label != IGNORE_INDEX]
    if not trained:
        raise ValueError(f"{_row_name(example)}: the template trains no token of the answer")
    return enc.input_ids[:trained[0]], enc.input_ids[trained[0]:trained[-1] + 1]


def _fit(prompt: list[int], answers: list[list[int]], cutoff_len: int | None) -> tuple[list[int], list[list[int]], bool]:
    """Cut prompt (oldest tokens first) and answers (at the end) so prompt + each answer <= cutoff_len."""
    longest = max(len(a) for a in answers)
    if cutoff_len is None or len(prompt) + longest <= cutoff_len:
        return prompt, answers, False
    keep_prompt = max(cutoff_len - longest, min(len(prompt), cutoff_len // 2))
    prompt = prompt[len(prompt) - keep_prompt:] if keep_prompt else []
    room = cutoff_len - len(prompt)
    return prompt, [a[:room] for a in answers], True


def scored_ids(example: dict, completion: str, template, tokenizer, cutoff_len: int | None) -> list[int] | None:
    """The token ids a reward model scores for `completion` as the assistant's answer to the row's conversation:
    rendered and cut to cutoff_len as an rm run cuts its pairs; None where the template trains no answer token.
    (The reward model in process, backend.evaluation.reward_score, and through an endpoint, reward_api.)"""
    try:
        prompt, answer = _split_answer(example, {"role": "assistant", "content": completion}, template, tokenizer)
    except ValueError:
        return None
    prompt, (answer,), _ = _fit(prompt, [answer], cutoff_len)
    return prompt + answer


def _common_prompt(pairs: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[list[int]]]:
    """One prompt for several answers: their shared prefix; whatever differs after it joins each answer."""
    prompts = [p for p, _ in pairs]
    n = min(len(p) for p in prompts)
    k = next((i for i in range(n) if len({p[i] for p in prompts}) > 1), n)
    return prompts[0][:k], [p[k:] + a for p, a in pairs]


def _encode_all(examples: list[dict], encode_one: Callable[[dict], tuple[dict, bool, int, int]],
                cutoff_len: int | None) -> tuple[list[dict], Stats]:
    stats = Stats(cutoff_len=cutoff_len)
    rows = []
    for example in examples:
        stats.rows_in += 1
        try:
            row, truncated, total, trained = encode_one(example)
        except ValueError as exc:  # one bad row must not end the run; all bad -> error in _finish
            stats.failed += 1
            if len(stats.failed_reasons) < Stats.MAX_IDS:
                stats.failed_reasons.append(str(exc))
            continue
        stats.truncated += truncated
        if truncated and len(stats.truncated_ids) < Stats.MAX_IDS:
            stats.truncated_ids.append(_row_name(example))
        stats.total_tokens += total
        stats.trained_tokens += trained
        rows.append(row)
    return rows, stats


def _pair_rows(examples: list[dict], template, tokenizer, cutoff_len: int | None) -> tuple[list[dict], Stats]:
    def encode_one(example: dict):
        pairs = [_split_answer(example, example[key], template, tokenizer) for key in ("chosen", "rejected")]
        prompt, answers = _common_prompt(pairs)
        prompt, (chosen, rejected), truncated = _fit(prompt, answers, cutoff_len)
        if chosen == rejected:
            raise ValueError(f"{_row_name(example)}: chosen and rejected are the same tokens after truncation")
        total = 2 * len(prompt) + len(chosen) + len(rejected)
        return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}, truncated, total, \
            len(chosen) + len(rejected)

    return _encode_all(examples, encode_one, cutoff_len)


def _kto_rows(examples: list[dict], template, tokenizer, cutoff_len: int | None) -> tuple[list[dict], Stats]:
    def encode_one(example: dict):
        if example.get("kto_tag") is None:
            raise ValueError(f"{_row_name(example)}: no kto_tag (true = desirable, false = undesirable)")
        messages = list(example["messages"])
        answer = messages.pop()
        prompt, completion = _split_answer(dict(example, messages=messages), answer, template, tokenizer)
        prompt, (completion,), truncated = _fit(prompt, [completion], cutoff_len)
        row = {"prompt_ids": prompt, "completion_ids": completion, "label": bool(example["kto_tag"])}
        return row, truncated, len(prompt) + len(completion), len(completion)

    return _encode_all(examples, encode_one, cutoff_len)


def build_preference_dataset(examples: Iterable[dict], template, tokenizer, cutoff_len: int | None, *,
                             log: Callable[[str], Any] | None = None,
                             num_workers: int | None = None) -> tuple[list[dict], Stats]:
    """Ranking examples (messages ending with the user's turn, chosen, rejected) -> rows
    {prompt_ids, chosen_ids, rejected_ids}, plus Stats (tokens counted over both sequences).
    num_workers > 1 tokenizes in that many processes (preprocessing_num_workers): the same rows."""
    rows, stats = in_workers(_pair_rows, list(examples), num_workers, template=template, tokenizer=tokenizer,
                             cutoff_len=cutoff_len)
    return _finish(rows, stats, log, "preference")


def build_kto_dataset(examples: Iterable[dict], template, tokenizer, cutoff_len: int | None, *,
                      log: Callable[[str], Any] | None = None,
                      num_workers: int | None = None) -> tuple[list[dict], Stats]:
    """KTO examples (a conversation ending with the assistant's answer, kto_tag true/false) -> rows
    {prompt_ids, completion_ids, label}. num_workers as for build_preference_dataset."""
    rows, stats = in_workers(_kto_rows, list(examples), num_workers, template=template, tokenizer=tokenizer,
                             cutoff_len=cutoff_len)
    return _finish(rows, stats, log, "kto")
