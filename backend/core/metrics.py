"""Generation metrics for Evaluate & Predict: BLEU-4, ROUGE-1/2/L, exact match, and for JSON outputs
(the extraction use case) valid-JSON rate and field-level precision / recall / F1.

Why these packages: sacrebleu (the reference BLEU implementation) and rouge-score (Google's
re-implementation of ROUGE-1.5.5) are well kept and pure Python. rouge-score's default tokenizer drops
every non-ASCII character, so we give it ours: lower-cased words, and CJK characters one by one (as
LLaMA-Factory's jieba/character split does for Chinese). BLEU uses sacrebleu's 13a tokenizer, or its
`zh` tokenizer when the references hold CJK text. Scores are on a 0-100 scale.
"""
from __future__ import annotations

import json
import re
from typing import Any

# eval_metric, the task metric scored at each checkpoint save (backend/evaluation/task_metric.py): what this module computes,
# schema_valid (backend.core.rewards' json_schema), the loss over the held-out answers, or a judge's win rate
TASK_METRICS = ("json_field_f1", "json_valid", "schema_valid", "exact_match", "bleu", "rouge_l", "eval_loss", "judge")
LOWER_IS_BETTER = ("eval_loss",)


def task_log_key(metric: str) -> str:
    """The trainer_log.jsonl key of a task metric: eval_<metric> (eval_loss stays eval_loss)."""
    return metric if metric.startswith("eval_") else f"eval_{metric}"


_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN = re.compile(f"[{_CJK}]|[^\\W_{_CJK}]+")
_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.S)


def words(text: str) -> list[str]:
    """Lower-cased word tokens; CJK characters are one token each; punctuation is dropped."""
    return _TOKEN.findall(text.lower())


class _Tokenizer:
    """The tokenizer interface rouge-score expects."""

    def tokenize(self, text: str) -> list[str]:
        return words(text)


def rouge(predictions: list[str], references: list[str]) -> list[dict[str, float]]:
    """Per-row ROUGE-1/2/L F-measures (0-100)."""
    from rouge_score import rouge_scorer  # heavy: loaded on use, so importing this module stays light

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], tokenizer=_Tokenizer())
    out = []
    for pred, ref in zip(predictions, references):
        s = scorer.score(ref, pred)
        out.append({"rouge-1": 100 * s["rouge1"].fmeasure, "rouge-2": 100 * s["rouge2"].fmeasure,
                    "rouge-l": 100 * s["rougeL"].fmeasure})
    return out


def _bleu_tokenize(references: list[str]) -> str:
    return "zh" if any(re.search(f"[{_CJK}]", r) for r in references) else "13a"


def corpus_bleu(predictions: list[str], references: list[str]) -> float:
    """Corpus BLEU-4 (sacrebleu defaults: brevity penalty, no smoothing)."""
    import sacrebleu  # heavy: loaded on use, so importing this module stays light

    return float(sacrebleu.corpus_bleu(predictions, [references], tokenize=_bleu_tokenize(references)).score)


def sentence_bleu(prediction: str, reference: str) -> float:
    """One row's BLEU-4 (sacrebleu's exponential smoothing), for the per-row table."""
    import sacrebleu  # heavy: loaded on use, so importing this module stays light

    return float(sacrebleu.sentence_bleu(prediction, [reference], tokenize=_bleu_tokenize([reference])).score)


def exact_match(prediction: str, reference: str) -> bool:
    return prediction.strip() == reference.strip()


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def parse_json(text: str) -> tuple[bool, Any]:
    """(valid, value) for a model output, allowing a ```json fence around it. Valid = the text parses as JSON
    (RFC 8259: any value, an object, a list or a scalar; NaN and Infinity, which Python's json module takes, are
    not JSON). Whether it is the object the reference is, is field F1's question (field_counts)."""
    m = _FENCE.match(text)
    if m:
        text = m.group(1)
    try:
        return True, json.loads(text, parse_constant=_not_json)
    except (ValueError, TypeError):
        return False, None


FieldPath = tuple  # a field's path: the keys (str) and list indices (int) from the top, e.g. ("colors", 0)


def flatten(value: Any, prefix: FieldPath = ()) -> dict[FieldPath, Any]:
    """The fields of a JSON value by path: its leaves, and its empty objects and lists (a field too, so an empty
    one is matched or missed like any other): {"a": {"b": 1}, "c": [2], "d": []} -> {("a", "b"): 1, ("c", 0): 2,
    ("d",): []}. A path is a tuple of keys and indices, so {"a.b": 1} and {"a": {"b": 1}} have different fields."""
    if isinstance(value, dict) and value:
        out: dict[FieldPath, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, (*prefix, str(k))))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, (*prefix, i)))
        return out
    return {prefix: value}


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().casefold() == b.strip().casefold()
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def field_counts(prediction: str, reference: str) -> dict[str, int] | None:
    """{"valid", "matched", "predicted", "expected"} field counts (flatten: leaves and empty containers) for one row;
    None if the reference is not a JSON object or list (the row does not count for the JSON metrics)."""
    ref_ok, ref = parse_json(reference)
    if not ref_ok or not isinstance(ref, (dict, list)):
        return None
    pred_ok, pred = parse_json(prediction)
    expected = flatten(ref)
    predicted = flatten(pred) if pred_ok else {}
    matched = sum(1 for path, v in predicted.items() if path in expected and _same_leaf(v, expected[path]))
    return {"valid": int(pred_ok), "matched": matched, "predicted": len(predicted), "expected": len(expected)}


def row_scores(prediction: str, reference: str) -> dict[str, Any]:
    """The per-row figures written next to each prediction."""
    row: dict[str, Any] = {"bleu-4": sentence_bleu(prediction, reference), **rouge([prediction], [reference])[0],
                           "exact_match": exact_match(prediction, reference)}
    counts = field_counts(prediction, reference)
    if counts is not None:
        p = counts["matched"] / counts["predicted"] if counts["predicted"] else 0.0
        r = counts["matched"] / counts["expected"] if counts["expected"] else 0.0
        row.update(json_valid=bool(counts["valid"]), field_f1=100 * (2 * p * r / (p + r) if p + r else 0.0))
    return row


def compute(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus figures (0-100): bleu-4, rouge-1/2/l (row means), exact_match; with JSON references also
    json_valid (% of those rows whose answer parses as JSON: parse_json), json_field_precision/recall/f1 (micro
    over the fields of flatten)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    n = len(predictions)
    if n == 0:
        return {"num_rows": 0}
    rows = rouge(predictions, references)
    out = {"num_rows": n, "bleu-4": corpus_bleu(predictions, references)}
    for key in ("rouge-1", "rouge-2", "rouge-l"):
        out[key] = sum(r[key] for r in rows) / n
    out["exact_match"] = 100 * sum(exact_match(p, r) for p, r in zip(predictions, references)) / n
    counts = [c for c in (field_counts(p, r) for p, r in zip(predictions, references)) if c is not None]
    if counts:
        matched = sum(c["matched"] for c in counts)
        predicted = sum(c["predicted"] for c in counts)
        expected = sum(c["expected"] for c in counts)
        precision = matched / predicted if predicted else 0.0
        recall = matched / expected if expected else 0.0
        out.update({
            "json_rows": len(counts),
            "json_valid": 100 * sum(c["valid"] for c in counts) / len(counts),
            "json_field_precision": 100 * precision,
            "json_field_recall": 100 * recall,
            "json_field_f1": 100 * (2 * precision * recall / (precision + recall) if precision + recall else 0.0),
        })
    return out
