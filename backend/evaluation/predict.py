"""Scoring on held-out rows: each row's prompt -> the model's answer (greedy unless the spec samples; batched
with left padding when asked), scored against the row's own answer (backend/core/metrics.py), one JSON line per row as
it goes; and the loss over the rows' answer tokens. A library module: `tuneboard eval` (backend.evaluation.evaluate), a
training stage's do_predict (backend.stages.base) and the task metric at each save (backend.evaluation.task_metric) call it."""
from __future__ import annotations

import json
import math
import statistics
import threading
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from backend.core import metrics
from backend.serving.batching import Batcher, Job
from backend.serving.engine import stop_token_ids
from backend.dataprep.preprocess import PaddingCollator


class EvalError(ValueError):
    pass


def split_prompt(example: dict) -> tuple[list[dict], str]:
    """(messages up to the last assistant turn, that turn's content = the reference)."""
    msgs = example["messages"]
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        raise EvalError(f"row {example.get('_row')} of {example.get('_source')}: no assistant turn to compare with")
    return msgs[:last], msgs[last]["content"]


def generation_kwargs(spec, tokenizer, template, stop=None, greedy: bool = False) -> dict:
    """model.generate() keywords from the spec's generation keys: greedy unless the spec sets do_sample itself
    (greedy=True: always one greedy beam); `stop()` -> a reason or None, asked at every generated token."""
    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), bool(stop and stop()), dtype=torch.bool)

    sample = spec.do_sample if "do_sample" in spec.model_fields_set and not greedy else False
    kwargs = dict(max_new_tokens=spec.max_new_tokens, do_sample=sample, eos_token_id=stop_token_ids(tokenizer, template),
                  pad_token_id=tokenizer.pad_token_id, repetition_penalty=spec.repetition_penalty,
                  num_beams=1 if greedy else spec.num_beams, use_cache=True,
                  stopping_criteria=StoppingCriteriaList([_Stop()]))
    if sample:
        kwargs.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
    return kwargs


class _Settled(StoppingCriteria):
    """Stops each row of a batch once `settled(its answer so far)` says no later token can change its score (the
    other rows go on); the answers decoded as generate()'s caller decodes them."""

    def __init__(self, tokenizer, width: int, settled):
        self.tokenizer, self.width, self.settled, self.done = tokenizer, width, settled, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        rows = [i for i in range(input_ids.shape[0]) if not self.done[i]]
        texts = self.tokenizer.batch_decode(input_ids[rows, self.width:], skip_special_tokens=True)
        for i, text in zip(rows, texts):
            self.done[i] = bool(self.settled(text))
        return self.done.clone()


class DecodeThreads(StoppingCriteria):
    """On the CPU, the decode steps' intra-op thread count, chosen by timing them; never stops a row.

    A decode step is ~1,500 small operators (each weight matrix times one token per row): with torch's intra-op
    threads on every core, each operator waits for all of them at its end. On cores other processes also use,
    that wait is a scheduler slice per operator: measured on the 2-core bench machine at load average ~6, a
    decode step of the default model (23 rows) took 2.2-3.3 s with 2 threads and 0.23-0.28 s with 1
    (bench/README.md, scoring). On idle cores 2 threads may be the faster. So the first steps after the prefill
    run PROBE timed steps with torch's setting, then PROBE with one thread (the first step of each not timed),
    and the rest of the call keeps the faster; the setting is torch's again when the call ends (restore()).
    The thread count changes how fast, not what: generate() is checked to give the same answers with it
    (tests/backend/test_task_metric.py)."""

    PROBE = 3

    def __init__(self, clock=time.perf_counter):
        self.threads = torch.get_num_threads()
        self.clock, self.calls, self.last, self.chosen = clock, 0, None, None
        self.timed: dict[int, list[float]] = {self.threads: [], 1: []}

    def _set(self, n: int) -> None:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def __call__(self, input_ids, scores, **kwargs):
        self.tick()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def tick(self) -> None:
        """After each decode step (the first call: after the prefill)."""
        now, call = self.clock(), self.calls
        self.calls += 1
        if self.chosen is None and self.threads > 1:
            probe = self.PROBE + 1  # steps per setting: the first after a switch (or the prefill) is not timed
            ran = self.threads if call <= probe else 1  # the setting the step that just ended ran with
            if call not in (0, 1, probe + 1):
                self.timed[ran].append(now - self.last)
            if call < probe:
                self._set(self.threads)
            elif call < 2 * probe:
                self._set(1)
            else:
                self.chosen = min((statistics.median(v), n) for n, v in self.timed.items() if v)[1]
                self._set(self.chosen)
        self.last = self.clock()

    def restore(self) -> None:
        self._set(self.threads)


def generate(model, tokenizer, template, prompts: list[str], kwargs: dict, settled=None,
             tune_threads: bool = True) -> list[str]:
    """One batch: the prompts left-padded into one generate() call (with the KV cache), each answer cut at the
    template's stop words. `settled(answer so far)` -> True once a row's answer can no longer change what it
    scores: that row stops there (backend.evaluation.task_metric.answer_settled). On the CPU the decode steps'
    thread count is chosen by timing (DecodeThreads; tune_threads=False keeps torch's)."""
    encoded = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=model.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=model.device)
    extra = [_Settled(tokenizer, width, settled)] if settled is not None else []
    threads = DecodeThreads() if tune_threads and input_ids.device.type == "cpu" else None
    if extra or threads:
        kwargs = dict(kwargs, stopping_criteria=StoppingCriteriaList(
            [*kwargs.get("stopping_criteria", []), *extra, *([threads] if threads else [])]))
    try:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
    finally:
        if threads:
            threads.restore()
    return [answer_text(tokenizer, template, row[width:]) for row in out]


