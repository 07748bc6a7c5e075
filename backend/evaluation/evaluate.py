"""`tuneboard eval SPEC.yaml [key=value ...]`: how a model (+ adapter) does on held-out data.

Reads top to bottom: tokenizer/template -> rows (eval_dataset, else the val_size split of dataset, else
dataset) -> model (+adapter) -> eval loss / perplexity over the trained (assistant) tokens -> generation
on each row's prompt, one line per row to generated_predictions.jsonl as it goes -> metrics
(backend/core/metrics.py) -> eval_results.json.

Like a training run it writes into output_dir the files the UI already tails: status.json (step = rows
predicted so far) and running_log.txt, and it stops like one: SIGINT, SIGTERM or a STOP file end the
generation at the next token; the rows finished by then keep their predictions and are scored
(eval_results.json says `stopped`), status "aborted", exit 130. `do_eval` / `do_predict` pick the parts; with neither set, both run.
Generation is greedy unless the spec sets do_sample itself (the spec default samples, which makes
scores noisy).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from backend.evaluation import checkpoint_eval
from backend.evaluation import judge_eval
from backend.evaluation import benchmarks
from backend.evaluation import predict as prediction  # prediction.predict looked up at call time (tests wrap it)
from backend.training.callbacks import start_run
from backend.dataprep.data import load_examples, split_train_val
from backend.training.adapters import apply_finetuning
from backend.training.models import load_model, load_tokenizer, resolve_model
from backend.evaluation.predict import EvalError, eval_loss, predict, split_prompt  # noqa: F401  (public here as before)
from backend.dataprep.preprocess import build_sft_dataset
from backend.dataprep.resolve import pick_template
from backend.evaluation.reward_score import encode_pairs, load_reward_model, pair_metrics, score_pairs, write_scores
from backend.core.rundir import (EVAL_RESULTS_FILE, JUDGE_FILE, PREDICTIONS_FILE, RUNNING_LOG, STATUS_FILE,  # noqa: F401  (public here)
                            CHECKPOINT_COMPLETE_MARKER, LOG_FILE, PHASE_PREDICTING, PHASE_TRAINING, SPEC_FILE, RunDir,
                            checkpoints, default_output_dir, last_value, read_status, write_json_atomic)
from backend.distill import SPEC_FILE as DISTILL_SPEC_FILE
from backend.core.eval_rules import eval_command_errors
from backend.core.spec import RunSpec, SpecError, load_or_report, parse_overrides, split_spec_args
from backend.stages import get_stage

RESULTS_FILE = EVAL_RESULTS_FILE


def eval_output_dir(spec) -> Path:
    if spec.output_dir:
        return Path(spec.output_dir).expanduser().resolve()
    return default_output_dir(spec.model_name_or_path, "eval")


def training_run_marks(out: Path) -> list[str]:
    """What shows that `out` holds a training (or distill) run: its spec file, the Trainer's state, checkpoint-N
    folders, losses in trainer_log.jsonl, a status.json that went through the training phase. An eval writes
    status.json, running_log.txt and trainer_log.jsonl into its output_dir, so it must never write into such a
    folder (the run's final status and metrics would be gone, its log mixed with the eval's). An eval's own
    folder has none of these (its trainer_log.jsonl lines carry eval_loss only)."""
    if not out.is_dir():
        return []
    marks = [name for name in (SPEC_FILE, DISTILL_SPEC_FILE, CHECKPOINT_COMPLETE_MARKER) if (out / name).exists()]
    found = checkpoints(out)
    if found:
        marks.append(found[0].name + (f" ... {found[-1].name}" if len(found) > 1 else ""))
    if last_value(out / LOG_FILE, "loss") is not None:
        marks.append(f"training losses in {LOG_FILE}")
    if PHASE_TRAINING in (read_status(out).get("phase_started") or {}):
        marks.append(f"a training {STATUS_FILE}")
    return marks


def refuse_training_run(spec, out: Path) -> bool:
    """Print the one-line refusal and return True when output_dir holds a training run (training_run_marks);
    overwrite_output_dir does not lift it: an eval never replaces a run's records."""
    marks = training_run_marks(out)
    if not marks:
        return False
    default = default_output_dir(spec.model_name_or_path, "eval")
    print(f"error: output_dir {out} holds a training run ({', '.join(marks[:2])}): an eval writes its own "
          f"{STATUS_FILE}, {RUNNING_LOG} and {LOG_FILE} there and would overwrite the run's; leave output_dir out "
          f"(the eval then goes to {default.parent}/<time stamp>) or give another folder", file=sys.stderr)
    return True


def _holds_out_all(val_size: float, rows: int) -> bool:
    """val_size (a share below 1, rounded up, or a count) takes every row (backend.dataprep.data.split_train_val)."""
    return (math.ceil(val_size * rows) if val_size < 1 else val_size) >= rows


