"""The steps every training stage shares: rows, batching, the trainable model, TrainingArguments, and
`fit()` (the Trainer with our logging callback, resume, save, plot).

Stage modules (backend/stages/<id>.py) import these; backend.training.train (the run life cycle) imports the
stage modules, never the other way round. The top of this module stays light (no torch, transformers,
datasets): backend.training.train imports it at its own top and has written the run's status before the heavy stack
loads; the functions import that stack where they need it.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from backend.core import paths
from backend.training import probe
from backend.core.checkpointing import checkpoint_kwargs, described, given_by_spec
from backend.core.curves import loss_summary
from backend.core.launch import fsdp_training_arguments, read_accelerate_config, resolve_config, world_size
from backend.core.methods import method
from backend.core.trackers import point_trackers_at, tracker_names
from backend.training.plot import plot_loss
from backend.dataprep.preprocess import PackedCollator, PaddingCollator, PaddingFreeCollator, pack_rows
from backend.dataprep.resolve import pick_template
from backend.core.atomic import read_json_dict, write_text_atomic
from backend.core.rundir import (CHECKPOINT_COMPLETE_MARKER, LOG_FILE, PREDICTIONS_FILE, ResumeError, RunDir,
                            checkpoint_step, resume_choice)
from backend.stages import get_stage


@dataclass
class StageResult:
    stopped: bool = False
    metrics: dict = field(default_factory=dict)


class RunError(RuntimeError):
    """A problem with the run's inputs, reported as one clear line (no traceback in the status)."""


class CheckpointSaveError(RuntimeError):
    """Writing checkpoint-N failed (disk full, ...): the cause is chained; the partial folder is gone."""

    def __init__(self, checkpoint: str, cause: BaseException):
        super().__init__(f"could not save {checkpoint}: {type(cause).__name__}: {cause}")
        self.checkpoint = checkpoint


STAGING_PREFIX = ".saving-"  # out/.saving-N/checkpoint-N while the Trainer writes it; then renamed into place


def remove_staged_checkpoints(out: Path, log=print) -> None:
    """Drop staging folders a killed save left behind (never a checkpoint: it was not renamed into place)."""
    for stale in Path(out).glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
        log(f"removed {stale.name}, an unfinished checkpoint save of an earlier process")