def answer_text(tokenizer, template, ids) -> str:
    """A generated answer's text: decoded without special tokens, cut at the template's first stop word, stripped."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for word in template.stop_words:
        text = text.split(word)[0]
    return text.strip()


class _RowEnd:
    """A scoring row's end, for the batcher (backend.serving.batching.Job's `criteria`): `stop()` gave a reason,
    or `settled(its answer so far)` says no later token can change its score."""

    def __init__(self, tokenizer, prompt_len: int, settled=None, stop=None):
        self.tokenizer, self.prompt_len, self.settled, self.stop = tokenizer, prompt_len, settled, stop

    def ended(self) -> bool:
        return bool(self.stop and self.stop())

    def __call__(self, input_ids, scores=None, **kwargs):
        end = self.ended() or (self.settled is not None and bool(self.settled(
            self.tokenizer.decode(input_ids[0, self.prompt_len:], skip_special_tokens=True))))
        return torch.full((input_ids.shape[0],), end, dtype=torch.bool, device=input_ids.device)


def generate_rows(model, tokenizer, template, prompts: list[str], max_new_tokens: int, settled=None, stop=None,
                  max_batch: int = 16, repetition_penalty: float = 1.0, tune_threads: bool = True) -> list[str]:
    """Greedy answers to many prompts, decoded together as a continuous batch (backend.serving.batching.Batcher):
    each prompt is prefilled on its own (no left padding computed), then decoded in a batch of at most `max_batch`
    rows; a row leaves the batch the step it ends (end of turn, `settled`, max_new_tokens, `stop()`) and the next
    prompt takes its place. generate() instead computes every row of a call until its longest answer ends: one
    answer that runs on to the cap holds all the others' rows in every step. Each answer is the one the row gets
    alone (up to float rounding: tests/backend/test_task_metric.py), cut at the template's stop words as generate()
    cuts it. The caller checks `batchable(model)` (a plain full-attention cache); else generate()."""
    threads = DecodeThreads() if tune_threads and model.device.type == "cpu" else None
    batcher = Batcher(model, threading.Lock(), max_batch=max_batch, on_step=threads.tick if threads else None)
    eos = stop_token_ids(tokenizer, template)
    jobs = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        jobs.append(Job(ids=ids, state=None, activate=lambda: None, max_new_tokens=max_new_tokens, eos_ids=eos,
                        criteria=_RowEnd(tokenizer, len(ids), settled, stop), repetition_penalty=repetition_penalty))
    try:
        batcher.run_all(jobs)
    finally:
        batcher.close()
        if threads:
            threads.restore()
    return [answer_text(tokenizer, template, job.tokens) for job in jobs]


def predict(model, tokenizer, template, examples: list[dict], out_file: Path, spec, progress=None,
            stop=None, batch_size: int = 1, greedy: bool = False) -> dict:
    """Generate for every row (batch_size rows per generate() call), append one JSON line per row (flushed),
    return the corpus metrics. `stop()` -> a reason or None, asked at every generated token: once it answers,
    the batch being generated is dropped and the metrics cover the rows finished before it."""
    kwargs = generation_kwargs(spec, tokenizer, template, stop=stop, greedy=greedy)
    predictions, references = [], []
    with open(out_file, "w", encoding="utf-8") as f:
        for start in range(0, len(examples), batch_size):
            if stop and stop():
                break
            batch = examples[start:start + batch_size]
            pairs = [split_prompt(example) for example in batch]
            prompts = [template.render_text(msgs, example.get("tools"), add_generation_prompt=True)
                       for (msgs, _), example in zip(pairs, batch)]
            texts = generate(model, tokenizer, template, prompts, kwargs)
            if stop and stop():
                break  # cut short: not a real prediction
            for i, (example, prompt, (_, reference), text) in enumerate(zip(batch, prompts, pairs, texts), start):
                predictions.append(text)
                references.append(reference)
                row = {"index": i, "source": example.get("_source"), "row": example.get("_row"), "prompt": prompt,
                       "label": reference, "predict": text, **metrics.row_scores(text, reference)}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                if progress:
                    progress(i + 1, len(examples), row)
    return {f"predict_{k}" if k != "num_rows" else "predict_rows": v
            for k, v in metrics.compute(predictions, references).items()}


def eval_loss(model, rows: list[dict], tokenizer, batch_size: int) -> dict:
    """Mean cross-entropy over the trained tokens (token-weighted, not batch-weighted) and its perplexity."""
    collate = PaddingCollator(tokenizer)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = {k: v.to(model.device) for k, v in collate(rows[i:i + batch_size]).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            labels = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
            total += float(loss)
            count += int((labels != -100).sum())
    mean = total / max(count, 1)
    return {"eval_loss": mean, "perplexity": math.exp(min(mean, 700)), "eval_tokens": count}