def eval_examples(spec, log=print, stage: str = "sft") -> list[dict]:
    """The rows to evaluate: eval_dataset; else the validation split of dataset (same seed as training, so
    the same rows training held out; all of them where val_size takes every row); else all of dataset."""
    common = dict(stage=stage, max_samples=spec.max_samples, identity_name=spec.identity_name,
                  identity_author=spec.identity_author, seed=spec.seed, default_system=spec.default_system,
                  mix_strategy=spec.mix_strategy, interleave_probs=spec.interleave_probs)
    if spec.eval_dataset:
        examples, report = load_examples(spec.eval_dataset, spec.resolved_dataset_dir(), **common)
    elif spec.dataset:
        examples, report = load_examples(spec.dataset, spec.resolved_dataset_dir(), **common)
        if spec.val_size and _holds_out_all(spec.val_size, len(examples)):
            # eval needs the held-out rows only: a val_size that leaves a training run no rows holds out all of them
            log(f"val_size {spec.val_size:g} holds out all {len(examples)} usable rows (a training run would have "
                "none left): every row is evaluated")
        elif spec.val_size:
            examples = split_train_val(examples, spec.val_size, spec.seed)[1]
    else:
        raise EvalError("eval needs eval_dataset or dataset")
    for line in report.summary_lines():
        log(line)
    if not examples:
        raise EvalError("no rows to evaluate")
    return examples


def reward_eval(spec, resolved, template, out: Path, run_dir, stop=None) -> dict:
    """stage rm: a reward model (model_name_or_path, + adapter_name_or_path: the output_dir of an rm run) on
    held-out pairs: pairwise accuracy (chosen scored above rejected), mean margin and mean scores, as the
    training run's eval_ metrics name them, and one line per pair in generated_predictions.jsonl."""
    model, tokenizer = load_reward_model(spec, resolved, warn=run_dir.warn)
    examples = eval_examples(spec, log=run_dir.log, stage=spec.stage)
    pairs = encode_pairs(examples, template, tokenizer, spec.cutoff_len, log=run_dir.warn)
    if not pairs:
        raise EvalError("no held-out pair could be encoded (see the warnings above)")
    run_dir.log(f"scoring {len(pairs)} pairs with the reward model")
    run_dir.update_status(total_steps=len(pairs))
    scores = score_pairs(model, tokenizer, [row for _, row in pairs], spec.per_device_eval_batch_size, stop=stop,
                         progress=lambda n: run_dir.update_status(step=n))
    write_scores(out / PREDICTIONS_FILE, [example for example, _ in pairs], scores)
    metrics = pair_metrics(scores)
    run_dir.log(f"pairwise accuracy {metrics['accuracy']:.3f}, mean margin {metrics['margin']:.4f} "
                f"over {metrics['pairs']} pairs")
    return {"model": spec.model_name_or_path, "adapter": spec.adapter_name_or_path, "template": template.name,
            "rows": len(examples), **{f"eval_{k}": v for k, v in metrics.items()}}