def save_checkpoints_atomically(trainer) -> None:
    """Make the Trainer's checkpoint-N folders complete or absent: each is written into out/.saving-N/ and
    renamed to out/checkpoint-N only once every file (trainer_state.json last) is written, so a kill or a
    full disk during a save never leaves a checkpoint-N that looks resumable. A failed save removes its
    staging folder (space back for the status write) and raises CheckpointSaveError naming checkpoint-N.

    The Trainer writes checkpoints below `_get_output_dir()`; pointed at the staging folder for the call,
    the Trainer's own code (and a TRL subclass's override) does the writing; the best-checkpoint path and the
    save_total_limit rotation, which the Trainer does inside the staging folder, are redone for the real
    folder here."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    original = trainer._save_checkpoint  # bound: a TRL override calls Trainer._save_checkpoint via super()
    plain_output_dir = trainer._get_output_dir

    def save(model, trial):
        if trial is not None or trainer.hp_search_backend is not None:
            return original(model, trial)  # hyperparameter search trials keep the Trainer's own layout
        out = Path(plain_output_dir(trial))
        step = trainer.state.global_step
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        staging = out / f"{STAGING_PREFIX}{step}"
        staged, final = staging / name, out / name
        trainer._get_output_dir = lambda trial=None: str(staging)
        try:
            original(model, trial)
            trainer.accelerator.wait_for_everyone()  # every rank has written its part (rng states, shards)
            if trainer.args.should_save:
                best = trainer.state.best_model_checkpoint
                if best and Path(best).parent == staging:  # the Trainer named the staged path as the best one
                    trainer.state.best_model_checkpoint = str(out / Path(best).name)
                    trainer.state.save_to_json(str(staged / "trainer_state.json"))
                if final.exists():  # an earlier incomplete or older copy of this step
                    shutil.rmtree(final)
                os.replace(staged, final)
                shutil.rmtree(staging, ignore_errors=True)
                rotate_checkpoints(output_dir=str(out), save_total_limit=trainer.args.save_total_limit,
                                   best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
        except Exception as exc:
            if trainer.args.world_size > 1 and not staging.exists() and not isinstance(exc, OSError):
                # removed under this rank's feet (torch: "Parent directory ... does not exist"): a peer's save failed
                raise CheckpointSaveError(name, RuntimeError(
                    f"{staging.name} was removed while this rank wrote into it (another rank's save failed)")) from exc
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointSaveError(name, exc) from exc
        finally:
            trainer._get_output_dir = plain_output_dir
        trainer.accelerator.wait_for_everyone()  # no rank reads checkpoint-N before it is in place

    trainer._save_checkpoint = save


def resume_checkpoint(spec, out: Path, log=print) -> str | None:
    """The checkpoint resume_from_checkpoint continues (backend.core.rundir.resume_choice; `log` names incomplete
    newer ones skipped), or None."""
    try:
        chosen, skipped = resume_choice(spec.resume_from_checkpoint, out)
    except ResumeError as exc:
        raise RunError(str(exc)) from None
    if skipped:
        log(f"skipping incomplete checkpoint(s) {', '.join(skipped)} (no {CHECKPOINT_COMPLETE_MARKER}: "
            "the save was cut short)")
    return str(chosen) if chosen is not None else None


def trim_log_to(out: Path, step: int) -> None:
    """On resume, drop log lines past the checkpoint so the curve has no duplicate steps. The trimmed log
    replaces the file (a new inode), so a tailer reading it starts over even when the resumed steps have grown
    it past where it had read by its next look (webui/tailer.py)."""
    log = out / LOG_FILE
    if not log.exists():
        return
    lines = log.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (ValueError, AttributeError):
            continue
    if kept != lines:
        write_text_atomic(log, "".join(k + "\n" for k in kept), mkdir=False)


def resumed_step(checkpoint: str | Path) -> int:
    """The optimizer step a checkpoint holds: its checkpoint-N name, else its trainer_state.json's global_step."""
    step = checkpoint_step(Path(checkpoint))
    if step is None:
        state = read_json_dict(Path(checkpoint) / CHECKPOINT_COMPLETE_MARKER) or {}
        step = state.get("global_step") if isinstance(state.get("global_step"), int) else 0
    return step


def resume_steps(earlier, step: int) -> list[int]:
    """status.json's resumed_at once the run resumes at `step`: the earlier resumes before it, then `step` (a
    resume from an older checkpoint drops the resumes past it, as its log drops the steps past it)."""
    return [r for r in earlier or () if isinstance(r, int) and not isinstance(r, bool) and r < step] + [step]


def mean_train_loss(log_history: list[dict], resumed_at: list[int]) -> float | None:
    """The mean training loss over every step the logged losses cover, before and after each resume (the
    steps `resumed_at` lists): a logged loss is the mean over the steps since the one logged before it, or
    since the resume between them (a resumed Trainer counts from its checkpoint's step), and weighs as many
    steps. The HF Trainer's train_loss after a resume covers the resumed steps alone."""
    total = steps = 0.0
    last = 0
    for row in sorted((h for h in log_history if isinstance(h.get("loss"), (int, float))), key=lambda h: h["step"]):
        since = max([last] + [r for r in resumed_at if r < row["step"]])
        if row["step"] > since:
            total += row["loss"] * (row["step"] - since)
            steps += row["step"] - since
        last = row["step"]
    return total / steps if steps else None


# Same setting, older/newer name: the spec's table is read from one transformers release.
_RENAMED = {"activation_checkpointing": "gradient_checkpointing", "gradient_checkpointing": "activation_checkpointing"}


def fit_to_installed(kwargs: dict, args_class) -> dict:
    """Keep the keys the installed TrainingArguments knows, under the name it uses."""
    known = set(args_class.__dataclass_fields__)
    fitted = {}
    for key, value in kwargs.items():
        if key not in known and _RENAMED.get(key) in known:
            key = _RENAMED[key]
        if key in known:
            fitted[key] = value
        else:
            print(f"note: TrainingArguments of this transformers release has no '{key}': ignored", flush=True)
    return fitted


