"""Step score: on the held-out pairs (chunks of documents never trained on), the student's answers (the base
model, and the tuned adapter) against the teacher's: JSON validity, schema validity, field F1, exact match, and
the student's generation speed (tokens/s) -> distill_report.json (+ scorecard_predictions.jsonl, one line
per row and model).

The per-row scores are backend.core.rewards' functions (json_valid, json_schema's schema_score, field_f1,
exact_match), the same ones GRPO rewards with, so "schema valid" here and a reward of 1.0 there agree.
Generation is greedy, through backend.serving.engine (the same engine as chat and the API).
"""
from __future__ import annotations

import json
import time

from backend.core import rewards
from backend.core.atomic import write_text_atomic
from backend.distill import PAIRS_FILE, REPORT_FILE, TRAIN_DIRNAME, DistillError, student_prompt
from backend.distill.spec import DistillSpec
from backend.serving.engine import load_engines
from backend.core.spec import validate_spec

PREDICTIONS_FILE = "scorecard_predictions.jsonl"


def held_out_pairs(spec: DistillSpec, limit: int) -> list[dict]:
    out = spec.resolved_output_dir()
    rows = []
    try:
        with open(out / PAIRS_FILE, encoding="utf-8") as fh:
            for line in fh:
                row = json.loads(line)
                if row.get("split") == "eval":
                    rows.append(row)
    except FileNotFoundError:
        pass
    return rows[:limit]


def row_scores(prediction: str, reference: str, schema: dict | None, answer_format: str = "json") -> dict:
    """One answer's scores in [0, 1]; the JSON ones only for answer_format json."""
    one = dict(prompts=[""], completions=[prediction], reference=[reference])
    row = {"exact_match": rewards.exact_match(**one)[0]}
    if answer_format != "json":
        return row
    row.update(json_valid=rewards.json_valid(**one)[0], field_f1=rewards.field_f1(**one)[0])
    if schema is not None:
        row["schema_valid"] = float(rewards.schema_score(prediction, schema) == 1.0)
    return row


def summarize(rows: list[dict], seconds: float, tokens: int) -> dict:
    def mean(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(sum(values) / len(values), 4) if values else None

    out = {"rows": len(rows), "json_valid": mean("json_valid"), "schema_valid": mean("schema_valid"),
           "field_f1": mean("field_f1"), "exact_match": mean("exact_match"), "generated_tokens": tokens,
           "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None}
    return {k: v for k, v in out.items() if v is not None}


def score(spec: DistillSpec, run_dir, stop) -> int:
    out = spec.resolved_output_dir()
    pairs = held_out_pairs(spec, spec.score_max_rows)
    if not pairs:
        raise DistillError("step score: no held-out pair (eval_ratio 0, a single document, or no eval chunk "
                           "accepted): nothing to score on")
    adapter = spec.adapter_name_or_path
    if not adapter and (out / TRAIN_DIRNAME / "adapter_config.json").is_file():
        adapter = str(out / TRAIN_DIRNAME)
    schema = spec.schema_dict()
    engine_spec = validate_spec({"model_name_or_path": spec.model_name_or_path, "template": spec.template,
                                 "do_sample": False, "max_new_tokens": spec.answer_tokens})
    engines = load_engines(engine_spec, [f"tuned={adapter}"] if adapter else [], include_base=True,
                           warn=run_dir.warn, log=run_dir.log)
    names = list(engines)
    labels = {names[0]: "base"}
    if adapter:
        labels[names[1]] = "tuned"
    run_dir.log(f"score: {len(pairs)} held-out pairs, student {spec.model_name_or_path}"
                + (f" base and tuned ({adapter})" if adapter else " (base only: no adapter)"))
    run_dir.update_status(total_steps=len(pairs) * len(names), step=0)
    results, lines, done = {}, [], 0
    for name in names:
        label = labels[name]
        rows, seconds, tokens = [], 0.0, 0
        for pair in pairs:
            if stop():
                return 130
            messages = [{"role": "user", "content": student_prompt(spec.task, pair["prompt"])}]
            t0 = time.perf_counter()
            reply = engines[name].chat(messages, max_new_tokens=spec.answer_tokens, do_sample=False)
            seconds += time.perf_counter() - t0
            tokens += reply.completion_tokens
            scores = row_scores(reply.text, pair["answer"], schema, spec.answer_format)
            rows.append(scores)
            lines.append({"model": label, "chunk": pair["chunk"], "document": pair["document"], "teacher": pair["answer"],
                          "student": reply.text, **scores})
            done += 1
            run_dir.update_status(step=done)
        results[label] = summarize(rows, seconds, tokens)
        run_dir.log(f"score {label}: " + ", ".join(f"{k} {v}" for k, v in results[label].items()))
    write_text_atomic(out / PREDICTIONS_FILE, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    report = {"student": spec.model_name_or_path, "adapter": adapter, "teacher": _teacher_name(spec),
              "dataset": spec.dataset_name, "rows": len(pairs), "answer_format": spec.answer_format, "schema": schema is not None, **results}
    write_text_atomic(out / REPORT_FILE, json.dumps(report, ensure_ascii=False, indent=1))
    run_dir.log(f"wrote {out / REPORT_FILE}")
    return 0


def _teacher_name(spec: DistillSpec) -> str:
    if spec.teacher == "local":
        return f"local {spec.teacher_local_model or spec.model_name_or_path}" + (
            f" + {spec.teacher_local_adapter}" if spec.teacher_local_adapter else "")
    return f"{spec.teacher_model} at {spec.teacher}"
