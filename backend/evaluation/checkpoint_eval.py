"""`tuneboard eval SPEC.yaml checkpoints=all` (or checkpoint-N,...,final) with adapter_name_or_path = a LoRA
training run folder: which checkpoint does best on the held-out rows.

Reads top to bottom: the adapters to evaluate (backend/core/checkpoint_pick.py: the complete checkpoint-N folders
and the final adapter) -> tokenizer/template -> the held-out rows (the eval command's own choice of rows) ->
the base model, loaded ONCE -> for each adapter: loaded onto the base with peft (load_adapter / set_adapter,
the previous one deleted), the eval loss and the prediction metrics of `tuneboard eval` (backend/evaluation/predict.py),
its predictions in output_dir/<name>/ -> CHECKPOINT_EVAL_FILE: one entry per adapter (checkpoint, step,
metrics) and the best per metric, rewritten after each adapter so the UI shows them as they come.
eval_results.json and generated_predictions.jsonl at the top of output_dir are the last adapter's (the final
one when evaluated), as a plain `tuneboard eval` of it would write them.
A full / freeze run (model_name_or_path = the run folder, finetuning_type full or freeze) has whole models as
checkpoints: each is loaded in turn as the model (the previous one released first), the rest is the same.

Progress in status.json: step = adapters done x rows + rows of the current one, total_steps = adapters x rows,
eta_s from the time per row so far, checkpoint = the one being evaluated. SIGINT, SIGTERM or a STOP file end
it at the next token: the adapters finished by then are reported (an adapter cut short is left out: its
metrics would cover fewer rows than the others'), status "aborted", exit 130.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from peft import PeftModel

from backend.evaluation import predict as prediction
from backend.training.callbacks import start_run
from backend.core.checkpoint_pick import CheckpointChoiceError, Choice, pick_for
from backend.core.methods import is_adapter
from backend.training.models import load_model, load_tokenizer, resolve_model
from backend.evaluation.predict import eval_loss
from backend.dataprep.preprocess import build_sft_dataset
from backend.dataprep.resolve import pick_template
from backend.core.rundir import (CHECKPOINT_EVAL_FILE, EVAL_RESULTS_FILE, PREDICTIONS_FILE, write_json_atomic)

LOWER_IS_BETTER = ("eval_loss", "perplexity")
NOT_COMPARED = ("eval_tokens", "predict_rows", "predict_json_rows", "step")


def best(entries: list[dict]) -> dict:
    """metric -> {"checkpoint", "step", "value"} of the entry that did best on it (lowest loss / perplexity,
    highest everything else); the earliest one on a tie."""
    out: dict = {}
    for entry in entries:
        for key, value in entry.items():
            if key in NOT_COMPARED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            held = out.get(key)
            better = held is None or (value < held["value"] if key in LOWER_IS_BETTER else value > held["value"])
            if better:
                out[key] = {"checkpoint": entry["checkpoint"], "step": entry.get("step"), "value": value}
    return out


def _swap(model, choice: Choice, index: int):
    """The base model with this adapter active and no other one loaded (the base itself is never reloaded)."""
    name = f"adapter_{index}"  # peft keys its layers by adapter name: no dots, no dashes
    if not isinstance(model, PeftModel):
        return PeftModel.from_pretrained(model, str(choice.folder), adapter_name=name)
    previous = model.active_adapter
    model.load_adapter(str(choice.folder), adapter_name=name)
    model.set_adapter(name)
    model.delete_adapter(previous)
    return model


def _load(spec, choice: Choice, warn):
    """A full / freeze run's checkpoint (or final weights) as the model: its own weights, the spec's settings."""
    return load_model(spec.model_copy(update={"model_name_or_path": str(choice.folder)}),
                      resolve_model(str(choice.folder)), for_training=False, warn=warn)


def report(spec, chosen: list[Choice], entries: list[dict], rows: int, stopped: str | None) -> dict:
    run = spec.adapter_name_or_path if is_adapter(spec.finetuning_type) else spec.model_name_or_path
    out = {"run": run, "model": spec.model_name_or_path, "rows": rows,
           "asked": [c.name for c in chosen], "checkpoints": entries, "best": best(entries)}
    if stopped:
        out["stopped"] = stopped
    return out


def run(spec, out: Path, examples_of) -> int:
    """Evaluate the run's checkpoints; return the exit code. Never raises. `examples_of(spec, log)`: the
    held-out rows (backend.evaluation.evaluate.eval_examples: the same rows a plain `tuneboard eval` scores)."""
    try:
        chosen = pick_for(spec)
    except CheckpointChoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if (out / CHECKPOINT_EVAL_FILE).exists() or (out / EVAL_RESULTS_FILE).exists():
        if not spec.overwrite_output_dir:
            print(f"error: output_dir {out} already holds an evaluation; pick another output_dir or set "
                  "overwrite_output_dir: true", file=sys.stderr)
            return 1
    parts = {"eval": spec.do_eval, "predict": spec.do_predict}
    if not any(parts.values()):
        parts = {"eval": True, "predict": True}
    run_dir, switch = start_run(out)
    stop = lambda: switch.reason  # noqa: E731
    entries: list[dict] = []
    try:
        resolved = resolve_model(spec.model_name_or_path)
        tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)
        template = pick_template(spec.template, resolved, tokenizer, warn=run_dir.warn,
                                 enable_thinking=spec.enable_thinking)
        adapters = is_adapter(spec.finetuning_type)  # else a full / freeze run: each checkpoint is a whole model
        run_dir.log(f"eval of {len(chosen)} " + (f"adapters of {spec.adapter_name_or_path} on model "
                    f"{spec.model_name_or_path}" if adapters else f"checkpoints of {spec.model_name_or_path}")
                    + f" ({', '.join(c.name for c in chosen)}), template {template.name}, output {out}")
        examples = examples_of(spec, log=run_dir.log)
        n = len(examples)
        loss_rows = build_sft_dataset(examples, template, tokenizer, spec.cutoff_len, log=run_dir.warn)[0] \
            if parts["eval"] else []
        model = load_model(spec, resolved, for_training=False, warn=run_dir.warn) if adapters else None
        total = len(chosen) * n
        run_dir.update_status(total_steps=total, step=0)
        started = time.time()

        def progress(done: int, checkpoint: str) -> None:
            elapsed = time.time() - started
            eta = elapsed / done * (total - done) if done else None
            run_dir.update_status(step=done, checkpoint=checkpoint, eta_s=None if eta is None else round(eta, 1))

        for i, choice in enumerate(chosen):
            if stop():
                break
            if adapters:
                model = _swap(model, choice, i).eval()
            else:
                model = None  # the previous checkpoint's weights go before the next ones load
                model = _load(spec, choice, run_dir.warn).eval()
            entry: dict = {"checkpoint": choice.name, "step": choice.step}
            run_dir.log(f"{choice.name} ({i + 1}/{len(chosen)}, step {choice.step}): {choice.folder}")
            if parts["eval"]:
                entry.update(eval_loss(model, loss_rows, tokenizer, spec.per_device_eval_batch_size))
            if parts["predict"]:
                (out / choice.name).mkdir(exist_ok=True)
                entry.update(prediction.predict(model, tokenizer, template, examples, out / choice.name / PREDICTIONS_FILE,
                                                spec, lambda k, _total, _row, i=i: progress(i * n + k, choice.name),
                                                stop=stop))
            if parts["predict"] and entry.get("predict_rows") != n:
                run_dir.log(f"{choice.name}: stopped before its last row; left out of the results")
                break
            progress((i + 1) * n, choice.name)
            entries.append(entry)
            run_dir.log(f"{choice.name}: " + ", ".join(f"{k}={v:.4g}" for k, v in entry.items()
                                                      if isinstance(v, float)))
            write_json_atomic(out / CHECKPOINT_EVAL_FILE, report(spec, chosen, entries, n, None))
        results = report(spec, chosen, entries, n, stop())
        write_json_atomic(out / CHECKPOINT_EVAL_FILE, results)
        if entries:  # the last adapter's results, where a plain tuneboard eval of it writes them
            last = entries[-1]
            write_json_atomic(out / EVAL_RESULTS_FILE, {"model": spec.model_name_or_path, "template": template.name,
                                                        "rows": n, **{k: v for k, v in last.items() if k != "step"}})
            if parts["predict"]:
                shutil.copyfile(out / last["checkpoint"] / PREDICTIONS_FILE, out / PREDICTIONS_FILE)
    except Exception as exc:  # noqa: BLE001 - the status says why
        return run_dir.fail(exc)
    for metric, held in results["best"].items():
        run_dir.log(f"best {metric}: {held['checkpoint']} ({held['value']:.4g})")
    run_dir.log(f"wrote {out / CHECKPOINT_EVAL_FILE}")
    figures = {"adapters_evaluated": len(entries)}
    if switch.reason:
        run_dir.log(f"stopped ({switch.reason}): the results cover the {len(entries)} adapters evaluated before it")
    return run_dir.end(switch.reason, final_metrics=figures)