def training_arguments(spec, out: Path, *, has_eval: bool, args_class=None, extra: dict | None = None):
    """TrainingArguments (or a TRL config built on them: args_class, with its own keys in `extra`)
    from the spec, with the settings our run directory relies on."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from transformers import TrainingArguments

    from backend.training.models import gradient_checkpointing_on  # heavy: loaded on use, so importing this module stays light

    args_class = args_class or TrainingArguments
    kwargs = fit_to_installed(spec.training_arguments(), args_class)
    if "gradient_checkpointing" in args_class.__dataclass_fields__:  # TRL configs default it to True
        kwargs["gradient_checkpointing"] = gradient_checkpointing_on(spec)

    if gradient_checkpointing_on(spec) and not given_by_spec(spec):  # the Trainer enables checkpointing again
        kwargs.update(fit_to_installed({"activation_checkpointing_kwargs": checkpoint_kwargs()}, args_class))
    kwargs.update(extra or {})
    kwargs["output_dir"] = str(out)
    kwargs.setdefault("include_num_input_tokens_seen", "non_padding")  # for tokens/s
    kwargs.setdefault("disable_tqdm", True)  # the run log says the progress, line by line
    kwargs["remove_unused_columns"] = False  # our rows carry exactly what the collator needs
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    import torch

    from backend.training.models import compute_dtype  # heavy: loaded on use, so importing this module stays light

    if "dataloader_pin_memory" not in spec.passthrough:
        kwargs["dataloader_pin_memory"] = torch.cuda.is_available()
    # Mixed precision only where the model loader kept it (it already warned about the fallback).
    dtype = compute_dtype(spec)
    kwargs["bf16"] = dtype == torch.bfloat16 and not spec.pure_bf16  # asked, or the default (bf16_by_default)
    kwargs["fp16"] = bool(kwargs.get("fp16")) and dtype == torch.float16
    if kwargs["bf16"] and not torch.cuda.is_available():
        kwargs["use_cpu"] = True  # bf16 autocast on a CPU with native bf16 matmul: transformers wants it said
    kwargs.update(distributed_arguments(spec))
    if not has_eval:
        kwargs["eval_strategy"] = "no"
        kwargs["load_best_model_at_end"] = False
    return args_class(**kwargs)


def distributed_arguments(spec) -> dict:
    """TrainingArguments of the spec's sharding engine: deepspeed (the config file's path; on a CPU-only
    machine DeepSpeed runs on its CPU accelerator, which transformers only picks with use_cpu, else each rank
    trains alone and the "auto" batch sizes assert), or fsdp + fsdp_config from an accelerate FSDP config."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    import torch

    out: dict = {}
    if (spec.deepspeed or world_size(spec) > 1) and not torch.cuda.is_available():
        out["use_cpu"] = True  # without it accelerate sees the process group but trains each CPU rank alone
    if world_size(spec) > 1 and method(spec.finetuning_type).adapter and "ddp_find_unused_parameters" not in spec.passthrough:
        out["ddp_find_unused_parameters"] = False  # every adapter weight takes part in the forward (as LLaMA-Factory)
    if spec.deepspeed:
        out["deepspeed"] = str(resolve_config(spec.deepspeed))
    if spec.accelerate_config:
        out.update(fsdp_training_arguments(read_accelerate_config(spec.accelerate_config)))
    return out


def start_swanlab_run(out: Path) -> None:
    """transformers' SwanLab callback asks swanlab.get_run() before its swanlab.init(), and swanlab 0.10 raises there
    when no run is active ('No active Run'): start the run here, where the environment points it (backend/core/
    trackers.py); the callback adds the arguments to its config and logs into it."""
    import swanlab  # optional: report_to swanlab (its own extra)

    swanlab.init(project=os.environ.get("SWANLAB_PROJECT"), experiment_name=out.name,
                 logdir=os.environ.get("SWANLAB_LOG_DIR"), mode=os.environ.get("SWANLAB_MODE"))