def run(spec) -> int:
    """Evaluate; return the exit code. Never raises."""
    parts = {"eval": spec.do_eval, "predict": spec.do_predict, "judge": spec.do_judge}
    if not any(parts.values()):
        parts = {"eval": True, "predict": True, "judge": False}
    out = eval_output_dir(spec)
    if refuse_training_run(spec, out):  # before any mode (benchmarks, checkpoints, the parts) writes its status
        return 1
    if spec.tasks:  # lm-evaluation-harness benchmarks, base and tuned (backend/evaluation/benchmarks.py), instead of the parts
        return benchmarks.run(spec, out)
    if spec.checkpoints:  # each checkpoint of a training run on the same rows (backend/evaluation/checkpoint_eval.py)
        return checkpoint_eval.run(spec, out, eval_examples)
    if any((out / name).exists() for name in (PREDICTIONS_FILE, RESULTS_FILE, JUDGE_FILE)):
        if not spec.overwrite_output_dir:
            print(f"error: output_dir {out} already holds an evaluation; pick another output_dir or set "
                  "overwrite_output_dir: true", file=sys.stderr)
            return 1
    run_dir, switch = start_run(out)
    started = time.time()
    try:
        resolved = resolve_model(spec.model_name_or_path)
        tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)
        template = pick_template(spec.template, resolved, tokenizer, warn=run_dir.warn,
                                 enable_thinking=spec.enable_thinking)
        run_dir.log(f"eval: model {spec.model_name_or_path}"
                    + (f" + adapter {spec.adapter_name_or_path}" if spec.adapter_name_or_path else "")
                    + f", template {template.name}, output {out}")
        if get_stage(spec.stage).is_reward_model:  # scores of held-out pairs instead of loss and generation
            parts = {"eval": True, "predict": True}
            results = reward_eval(spec, resolved, template, out, run_dir, stop=lambda: switch.reason)
            if switch.reason:
                results["stopped"] = switch.reason
            results["seconds"] = round(time.time() - started, 1)
            write_json_atomic(out / RESULTS_FILE, results)
            return _finished(run_dir, out, results, parts, switch)
        examples = eval_examples(spec, log=run_dir.log)
        run_dir.log(f"{len(examples)} rows; parts: {', '.join(k for k, v in parts.items() if v)}")
        model = load_model(spec, resolved, for_training=False, warn=run_dir.warn)
        base_answers = None
        if parts["judge"] and spec.judge_against == "base":  # before the adapter is merged into the model
            base_answers = judge_eval.answers(model.eval(), tokenizer, template, examples, spec, out, "base", run_dir,
                                              stop=lambda: switch.reason)
        if spec.adapter_name_or_path:
            model = apply_finetuning(model, spec, for_training=False, warn=run_dir.warn)
        model.eval()
        results: dict = {"model": spec.model_name_or_path, "adapter": spec.adapter_name_or_path,
                         "template": template.name, "rows": len(examples)}
        if parts["eval"]:
            rows, stats = build_sft_dataset(examples, template, tokenizer, spec.cutoff_len, log=run_dir.warn)
            results.update(eval_loss(model, rows, tokenizer, spec.per_device_eval_batch_size))
            run_dir.log(f"eval_loss {results['eval_loss']:.4f}, perplexity {results['perplexity']:.3f} "
                        f"over {results['eval_tokens']} tokens")
            run_dir.append_metrics({"step": 0, "eval_loss": results["eval_loss"]})
        if parts["predict"]:
            run_dir.set_phase(PHASE_PREDICTING, total_steps=len(examples), step=0)

            def progress(n, total, row):
                run_dir.update_status(step=n)
                run_dir.log(f"predict {n}/{total}: rouge-l {row['rouge-l']:.1f}, bleu-4 {row['bleu-4']:.1f}")

            results.update(prediction.predict(model, tokenizer, template, examples, out / PREDICTIONS_FILE, spec, progress,
                                   stop=lambda: switch.reason))
        if parts["judge"] and not switch.reason:
            tuned = judge_eval.answers(model, tokenizer, template, examples, spec, out, "tuned", run_dir,
                                       stop=lambda: switch.reason)
            other = base_answers if base_answers is not None else [split_prompt(e)[1] for e in examples]
            results.update(judge_eval.judge(spec, examples, tuned, other, out, run_dir, stop=lambda: switch.reason))
        if switch.reason:
            results["stopped"] = switch.reason
        results["seconds"] = round(time.time() - started, 1)
        write_json_atomic(out / RESULTS_FILE, results)
        if results.get("judge_error"):  # the answers and the rows judged are written; the run failed
            raise judge_eval.JudgeFatal(results["judge_error"])
    except Exception as exc:  # noqa: BLE001 - the status says why
        return run_dir.fail(exc)
    return _finished(run_dir, out, results, parts, switch)


def _finished(run_dir, out: Path, results: dict, parts: dict, switch) -> int:
    """Log the results, write the final status, return the exit code."""
    figures = {k: v for k, v in results.items() if isinstance(v, (int, float))}
    run_dir.log("results: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    run_dir.log(f"wrote {out / RESULTS_FILE}" + (f" and {out / PREDICTIONS_FILE}" if parts["predict"] else ""))
    if switch.reason:
        if "eval_pairs" in results:
            run_dir.log(f"stopped ({switch.reason}): the results cover the {results['eval_pairs']} pairs scored "
                        "before the stop")
        else:
            run_dir.log(f"stopped ({switch.reason}): the results cover the {results.get('predict_rows', 0)} rows "
                        "predicted before the stop")
    return run_dir.end(switch.reason, final_metrics=figures)


def main(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print("usage: tuneboard eval SPEC.yaml [key=value ...]\n\n"
              "keys: model_name_or_path, adapter_name_or_path, template, eval_dataset (else the val_size split of "
              "dataset, else dataset), max_samples, output_dir, do_eval (loss/perplexity), do_predict (generation + "
              "BLEU/ROUGE/JSON metrics; neither = both), max_new_tokens, do_sample, per_device_eval_batch_size\n"
              "tasks: lm-eval benchmarks instead (task names and/or task YAML paths, comma-separated; num_fewshot, "
              f"limit): the base and the adapter side by side in output_dir/{benchmarks.LM_EVAL_FILE}\n"
              "do_judge: an LLM judge compares the tuned and the base model's greedy answers (judge_url, judge_model, "
              "judge_api_key_env or judge_api_key_file, judge_max_requests, judge_against base|reference)\n"
              "checkpoints: all or checkpoint-N,...,final with adapter_name_or_path = a training run folder: each on "
              f"the same rows, the base loaded once; output_dir/{checkpoint_eval.CHECKPOINT_EVAL_FILE}\n"
              f"writes output_dir/{RESULTS_FILE}, {PREDICTIONS_FILE} (one line per row, as it goes), {STATUS_FILE}, "
              f"{RUNNING_LOG}; do_judge: {JUDGE_FILE}")
        return 0 if args else 2
    path, overrides = split_spec_args(args)
    try:  # an option (`--bogus`) or a broken override: load_or_report says what is wrong
        given = {} if path and path.startswith("-") and not Path(path).exists() else parse_overrides(overrides)
    except SpecError:
        given = {}
    for key, message in eval_command_errors(given, RunSpec.model_fields)[:1]:
        print(f"error: {key}: {message}", file=sys.stderr)
        return 1
    spec = load_or_report(args)
    if spec is None:
        return 1
    return run(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
