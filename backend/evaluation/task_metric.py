"""eval_metric: a task metric at every checkpoint save, and the best-scoring checkpoint as the run's final weights.

At each save (checkpoint-N is in place: backend.stages.base saves atomically first) rank 0 puts the model in eval
mode, generates greedy answers for the same `eval_samples` held-out rows (with the KV cache, up to max_new_tokens, never
more than twice the longest reference answer + ANSWER_SLACK, each row stopping once its answer is settled: a continuous
batch of generation_batch rows, a row leaving as it ends and the next joining, backend.evaluation.predict.generate_rows;
a model whose cache the batch cannot stack, or TUNEBOARD_BATCHING=0, gets left-padded generate() calls instead), scores
them against the rows' answers (backend.core.metrics / backend.core.rewards, 0-100 like `tuneboard eval`; eval_loss = the
loss over their answer tokens; judge = the answers' win rate against the references, asked of backend/evaluation/judge.py's
endpoint in both orders), puts the model back in train mode, and writes
- one line into trainer_log.jsonl: {"step": N, "eval_<metric>": value, "eval_seconds": s},
- checkpoint_scores.json (backend.core.rundir.CHECKPOINT_SCORES_FILE): {"metric", "greater_is_better", "samples",
  "scores": [{"step", "checkpoint", "value", "seconds"}, ...], "best": {"step", "checkpoint", "value"}}.
The other ranks wait for it at one broadcast, which also gives them the best checkpoint (load_best needs it on
every rank). With load_best_model_at_end and the task metric (RunSpec.best_by_task_metric) the best checkpoint is
the Trainer's best_model_checkpoint (save_total_limit keeps it), and `load_best` loads it after training through
the Trainer's own loader (LoRA, full, DeepSpeed) before the final save.

The held-out rows are checked right after the data is loaded (check_held_out: before tokenizing and the model), and
with eval_metric judge the judge is asked one test pair when the callback is made (judge.probe: before the model
loads), so a metric that cannot score fails the run before training. A save the judge gives no score (no row judged,
too few verdicts) gets none and is no candidate for the best.
"""
from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

from backend.core import metrics, rewards
from backend.core.atomic import read_json_dict, write_json_atomic
from backend.evaluation.judge import MIN_VERDICT_SHARE, JudgeFatal, JudgeSettings, judge_win_rate, probe
from backend.evaluation.merged import merged_lora
from backend.evaluation.predict import eval_loss, generate, generate_rows, generation_kwargs, split_prompt
from backend.serving.batching import batchable
from backend.dataprep.preprocess import build_sft_dataset
from backend.core.rundir import CHECKPOINT_SCORES_FILE, JUDGE_CACHE_DIRNAME

_COMPUTED = {"bleu": "bleu-4", "rouge_l": "rouge-l"}  # eval_metric -> its name in metrics.compute()
JSON_METRICS = ("json_field_f1", "json_valid", "schema_valid")
ANSWER_SLACK = 16  # new tokens allowed beyond twice the longest reference answer
GENERATION_BUDGET = 8  # a generate() call's tokens (rows x (prompt + answer)) against a training micro-batch's


class TaskMetricError(ValueError):
    """The held-out rows cannot be scored by this metric: one line naming it."""


log_key = metrics.task_log_key


def greater_is_better(metric: str) -> bool:
    return metric not in metrics.LOWER_IS_BETTER


def score(metric: str, predictions: list[str], references: list[str]) -> float:
    """The corpus value (0-100) of a generation metric; schema_valid = the share of answers that validate against
    the schema inferred from their reference (backend.core.rewards.json_schema, as GRPO's reward and distill's
    scorecard)."""
    if metric == "schema_valid":
        per_row = [v for v in rewards.json_schema([""] * len(predictions), predictions, reference=references)
                   if v is not None]
        return 100 * sum(v == 1.0 for v in per_row) / len(per_row) if per_row else 0.0
    return float(metrics.compute(predictions, references).get(_COMPUTED.get(metric, metric), 0.0))