def fit(spec, run_dir: RunDir, stop, *, model, tokenizer, train_dataset, collator=None, eval_dataset=None,
        trainer_class=None, args_class=None, config: dict | None = None, task_metric=None,
        **trainer_kwargs) -> StageResult:
    """Train with a Trainer (the HF one, or a stage's TRL trainer: trainer_class + args_class with its
    `config` keys and extra `trainer_kwargs` such as ref_model) and our callback, save, plot: the shared
    tail of every stage. The callback logs the metric keys the stage declares (backend/stages); `task_metric`
    (task_metric_callback()) scores eval_metric at each save and, by it, picks the final weights."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from transformers import EarlyStoppingCallback, Trainer
    from transformers.trainer_callback import PrinterCallback  # heavy: loaded on use, so importing this module stays light

    from backend.training.callbacks import RunDirCallback, agreed_stop  # heavy: loaded on use, so importing this module stays light
    from backend.training.models import install_optimizer  # heavy: loaded on use, so importing this module stays light

    out = run_dir.path
    checkpoint = resume_checkpoint(spec, out, log=run_dir.log)
    for line in point_trackers_at(spec.report_to, out):  # before the Trainer: its tracker callbacks read the environment
        run_dir.log(line)
    if "swanlab" in tracker_names(spec.report_to) and run_dir.writer:
        start_swanlab_run(out)
    args = training_arguments(spec, out, has_eval=eval_dataset is not None, args_class=args_class, extra=config)
    reason = agreed_stop(stop.reason)  # (after the arguments: they set up the process group the ranks agree over)
    if reason:  # Abort came while the rows were tokenized or the model loaded: no step, no save after it
        run_dir.log(f"stop requested ({reason}) before training: nothing trained, nothing saved"
                    + (f", {Path(checkpoint).name} kept as it was" if checkpoint else ""))
        if checkpoint and checkpoint_step(Path(checkpoint)) is not None:
            run_dir.update_status(step=checkpoint_step(Path(checkpoint)))  # where the run stands: its checkpoint
        return StageResult(stopped=True)
    callback = RunDirCallback(run_dir, stop, metric_keys=get_stage(spec.stage).logged_keys())
    callbacks = [callback] + ([task_metric] if task_metric is not None else [])
    early = None
    if eval_dataset is not None and getattr(spec, "early_stopping_patience", None):
        early = EarlyStoppingCallback(early_stopping_patience=spec.early_stopping_patience)
        callbacks.append(early)

    if probe.active():  # a `tuneboard probe` child: longest rows first, measured (backend/training/probe.py)
        train_dataset, collator = probe.instrument(train_dataset, collator, callbacks)
    trainer = (trainer_class or Trainer)(
        model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=collator, processing_class=tokenizer, callbacks=callbacks, **trainer_kwargs,
    )
    trainer.remove_callback(PrinterCallback)  # our callback logs each step as one readable line
    for line in getattr(trainer, "run_log_lines", ()):  # what a stage's trainer chose as it was built (dpo, kto)
        run_dir.log(line)
    install_optimizer(trainer, spec)  # LoRA+ / GaLore build their own optimizer (backend.training.models)
    save_checkpoints_atomically(trainer)
    if run_dir.writer:
        remove_staged_checkpoints(out, log=run_dir.log)
    # the steps this run was resumed at (status.json resumed_at; the checkpoint's own history names the steps
    # before it): what the whole run's train_loss weighs by, and what the summary says its timings cover
    resumed_at = resume_steps(run_dir.status.get("resumed_at"), resumed_step(checkpoint)) if checkpoint else []
    run_dir.update_status(resumed_at=resumed_at)
    if checkpoint:
        if run_dir.writer:
            trim_log_to(out, resumed_at[-1])
        run_dir.log(f"resuming from {checkpoint}" + (": the stream's batches of the steps trained are read again and "
                    "skipped (same files, seed and buffer: the same order), so it continues at its next row"
                    if getattr(spec, "streaming", False) and not args.ignore_data_skip else ""))
    result = trainer.train(resume_from_checkpoint=checkpoint)
    if early is not None and early.early_stopping_patience_counter >= spec.early_stopping_patience:
        best = trainer.state.best_metric
        run_dir.log(f"early stopping at step {trainer.state.global_step} of {trainer.state.max_steps}: "
                    f"{args.metric_for_best_model} did not improve for {spec.early_stopping_patience} evaluations"
                    + (f" (best {best:.4g}, from {trainer.state.best_model_checkpoint})" if best is not None else ""))
    if task_metric is not None and spec.best_by_task_metric:
        from backend.evaluation.task_metric import load_best  # heavy (torch): this module's top stays light

        load_best(trainer, task_metric, run_dir)
    trainer.save_model(str(out))  # every rank takes part (ZeRO-3 gathers the weights); rank 0 writes
    trainer.save_state()
    if run_dir.writer:
        tokenizer.save_pretrained(str(out))
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float))}
    metrics["global_step"] = trainer.state.global_step
    metrics.update(loss_summary([h["loss"] for h in trainer.state.log_history if "loss" in h]))
    if resumed_at:  # the Trainer's train_loss and timings cover this process's steps alone
        whole = mean_train_loss(trainer.state.log_history, resumed_at)
        if whole is not None:
            metrics["train_loss"] = whole
        run_dir.log(f"resumed at step {resumed_at[-1]}: train_loss and the loss summary cover every logged step; "
                    f"train_runtime, train_samples_per_second and train_steps_per_second cover steps "
                    f"{resumed_at[-1] + 1}-{trainer.state.global_step} only")
    if eval_dataset is not None and not callback.stop_reason:
        step = trainer.state.global_step
        done = [h for h in trainer.state.log_history if "eval_loss" in h and h.get("step") == step]
        eval_metrics = done[-1] if done else trainer.evaluate()  # no second point at the same step
        metrics.update({k: v for k, v in eval_metrics.items() if k.startswith("eval_") and isinstance(v, (int, float))})
    if spec.plot_loss and run_dir.writer:
        path = plot_loss(out)
        if path:
            run_dir.log(f"loss plot: {path}")
    run_dir.log(f"saved to {out}")
    return StageResult(stopped=callback.stop_reason is not None, metrics=metrics)


# -- the steps every stage shares ------------------------------------------------------------

def tokenizer_and_template(spec, run_dir: RunDir):
    """(resolved model, tokenizer, template): step 1 of every conversation stage, so new_special_tokens,
    the template and enable_thinking mean the same in sft, dpo, kto and rm."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from backend.training.models import load_tokenizer, resolve_model

    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)
    template = pick_template(spec.template, resolved, tokenizer, warn=run_dir.warn,
                             enable_thinking=spec.enable_thinking)
    run_dir.log(f"template: {template.name}")
    return resolved, tokenizer, template


