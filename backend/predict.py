"""Generation for evaluation: each held-out row's prompt -> the model's answer, scored against the row's own
answer (backend/metrics.py), one JSON line per row as it goes. A library module: `tuneboard eval`
(backend.evaluate) and a training stage's do_predict (backend.stages.base) both call it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from backend import metrics
from backend.engine import stop_token_ids


class EvalError(ValueError):
    pass


def split_prompt(example: dict) -> tuple[list[dict], str]:
    """(messages up to the last assistant turn, that turn's content = the reference)."""
    msgs = example["messages"]
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        raise EvalError(f"row {example.get('_row')} of {example.get('_source')}: no assistant turn to compare with")
    return msgs[:last], msgs[last]["content"]


def predict(model, tokenizer, template, examples: list[dict], out_file: Path, spec, progress=None,
            stop=None) -> dict:
    """Generate for every row, append one JSON line per row (flushed), return the corpus metrics.
    `stop()` -> a reason or None, asked at every generated token: once it answers, the row being generated
    is dropped and the metrics cover the rows finished before it."""
    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), bool(stop and stop()), dtype=torch.bool)

    stop_ids = stop_token_ids(tokenizer, template)
    sample = spec.do_sample if "do_sample" in spec.model_fields_set else False
    kwargs = dict(max_new_tokens=spec.max_new_tokens, do_sample=sample, eos_token_id=stop_ids,
                  pad_token_id=tokenizer.pad_token_id, repetition_penalty=spec.repetition_penalty,
                  num_beams=spec.num_beams, stopping_criteria=StoppingCriteriaList([_Stop()]))
    if sample:
        kwargs.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
    predictions, references = [], []
    with open(out_file, "w", encoding="utf-8") as f:
        for n, example in enumerate(examples, 1):
            if stop and stop():
                break
            prompt_msgs, reference = split_prompt(example)
            prompt = template.render_text(prompt_msgs, example.get("tools"), add_generation_prompt=True)
            ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to(model.device)
            with torch.no_grad():
                out = model.generate(**ids, **kwargs)
            if stop and stop():
                break  # cut short: not a real prediction
            text = tokenizer.decode(out[0][ids.input_ids.shape[1]:], skip_special_tokens=True)
            for word in template.stop_words:
                text = text.split(word)[0]
            text = text.strip()
            predictions.append(text)
            references.append(reference)
            row = {"index": n - 1, "source": example.get("_source"), "row": example.get("_row"), "prompt": prompt,
                   "label": reference, "predict": text, **metrics.row_scores(text, reference)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            if progress:
                progress(n, len(examples), row)
    return {f"predict_{k}" if k != "num_rows" else "predict_rows": v
            for k, v in metrics.compute(predictions, references).items()}