def check_rows(metric: str, examples: list[dict]) -> None:
    """Refuse, before training, held-out rows this metric cannot score (none; no JSON answer for a JSON metric)."""
    if not examples:
        raise TaskMetricError("eval_metric: no held-out rows left to score (val_size / eval_dataset gave none)")
    references = [split_prompt(example)[1] for example in examples]
    if metric in JSON_METRICS and not any(metrics.field_counts(r, r) is not None for r in references):
        first = examples[0]
        raise TaskMetricError(f"eval_metric {metric}: none of the {len(examples)} held-out answers is a JSON object "
                              f"or list (row {first.get('_row')} of {first.get('_source')}, ...): pick exact_match, "
                              "bleu, rouge_l or eval_loss for answers in plain text")


def check_held_out(spec, held_out: list[dict]) -> None:
    """eval_metric's check of the rows it will score (the first eval_samples held-out rows), for the training
    process right after its data is loaded (backend.stages.base.train_and_eval_rows): before tokenizing, loading
    the model or any step."""
    check_rows(spec.eval_metric, held_out[:spec.eval_samples])


JSON_STARTS = '{["-0123456789tfn`'  # how a JSON value (or a ```json fence, metrics.parse_json) can begin


def json_end(text: str) -> int | None:
    """The index just past the top-level object or list that `text` opens with (brackets inside strings not
    counted), or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def answer_settled(text: str, stop_words: list[str], json_answer: bool) -> bool:
    """True once no later token can change what the answer so far scores, so its generation may stop there:
    - a template stop word is in it: the answer is cut there (backend.evaluation.predict.generate), the rest dropped;
    - json_answer (the JSON metrics, which score json.loads of the whole stripped answer, metrics.parse_json): it
      begins with a character no JSON value (nor a ```json fence) begins with, or the object / list it opens has
      closed and a non-blank character follows that cannot begin a stop word. Either way it is not JSON whatever
      comes next, and scores as not JSON.
    A trailing U+FFFD may be half a character still being written: it settles nothing."""
    if any(word and word in text for word in stop_words):
        return True
    body = text.lstrip()
    if not json_answer or not body or body[0] == "\ufffd":
        return False
    if body[0] not in "{[":
        return body[0] not in JSON_STARTS
    end = json_end(body)
    if end is None:
        return False
    first = end + len(body[end:]) - len(body[end:].lstrip())  # the first non-blank character after it
    if first == len(body) or body[first] == "\ufffd":
        return False
    # a stop word starting in the blanks after the close would cut the answer back to valid JSON
    return not any(word.startswith(body[i:]) for i in range(end, first + 1) for word in stop_words if word)


def generation_batch(spec, row_tokens: int, rows: int) -> int:
    """Rows per generate() call: as many as fit the training micro-batch's token budget x GENERATION_BUDGET
    (generation keeps only the KV cache, no activations for a backward pass nor gradients), at least
    per_device_eval_batch_size, at most every row."""
    budget = GENERATION_BUDGET * spec.per_device_train_batch_size * spec.cutoff_len
    return max(1, min(rows, max(spec.per_device_eval_batch_size, budget // max(row_tokens, 1))))


class TaskMetricCallback(TrainerCallback):
    """Scores the task metric at each save (rank 0) and keeps checkpoint_scores.json; see the module docstring."""

    def __init__(self, spec, run_dir, tokenizer, template, examples: list[dict], stop=None):
        self.spec, self.run_dir, self.tokenizer, self.template = spec, run_dir, tokenizer, template
        self.metric = spec.eval_metric
        self.examples = examples[:spec.eval_samples]
        self.stop = stop
        check_rows(self.metric, self.examples)
        if self.metric == "judge":  # asked once now: a refused key or a judge that does not answer fails the run here
            self._probe_judge()
        self.rows = None
        if self.metric == "eval_loss":
            self.rows = build_sft_dataset(self.examples, template, tokenizer, spec.cutoff_len, log=run_dir.warn)[0]
        pairs = [split_prompt(example) for example in self.examples]  # the same prompts at every save
        self.conversations = [msgs for msgs, _ in pairs]
        self.references = [reference for _, reference in pairs]
        self.prompts = [template.render_text(msgs, example.get("tools"), add_generation_prompt=True)
                        for msgs, example in zip(self.conversations, self.examples)]
        # an answer more than twice as long as the longest reference cannot score well: generation stops there
        longest = max(len(tokenizer(r, add_special_tokens=False).input_ids) for r in self.references)
        self.max_new_tokens = min(spec.max_new_tokens, 2 * longest + ANSWER_SLACK)
        lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in self.prompts]
        self.batch_rows = generation_batch(spec, max(lengths) + self.max_new_tokens, len(self.prompts))
        # generated longest prompt first: rows of like length share a generate() call (less left padding)
        self.order = sorted(range(len(self.prompts)), key=lambda i: -lengths[i])
        self.record = {"metric": self.metric, "greater_is_better": greater_is_better(self.metric),
                       "samples": len(self.examples), "scores": [], "best": None}
        self.best_checkpoint: str | None = None  # the path, on every rank

    def _probe_judge(self) -> None:
        try:
            verdict = probe(JudgeSettings.from_spec(self.spec), log=self.run_dir.log)
        except JudgeFatal as exc:
            raise JudgeFatal(f"eval_metric judge, before training: {exc}") from None
        if verdict is None:
            self.run_dir.warn(f"eval_metric judge: the judge's reply to a test pair has no `Verdict:` line: a save "
                              f"where fewer than {MIN_VERDICT_SHARE:.0%} of its replies have one gets no score "
                              "(check judge_model)")

    # -- scores ---------------------------------------------------------------------------------
    def _path(self) -> Path:
        return self.run_dir.path / CHECKPOINT_SCORES_FILE

    def _better(self, value: float, than: float) -> bool:
        return value > than if self.record["greater_is_better"] else value < than

    def _best_of(self, scores: list[dict]) -> dict | None:
        best = None
        for s in scores:  # the earliest of equal scores: fewer steps for the same answers
            if s.get("value") is not None and (best is None or self._better(s["value"], best["value"])):
                best = s
        return {k: best[k] for k in ("step", "checkpoint", "value")} if best else None

    def measure(self, model) -> float:
        """The metric on the held-out rows, the model in eval mode for it (and back to train mode after)."""
        was_training = model.training
        model.eval()
        try:
            if self.rows is not None:
                return eval_loss(model, self.rows, self.tokenizer, self.spec.per_device_eval_batch_size)["eval_loss"]
            stop = (lambda: self.stop.reason) if self.stop is not None else None
            kwargs = generation_kwargs(self.spec, self.tokenizer, self.template, stop=stop, greedy=True)
            kwargs["max_new_tokens"] = self.max_new_tokens
            settled = partial(answer_settled, stop_words=list(self.template.stop_words or []),
                              json_answer=self.metric in JSON_METRICS)
            with merged_lora(model):  # one product per adapted layer, the weights exactly as before afterwards
                predictions = self._answers(model, kwargs, settled, stop)
            return self._score(predictions)
        finally:
            if was_training:
                model.train()

    def _answers(self, model, kwargs: dict, settled, stop) -> list[str]:
        if batchable(model):  # a continuous batch: a row leaves as soon as its answer ends
            return generate_rows(model, self.tokenizer, self.template, self.prompts, self.max_new_tokens,
                                 settled=settled, stop=stop, max_batch=self.batch_rows,
                                 repetition_penalty=self.spec.repetition_penalty)
        predictions = [""] * len(self.prompts)
        for start in range(0, len(self.order), self.batch_rows):
            rows = self.order[start:start + self.batch_rows]
            answers = generate(model, self.tokenizer, self.template, [self.prompts[i] for i in rows], kwargs,
                               settled=settled)
            for i, answer in zip(rows, answers):
                predictions[i] = answer
        return predictions

    def _score(self, predictions: list[str]) -> float:
        if self.metric == "judge":  # the answers' win rate against the references, asked in both orders
            settings = JudgeSettings.from_spec(self.spec, cache_dir=self.run_dir.path / JUDGE_CACHE_DIRNAME)
            return 100 * judge_win_rate(self.conversations, predictions, self.references, settings,
                                        log=self.run_dir.log)
        return score(self.metric, predictions, self.references)

    # -- the Trainer's events ------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run keeps the scores of the checkpoints up to the one it resumed from."""
        earlier = read_json_dict(self._path())
        if earlier.get("metric") == self.metric and self.run_dir.writer:
            self.record["scores"] = [s for s in earlier.get("scores", []) if s.get("step", 0) <= state.global_step]
            self.record["best"] = self._best_of(self.record["scores"])
        self._share_best(state)

    def on_save(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        name = f"checkpoint-{step}"
        if self.run_dir.writer and not (self.stop is not None and self.stop.reason) \
                and (self.run_dir.path / name).is_dir() and model is not None:
            started = time.time()
            value = self.measure(model)
            seconds = round(time.time() - started, 2)
            if math.isnan(value):  # the judge judged no row (a spent budget) or gave too few verdicts
                why = "the judge line above says why" if self.metric == "judge" else "it is NaN"
                self.run_dir.warn(f"{name}: no {self.metric} score ({why}): not a candidate for the best checkpoint")
            elif not (self.stop is not None and self.stop.reason):  # a stop during generation: not a real score
                self.record["scores"] = [s for s in self.record["scores"] if s.get("step") != step]
                self.record["scores"].append({"step": step, "checkpoint": name, "value": value, "seconds": seconds})
                self.record["best"] = self._best_of(self.record["scores"])
                write_json_atomic(self._path(), self.record)
                key = log_key(self.metric)
                self.run_dir.append_metrics({"step": step, "total_steps": state.max_steps, key: value,
                                             "eval_seconds": seconds})
                best = self.record["best"]
                self.run_dir.log(f"step {step}/{state.max_steps}  {key}={value:.4g} on {len(self.examples)} held-out "
                                 f"rows ({seconds:.1f} s); best so far {best['value']:.4g} at {best['checkpoint']}")
        self._share_best(state)

    def _share_best(self, state) -> None:
        """Rank 0's best checkpoint to every rank (the other ranks wait here while rank 0 scores); with the task
        metric picking the final weights it is the Trainer's best_model_checkpoint (save_total_limit keeps it)."""
        best = self.record["best"]
        path = [str(self.run_dir.path / best["checkpoint"]) if best else None]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(path, src=0)
        self.best_checkpoint = path[0]
        if self.spec.best_by_task_metric and self.best_checkpoint:
            state.best_model_checkpoint = self.best_checkpoint


def load_best(trainer, callback: TaskMetricCallback, run_dir) -> None:
    """load_best_model_at_end by the task metric: the best-scoring checkpoint's weights into the model (every rank:
    the Trainer's own loader handles adapters, full weights and DeepSpeed), before the final save writes them as
    the run's adapter; the run log and checkpoint_scores.json say which."""
    best = callback.record["best"]
    if not callback.best_checkpoint or not Path(callback.best_checkpoint).is_dir():
        run_dir.log(f"load_best_model_at_end: no scored checkpoint to load ({callback.metric}): the final weights "
                    "are the last step's")
        return
    trainer.state.best_model_checkpoint = callback.best_checkpoint
    trainer._load_best_model()  # transformers' loader of load_best_model_at_end (adapter, full, DeepSpeed, FSDP)
    if run_dir.writer and best:
        callback.record["loaded"] = best["checkpoint"]
        write_json_atomic(callback._path(), callback.record)
        run_dir.log(f"load_best_model_at_end: the final weights are {best['checkpoint']}'s (best "
                    f"{log_key(callback.metric)} {best['value']:.4g} of {len(callback.record['scores'])} saves)")