def task_metric_callback(spec, run_dir: RunDir, stop, tokenizer, template, val_examples: list[dict]):
    """eval_metric: the callback that scores it at each save on the first eval_samples held-out rows
    (backend/evaluation/task_metric.py), for fit(task_metric=...); None when the spec sets none."""
    if not spec.eval_metric:
        return None
    from backend.evaluation.task_metric import TaskMetricCallback  # heavy (torch): this module's top stays light

    if not val_examples:
        raise RunError("eval_metric: no held-out rows left to score (val_size / eval_dataset gave none)")
    scorer = TaskMetricCallback(spec, run_dir, tokenizer, template, val_examples, stop=stop)
    run_dir.log(f"eval_metric {spec.eval_metric}: scored at each save on {len(scorer.examples)} held-out rows"
                + (f" (answers of up to {scorer.max_new_tokens} new tokens, {scorer.batch_rows} rows a generate call)"
                   if spec.eval_metric != "eval_loss" else "")
                + (" (the best-scoring checkpoint becomes the final weights)" if spec.best_by_task_metric else ""))
    return scorer


def predict_held_out(spec, run_dir: RunDir, result: StageResult, model, tokenizer, template,
                     val_examples: list[dict]) -> StageResult:
    """do_predict: generate answers for the held-out rows into generated_predictions.jsonl (streamed) and
    add the scores to the result's metrics; nothing after a stopped run."""
    if spec.do_predict and val_examples and not result.stopped:
        from backend.evaluation import predict as prediction  # heavy (torch): this module's top stays light

        run_dir.log(f"predicting {len(val_examples)} held-out rows -> generated_predictions.jsonl")
        model.eval()
        result.metrics.update(prediction.predict(model, tokenizer, template, val_examples,
                                                 run_dir.path / PREDICTIONS_FILE, spec))
    return result


def load_rows(spec, run_dir: RunDir, names: str, stage: str) -> list[dict]:
    """Examples of the named datasets, with the data report in the run log."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from backend.dataprep.data import load_examples

    examples, report = load_examples(
        names, spec.resolved_dataset_dir(), stage=stage, max_samples=spec.max_samples,
        identity_name=spec.identity_name, identity_author=spec.identity_author, seed=spec.seed,
        default_system=spec.default_system, mix_strategy=spec.mix_strategy, interleave_probs=spec.interleave_probs,
    )
    for line in report.summary_lines():
        run_dir.log(line)
    return examples


def train_and_eval_rows(spec, run_dir: RunDir, stage: str) -> tuple[list[dict], list[dict]]:
    """Training rows and held-out rows: `eval_dataset` if given, else the `val_size` split."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from backend.dataprep.data import split_train_val

    train, held_out = split_train_val(load_rows(spec, run_dir, spec.dataset, stage), spec.val_size, spec.seed)
    if spec.eval_dataset:
        held_out = load_rows(spec, run_dir, spec.eval_dataset, stage)
    if spec.eval_metric:  # rows it cannot score: refused now, not after tokenizing
        from backend.evaluation.task_metric import check_held_out  # heavy (torch): loaded on use, as above

        check_held_out(spec, held_out)
    return train, held_out


def batching(spec, run_dir: RunDir, rows: list[dict], tokenizer, model=None):
    """(rows, collator): packed sequences without cross-attention; else, given the model of an sft/pt run,
    padding-free batches (each batch's rows concatenated: the same rows per step as padding, no pad token
    computed) where they are exact for its attention (backend.training.models.padding_free_problem); else padded rows.
    TUNEBOARD_PADDING_FREE=0 in the environment keeps padding (for side-by-side measurements: bench/)."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from backend.training.models import padding_free_problem

    if not spec.streaming and not rows:
        raise RunError("no training rows left after preprocessing (see the warnings above)")
    if spec.resolved_packing:
        if spec.streaming:  # a stream is packed window by window as it is read (backend/dataprep/stream.py)
            from backend.dataprep.stream import PACK_WINDOW, pack_stream  # heavy: datasets

            rows, packed = pack_stream(rows, spec.cutoff_len), f"each window of {PACK_WINDOW} streamed rows packed"
        else:  # pack_rows builds its sequences as lists: rows of the memory-mapped cache are read into lists first
            rows = pack_rows(rows if isinstance(rows, list) else rows.to_list(), spec.cutoff_len)
            packed = f"packed into {len(rows)} sequences"
        # SDPA over a packed sequence computes every row against every other of it (masked): per row instead
        problem = "no model" if model is None else padding_free_problem(model) or _use_varlen(model)
        run_dir.log(f"{packed} of <= {spec.cutoff_len} tokens"
                    + (" (varlen SDPA: one causal attention per packed row)" if problem is None
                       else f" (attention over each whole sequence, masked: {problem})"))
        return rows, PackedCollator(flash_attn_kwargs=problem is None or _flash(model))
    if model is not None and spec.stage in ("sft", "pt") and os.environ.get("TUNEBOARD_PADDING_FREE", "1") != "0":
        problem = padding_free_problem(model)
        if problem is None:
            # SDPA over the whole concatenation would compute every row against every other (masked): per row
            varlen = _use_varlen(model) is None
            run_dir.log("padding-free batches: each batch's rows concatenated, no attention across rows"
                        + (" (varlen SDPA: one causal attention per row)" if varlen else ""))
            return rows, PaddingFreeCollator(flash_attn_kwargs=_flash(model) or varlen)
        run_dir.log(f"padded batches: padding-free is not exact for this model ({problem})")
    return rows, PaddingCollator(tokenizer)


def _use_varlen(model) -> str | None:
    """Switch a model that passed the padding-free probe to the varlen SDPA (backend/training/attention.py: one causal
    SDPA per row of a concatenated batch, rows from the collator's cu_seq_lens): None when switched, else why
    not. TUNEBOARD_VARLEN=0 keeps SDPA."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from backend.training.attention import use_varlen_attention

    if os.environ.get("TUNEBOARD_VARLEN", "1") == "0":
        return "TUNEBOARD_VARLEN=0"
    return use_varlen_attention(model)


def _flash(model) -> bool:
    return model is not None and str(getattr(model.config, "_attn_implementation", "")).startswith("flash")


def trainable_model(spec, run_dir: RunDir, resolved, *, chunked_loss: bool = False, **load_kwargs):
    """The model loaded for training, with adapters / frozen layers as the spec says (load_kwargs go to
    load_model, e.g. reward_head=True for stage rm). chunked_loss (sft, pt): the training loss is computed
    from the last hidden state in chunks, never the full logits (backend.training.losses), where that is exact for
    this model; TUNEBOARD_CHUNKED_LOSS=0 in the environment keeps the plain loss (for bench/)."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from backend.training.adapters import apply_finetuning, count_parameters
    from backend.training.models import (BF16_DEFAULT_NOTE, bf16_by_default, describe_model,  # heavy: loaded on use
                                         gradient_checkpointing_on, install_chunked_loss, load_model)

    model = load_model(spec, resolved, for_training=True, warn=run_dir.warn, **load_kwargs)
    run_dir.log(f"model: {describe_model(model)}")
    if bf16_by_default(spec):
        run_dir.log(BF16_DEFAULT_NOTE)
    if paths.weights_note(spec.model_name_or_path):
        run_dir.log(f"model: {paths.weights_note(spec.model_name_or_path)}")
    if gradient_checkpointing_on(spec):
        run_dir.log(f"gradient checkpointing: {described()}")
    model = apply_finetuning(model, spec, warn=run_dir.warn)
    trainable, total = count_parameters(model)
    run_dir.log(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)")
    if chunked_loss and os.environ.get("TUNEBOARD_CHUNKED_LOSS", "1") != "0":
        if spec.passthrough.get("label_smoothing_factor"):
            problem = "label_smoothing_factor smooths the full logits"
        else:
            problem = install_chunked_loss(model)
        run_dir.log("loss: chunked linear + cross-entropy (no full logits)" if problem is None
                    else f"loss: plain, with the full logits ({problem})")
    return model


def adapter_is_identity(model, adapter: str = "default") -> bool:
    """True when every LoRA B matrix of the adapter is zero (a freshly initialised LoRA / DoRA adapter)."""
    found = False
    for name, param in model.named_parameters():
        if f"lora_B.{adapter}." in name or f"lora_embedding_B.{adapter}" in name:
            found = True
            if param.detach().abs().max() > 0:
                return False
    return found


def reference_model(spec, run_dir: RunDir, resolved, policy):
    """The frozen model a DPO / KTO stage holds the policy to, or None where no second model is kept:
    - `ref_model` given: that model, loaded by our loader (same dtype / quantization as the policy), frozen;
      it needs an embedding for every token of the policy's vocabulary.
    - LoRA: no second model. The reference is the policy training starts from, on the shared base weights: the
      base model while the new adapter is still the identity, else TRL's frozen copy of the starting adapter
      ("ref": a continued adapter_name_or_path, PiSSA). LLaMA-Factory disables the adapter instead, which makes
      the base model the reference even after SFT (its issue #8459 reports that as a bug); we keep TRL's choice.
    - full / freeze: a frozen copy of the base model (the training changes the weights themselves)."""
    # heavy (torch, transformers, datasets): the module top stays light, see the docstring
    from backend.training.models import load_model, resolve_model

    if spec.ref_model:
        try:
            ref_resolved = resolve_model(spec.ref_model)
        except (ValueError, FileNotFoundError) as exc:
            raise RunError(f"ref_model: {exc}") from None
        ref = load_model(spec, ref_resolved, for_training=False, warn=run_dir.warn)
        have, need = ref.get_input_embeddings().num_embeddings, policy.get_input_embeddings().num_embeddings
        if have < need:
            raise RunError(f"ref_model: {spec.ref_model} has {have} token embeddings, fewer than the {need} of "
                           f"{spec.model_name_or_path} (its log-probabilities cannot be compared token by token)")
        run_dir.log(f"reference model: {spec.ref_model} (a second model in memory)")
        return ref.requires_grad_(False)
    if method(spec.finetuning_type).adapter:
        if spec.adapter_name_or_path:
            run_dir.log(f"reference model: the adapter from {spec.adapter_name_or_path} (a frozen copy of its "
                        "starting weights on the shared base weights; no second model in memory)")
        elif adapter_is_identity(policy):
            run_dir.log("reference model: the base model (the new adapter disabled; no second model in memory)")
        else:
            run_dir.log("reference model: the starting adapter (a frozen copy of its weights on the shared "
                        "base weights; no second model in memory)")
        return None
    run_dir.log(f"reference model: a frozen copy of {spec.model_name_or_path} ({spec.finetuning_type} training "
                "changes the weights themselves)")
    return load_model(spec, resolved, for_training=False, warn=run_dir.warn).requires_grad_(False)
