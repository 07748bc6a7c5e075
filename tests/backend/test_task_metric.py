"""eval_metric (issue 20 item 1): a task metric at every save, checkpoint_scores.json, and load_best_model_at_end by
it; the batched generation it uses; the refusals of the keys. Tiny models, real `tuneboard train` subprocesses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from backend.core.rundir import CHECKPOINT_SCORES_FILE, LOG_FILE, RUNNING_LOG
from backend.core.spec import SpecError, validate_spec

TUNEBOARD = [sys.executable, "-m", "backend.cli"]


def train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(TUNEBOARD + ["train", *overrides], cwd="/tmp", capture_output=True, text=True, timeout=600)


def extraction_args(model: Path, out: Path, *extra: str) -> list[str]:
    """A short LoRA SFT run on extraction_demo's JSON answers: 3 saves, 4 held-out rows scored at each."""
    return [f"model_name_or_path={model}", f"output_dir={out}", "template=llama3", "dataset=extraction_demo",
            "max_samples=24", "val_size=8", "cutoff_len=256", "per_device_train_batch_size=2", "logging_steps=1",
            "learning_rate=0.01", "max_steps=6", "save_steps=2", "max_new_tokens=8", "eval_samples=4",
            "plot_loss=false", *extra]


def scores_and_log(out: Path, key: str) -> tuple[dict, dict[int, float]]:
    record = json.loads((out / CHECKPOINT_SCORES_FILE).read_text())
    logged = {r["step"]: r[key] for r in map(json.loads, (out / LOG_FILE).read_text().splitlines())
              if r.get(key) is not None and "eval_seconds" in r}  # (not the end-of-run evaluation's eval_loss)
    return record, logged


def weights(folder: Path, name: str) -> dict:
    return load_file(str(folder / name))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow
def test_json_field_f1_at_each_save_and_the_best_checkpoint_is_the_adapter(tiny_llama, tmp_path):
    """The metric is logged at every save and recorded in checkpoint_scores.json, the same values in both; the
    best is the recorded best (the earliest of equal values) and the final adapter is its tensors. The constructed
    case: a random tiny model writes no JSON, so every save scores the same and the first save is the best, not the
    last: the final adapter must be checkpoint-2's, which training has moved away from by step 6."""
    out = tmp_path / "run"
    proc = train(*extraction_args(tiny_llama, out, "eval_metric=json_field_f1", "load_best_model_at_end=true"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record, logged = scores_and_log(out, "eval_json_field_f1")
    assert record["metric"] == "json_field_f1" and record["greater_is_better"] is True and record["samples"] == 4
    assert [s["step"] for s in record["scores"]] == [2, 4, 6] == sorted(logged)
    assert all(s["checkpoint"] == f"checkpoint-{s['step']}" and s["seconds"] >= 0 for s in record["scores"])
    assert {s["step"]: s["value"] for s in record["scores"]} == logged
    top = max(s["value"] for s in record["scores"])
    expected = next(s for s in record["scores"] if s["value"] == top)  # the earliest of the best values
    assert record["best"] == {k: expected[k] for k in ("step", "checkpoint", "value")}
    assert record["best"]["step"] != 6, "the constructed case: the last save is not the best"
    adapter = "adapter_model.safetensors"
    final, best = weights(out, adapter), weights(out / record["best"]["checkpoint"], adapter)
    assert same(final, best) and not same(final, weights(out / "checkpoint-6", adapter))
    assert record["loaded"] == record["best"]["checkpoint"]
    log = (out / RUNNING_LOG).read_text()
    assert f"the final weights are {record['best']['checkpoint']}'s" in log


@pytest.mark.slow
def test_eval_loss_metric_picks_the_lowest_with_full_finetuning(tiny_llama, tmp_path):
    """eval_loss as the task metric: lower is better, logged as eval_loss at each save, and with full fine-tuning
    the final weights (model.safetensors) are the lowest-scoring checkpoint's. The constructed case: a learning rate
    far too high (0.5) makes the held-out loss rise after the first save, so the best checkpoint scores strictly
    better than the last and the final weights must be an earlier checkpoint's, not the last's."""
    out = tmp_path / "full"
    proc = train(*extraction_args(tiny_llama, out, "finetuning_type=full", "learning_rate=0.5",
                                  "eval_metric=eval_loss", "load_best_model_at_end=true"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record, logged = scores_and_log(out, "eval_loss")
    assert record["greater_is_better"] is False
    assert {s["step"]: s["value"] for s in record["scores"]} == logged and sorted(logged) == [2, 4, 6]
    low = min(s["value"] for s in record["scores"])
    assert record["best"]["value"] == low == min(logged.values())
    assert record["best"]["step"] != 6 and low < logged[6], f"the constructed case: the last save is not the best {logged}"
    final = weights(out, "model.safetensors")
    assert same(final, weights(out / record["best"]["checkpoint"], "model.safetensors"))
    assert not same(final, weights(out / "checkpoint-6", "model.safetensors"))


def test_batched_generation_equals_one_row_at_a_time(tiny_llama):
    """The left-padded batch (one generate() call, KV cache) gives each row the greedy answer it gets alone, and so
    does the scorer's continuous batch (generate_rows: 2 rows at a time, a row leaving as its answer ends and the
    next prompt joining; one row settled early)."""
    from backend.evaluation.evaluate import eval_examples
    from backend.training.models import load_model, load_tokenizer, resolve_model
    from backend.evaluation.predict import generate, generate_rows, generation_kwargs, split_prompt
    from backend.dataprep.resolve import pick_template

    spec = validate_spec({"model_name_or_path": str(tiny_llama), "dataset": "extraction_demo", "max_samples": 12,
                          "max_new_tokens": 40, "template": "llama3"}, check_files=False)
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer)
    model = load_model(spec, resolved, for_training=False).eval()
    examples = eval_examples(spec, log=lambda *a: None)[:5]
    prompts = [template.render_text(split_prompt(e)[0], None, add_generation_prompt=True) for e in examples]
    assert len({len(tokenizer(p).input_ids) for p in prompts}) > 1, "the rows must differ in length (padding)"
    kwargs = generation_kwargs(spec, tokenizer, template, greedy=True)
    alone = [generate(model, tokenizer, template, [p], kwargs)[0] for p in prompts]
    assert generate(model, tokenizer, template, prompts, kwargs) == alone
    assert all(alone)
    assert generate_rows(model, tokenizer, template, prompts, spec.max_new_tokens, max_batch=2) == alone
    i = next(i for i, a in enumerate(alone) if alone.count(a) == 1)  # settled once its answer is its own

    def settled(text):
        return len(text) >= 3 and alone[i].startswith(text) and not any(
            a.startswith(text) for j, a in enumerate(alone) if j != i)

    cut = generate_rows(model, tokenizer, template, prompts, spec.max_new_tokens, max_batch=2, settled=settled)
    assert cut[i] != alone[i] and alone[i].startswith(cut[i])
    assert cut[:i] + cut[i + 1:] == alone[:i] + alone[i + 1:]


def test_merged_lora_answers_as_the_adapter_and_leaves_the_weights_bit_equal(tiny_llama):
    """merged_lora (the scorer's generation): inside, the LoRA model's logits with the adapter merged equal the
    adapter's up to rounding; after, every weight is bit-equal to before and the adapter is on again; DoRA is left
    as it is (not merged)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from backend.evaluation.merged import merged_lora

    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    for dora in (False, True):
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=dora,
                                          init_lora_weights=False)).eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            with model.disable_adapter():
                bare = model(input_ids=ids).logits
            assert not torch.allclose(ref, bare, atol=1e-4)  # the adapter changes the answer
            with merged_lora(model) as merged:
                inside = model(input_ids=ids).logits
            after = model(input_ids=ids).logits
        assert merged is (not dora)
        assert torch.allclose(inside, ref, atol=1e-5)
        assert torch.equal(after, ref)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_scores_of_the_generation_metrics():
    from backend.evaluation.task_metric import TaskMetricError, check_rows, score

    refs = ['{"a": 1, "b": "x"}', '{"a": 2, "b": "y"}']
    preds = ['{"a": 1.5, "b": "X"}', "not json"]
    assert score("json_valid", preds, refs) == 50.0
    assert score("schema_valid", preds, refs) == 50.0  # a number and a string: the first validates
    assert score("exact_match", preds, refs) == 0.0 and score("exact_match", refs, refs) == 100.0
    assert score("json_field_f1", preds, refs) == pytest.approx(100 * 2 * 0.5 * 0.25 / 0.75)  # 1 of 2 / 1 of 4
    assert score("bleu", refs, refs) == pytest.approx(100.0) and score("rouge_l", refs, refs) == pytest.approx(100.0)
    plain = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a plain answer"}],
              "_row": 3, "_source": "plain.json"}]
    with pytest.raises(TaskMetricError, match="none of the 1 held-out answers is a JSON object"):
        check_rows("json_field_f1", plain)
    check_rows("rouge_l", plain)


def _errors(data: dict) -> list[tuple[str, str]]:
    try:
        validate_spec(data, check_files=False)
    except SpecError as exc:
        return exc.errors
    return []


@pytest.mark.parametrize("data, says", [
    ({"eval_metric": "accuracy", "val_size": 0.1}, "must be one of json_field_f1"),
    ({"eval_metric": "rouge_l"}, "set val_size"),
    ({"eval_metric": "rouge_l", "val_size": 0.1, "stage": "dpo"}, "stage dpo has no eval_metric"),
    ({"eval_metric": "rouge_l", "val_size": 0.1, "stage": "pt"}, "stage pt has no eval_metric"),
    ({"eval_metric": "rouge_l", "val_size": 0.1, "save_strategy": "no"}, "save_strategy is no"),
    ({"eval_metric": "eval_loss", "val_size": 0.1, "eval_strategy": "steps"}, "already logs eval_loss"),
    ({"eval_metric": "rouge_l", "val_size": 0.1, "accelerate_config": "examples/accelerate/fsdp_config.yaml"},
     "sharded weights"),
    ({"metric_for_best_model": "rouge_l"}, "only used with load_best_model_at_end"),
    ({"eval_samples": 8}, "eval_metric is not set"),  # it shapes nothing else
    ({"metric_for_best_model": "bleu", "eval_metric": "rouge_l", "val_size": 0.1, "load_best_model_at_end": True},
     "never measured"),
])
def test_eval_metric_refusals_are_one_line_each(data, says):
    errors = [(f, m) for f, m in _errors(data) if f in ("eval_metric", "metric_for_best_model", "eval_samples")]
    assert len(errors) == 1 and says in errors[0][1], errors
    assert "\n" not in errors[0][1]


def test_load_best_model_at_end_is_satisfied_by_the_task_metric():
    assert _errors({"load_best_model_at_end": True})[0][0] == "load_best_model_at_end"
    spec = validate_spec({"load_best_model_at_end": True, "eval_metric": "exact_match", "val_size": 0.1},
                         check_files=False)
    assert spec.best_by_task_metric
    args = spec.training_arguments()  # the Trainer's own load_best (which needs eval_strategy) stays off
    assert args["load_best_model_at_end"] is False and "metric_for_best_model" not in args
    hf = validate_spec({"load_best_model_at_end": True, "eval_strategy": "steps", "val_size": 0.1,
                        "metric_for_best_model": "eval_loss", "eval_metric": "rouge_l"}, check_files=False)
    assert not hf.best_by_task_metric and hf.training_arguments()["metric_for_best_model"] == "eval_loss"


def test_generation_batch_fits_the_training_token_budget():
    """Rows per generate() call: the training micro-batch's tokens x 8 (no activations kept for a backward pass),
    at least per_device_eval_batch_size, at most every row."""
    from backend.evaluation.task_metric import GENERATION_BUDGET, generation_batch

    spec = validate_spec({"per_device_train_batch_size": 4, "cutoff_len": 512, "per_device_eval_batch_size": 2},
                         check_files=False)
    budget = GENERATION_BUDGET * 4 * 512
    assert generation_batch(spec, 370, 32) == min(32, budget // 370) == 32
    assert generation_batch(spec, 2000, 32) == budget // 2000 < 32
    assert generation_batch(spec, 10 ** 6, 32) == 2


@pytest.mark.slow
def test_a_resumed_run_keeps_the_scores_of_the_checkpoint_it_resumed_from(tiny_llama, tmp_path):
    """Stopped after 4 of 6 steps (max_steps=4), resumed to 6: checkpoint_scores.json holds each save once, the
    earlier ones as they were, and the trainer_log.jsonl lines agree."""
    out = tmp_path / "resumed"
    proc = train(*extraction_args(tiny_llama, out, "eval_metric=exact_match", "max_steps=4"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, _ = scores_and_log(out, "eval_exact_match")
    proc = train(*extraction_args(tiny_llama, out, "eval_metric=exact_match", "max_steps=6",
                                  "resume_from_checkpoint=true", "overwrite_output_dir=true"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record, logged = scores_and_log(out, "eval_exact_match")
    assert [s["step"] for s in record["scores"]] == [2, 4, 6] == sorted(logged)
    assert record["scores"][:2] == first["scores"]
    assert {s["step"]: s["value"] for s in record["scores"]} == logged


JUDGED = [{"instruction": f"Say something nice about the number {i}.", "output": f"{i} is a good number."}
          for i in range(12)]


@pytest.mark.slow
def test_judge_metric_asks_the_endpoint_at_each_save(tiny_llama, tmp_path):
    """eval_metric judge: at each save the judge (tests/fake_teacher.py: prefers the answer that says "good")
    compares each held-out answer with its reference in both orders; the score is the answers' win rate (x 100),
    the key never lands in the run folder."""
    from fake_teacher import KEY, FakeTeacher, no_key_under

    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.json").write_text(json.dumps(JUDGED))
    (data / "dataset_info.json").write_text(json.dumps({"judged": {"file_name": "rows.json"}}))
    judge = FakeTeacher(mode="judge_word", key=KEY).start()
    try:
        out = tmp_path / "run"
        env = dict(os.environ, JUDGE_TEST_KEY=KEY)
        proc = subprocess.run(TUNEBOARD + ["train", f"model_name_or_path={tiny_llama}", f"output_dir={out}",
                                           "template=llama3", f"dataset_dir={data}", "dataset=judged", "val_size=3",
                                           "cutoff_len=128", "per_device_train_batch_size=2", "max_steps=2",
                                           "save_steps=1", "max_new_tokens=4", "plot_loss=false",
                                           "eval_metric=judge", f"judge_url={judge.url}", "judge_model=judge-model",
                                           "judge_api_key_env=JUDGE_TEST_KEY"],
                              cwd="/tmp", capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        record, logged = scores_and_log(out, "eval_judge")
        assert [s["step"] for s in record["scores"]] == [1, 2] == sorted(logged)
        # the tiny model's 4 new tokens never say "good" and every reference does: the references win each pair
        assert all(s["value"] == 0.0 for s in record["scores"])
        orders = {("good" in r["body"]["messages"][-1]["content"].split("</answer_a>")[0]) for r in judge.requests}
        assert orders == {True, False}  # the reference shown first and second
        # one test pair before training, then two orders x three rows x two saves (the cache may answer some)
        assert len(judge.requests) <= 1 + 2 * 3 * 2
        assert "Is the sky blue" in judge.requests[0]["body"]["messages"][-1]["content"]
        no_key_under(out)
        assert KEY not in proc.stdout + proc.stderr
    finally:
        judge.stop()


def judge_run(model: Path, out: Path, judge_url: str, key: str) -> tuple[subprocess.CompletedProcess, str]:
    """A run with eval_metric judge on JUDGED; (process, its running log)."""
    data = out.parent / "data"
    data.mkdir(exist_ok=True)
    (data / "rows.json").write_text(json.dumps(JUDGED))
    (data / "dataset_info.json").write_text(json.dumps({"judged": {"file_name": "rows.json"}}))
    proc = subprocess.run(TUNEBOARD + ["train", f"model_name_or_path={model}", f"output_dir={out}", "template=llama3",
                                       f"dataset_dir={data}", "dataset=judged", "val_size=3", "cutoff_len=128",
                                       "max_steps=2", "save_steps=1", "max_new_tokens=4", "eval_metric=judge",
                                       f"judge_url={judge_url}", "judge_model=judge-model",
                                       "judge_api_key_env=JUDGE_TEST_KEY"],
                          cwd="/tmp", capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JUDGE_TEST_KEY=key))
    return proc, (out / RUNNING_LOG).read_text()


def test_a_judge_that_refuses_the_key_or_does_not_answer_fails_before_training(tiny_llama, tmp_path):
    """eval_metric judge asks the judge one test pair before the model loads: a refused key or an endpoint that
    does not answer fails the run there, in one line naming the key's variable or judge_url (not at the first save,
    nor a run that trains to its end with no score)."""
    from fake_teacher import KEY, FakeTeacher

    judge = FakeTeacher(mode="judge_word", key=KEY).start()
    try:
        proc, log = judge_run(tiny_llama, tmp_path / "refused", judge.url, key="sk-wrong-0123456789")
    finally:
        judge.stop()
    assert proc.returncode == 1, log
    failed = [line for line in log.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "before training" in failed[0] and "HTTP 401" in failed[0], log
    assert "$JUDGE_TEST_KEY" in failed[0] and "sk-wrong" not in log
    assert len(judge.requests) == 1 and not list((tmp_path / "refused").glob("checkpoint-*"))
    assert "trainable parameters" not in log and "Traceback" not in proc.stderr

    proc, log = judge_run(tiny_llama, tmp_path / "down", "http://127.0.0.1:9/v1", key=KEY)
    assert proc.returncode == 1, log
    failed = [line for line in log.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "judge_url http://127.0.0.1:9/v1: no answer to a test request" in failed[0], log
    assert not list((tmp_path / "down").glob("checkpoint-*")) and "trainable parameters" not in log


def test_a_json_metric_on_plain_answers_fails_before_tokenizing(tiny_llama, tmp_path):
    """A JSON task metric whose held-out answers are not JSON is refused right after the data is loaded: before
    tokenizing, the model or any step."""
    out = tmp_path / "plain"
    proc = train(f"model_name_or_path={tiny_llama}", f"output_dir={out}", "template=llama3", "dataset=identity",
                 "val_size=8", "eval_samples=4", "eval_metric=json_field_f1", "max_steps=2", "overwrite_cache=true")
    log = (out / RUNNING_LOG).read_text()
    assert proc.returncode == 1, log
    failed = [line for line in log.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "none of the 4 held-out answers is a JSON object" in failed[0], log
    assert "train rows:" not in log and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_processes_score_on_rank_zero_and_load_the_same_best(tiny_llama, tmp_path):
    """DDP on the CPU (gloo, launched by tuneboard train): rank 0 scores, the other rank waits at the broadcast;
    one line per save in the logs, and the final adapter is the best checkpoint's."""
    out = tmp_path / "ddp"
    proc = train(*extraction_args(tiny_llama, out, "per_device_train_batch_size=1", "nproc_per_node=2",
                                  "eval_metric=exact_match", "load_best_model_at_end=true"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record, logged = scores_and_log(out, "eval_exact_match")
    assert [s["step"] for s in record["scores"]] == [2, 4, 6] == sorted(logged)
    lines = [json.loads(x) for x in (out / LOG_FILE).read_text().splitlines()]
    assert sum(1 for r in lines if "eval_seconds" in r) == 3
    adapter = "adapter_model.safetensors"
    assert same(weights(out, adapter), weights(out / record["best"]["checkpoint"], adapter))


def _settles_the_same(answer: str, stop_words: list[str]) -> None:
    """Wherever answer_settled stops a prefix of `answer`, the prefix (cut and stripped as generate() does) scores
    what the whole answer scores, by every JSON metric."""
    from backend.core.metrics import field_counts
    from backend.evaluation.task_metric import answer_settled, score

    def final(text):
        for word in stop_words:
            text = text.split(word)[0]
        return text.strip()

    ref = '{"name": "Ada", "tags": ["a}", "b"]}'
    whole = final(answer)
    stops = [n for n in range(len(answer) + 1) if answer_settled(answer[:n], stop_words, json_answer=True)]
    for n in stops:  # the first is where generation stops; every later prefix too
        cut = final(answer[:n])
        assert field_counts(cut, ref) == field_counts(whole, ref), (answer, n)
        assert all(score(m, [cut], [ref]) == score(m, [whole], [ref]) for m in ("json_valid", "schema_valid"))
    return stops[0] if stops else None


def test_an_answer_settles_once_no_later_token_changes_its_score():
    """answer_settled: a JSON answer stops at the first non-blank character after its top-level value closes (it can
    no longer parse), never inside a string, never on the blank or a stop word's first characters after the close;
    an answer that cannot begin JSON stops at once; a stop word settles any answer; and the score of the prefix it
    stops at is the whole answer's."""
    from backend.evaluation.task_metric import answer_settled

    words = ["<|eot_id|>", "\n\nUser:"]
    valid = '{"name": "Ada", "tags": ["a}", "b"]}'
    assert _settles_the_same(valid + "\n\n", words) is None  # blank after the close: still valid, generation goes on
    assert _settles_the_same(valid + " <|eot_id|> junk", words) == len(valid) + len(" <|eot_id|>")
    assert _settles_the_same(valid + "\n\nUser: more", words) == len(valid) + len("\n\nUser:")
    assert _settles_the_same(valid + "\n\nUsed {", words) == len(valid) + len("\n\nUsed")  # not the stop word
    assert _settles_the_same(valid + ' {"name": "Bob"}', words) == len(valid) + 2  # a second value: not JSON
    assert _settles_the_same("Sure: " + valid, words) == 1
    assert _settles_the_same("  " + valid[:-1] + "x" * 20, words) is None  # never closed: runs to the cap
    for start in ("```json\n" + valid + "\n```", '"just a string"', "42", "true", "null"):
        assert _settles_the_same(start + " x", words) != 1  # JSON (or a fence) may begin this way
    assert not answer_settled('{"a": "x} y', words, json_answer=True)  # the brace is inside a string
    assert not answer_settled(valid + "\ufffd", words, json_answer=True)  # half a character: may be a blank
    assert answer_settled("plain text <|eot_id|>", words, json_answer=False)
    assert not answer_settled(valid + " more", words, json_answer=False)  # other metrics: only a stop word settles


def test_a_json_answer_stops_where_it_settles_and_scores_the_same(tiny_llama):
    """generate(settled=...) with a tiny model made to write set answers (greedy, one batch): the row that closes
    its JSON and ends is whole; the rows whose answers cannot be JSON any more stop there, shorter than without
    the stop, while the other rows go on; every JSON metric scores both runs the same."""
    import torch
    from functools import partial
    from transformers import LogitsProcessor, LogitsProcessorList
    from backend.training.models import load_model, load_tokenizer, resolve_model
    from backend.evaluation.predict import generate, generation_kwargs
    from backend.evaluation.task_metric import JSON_METRICS, answer_settled, score
    from backend.dataprep.resolve import pick_template

    spec = validate_spec({"model_name_or_path": str(tiny_llama), "max_new_tokens": 40, "template": "llama3"},
                         check_files=False)
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer)
    model = load_model(spec, resolved, for_training=False).eval()
    ref = '{"name": "Ada", "age": 3}'
    filler = tokenizer(" x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x",
                       add_special_tokens=False).input_ids
    scripts = [tokenizer(ref, add_special_tokens=False).input_ids + [tokenizer.eos_token_id],
               tokenizer(ref + ' {"name": "Bob"}', add_special_tokens=False).input_ids + filler,
               tokenizer("Sure: " + ref, add_special_tokens=False).input_ids + filler]

    class Script(LogitsProcessor):  # the model writes each row's script, token by token
        width = None

        def __call__(self, input_ids, scores):
            self.width = self.width or input_ids.shape[1]
            step = input_ids.shape[1] - self.width
            forced = torch.full_like(scores, -float("inf"))
            for row, script in enumerate(scripts):
                forced[row, script[min(step, len(script) - 1)]] = 0.0
            return forced

    prompts = [template.render_text([{"role": "user", "content": f"Extract {i}"}], None, add_generation_prompt=True)
               for i in range(3)]
    kwargs = generation_kwargs(spec, tokenizer, template, greedy=True)
    settled = partial(answer_settled, stop_words=list(template.stop_words), json_answer=True)
    full = generate(model, tokenizer, template, prompts, dict(kwargs, logits_processor=LogitsProcessorList([Script()])))
    cut = generate(model, tokenizer, template, prompts, dict(kwargs, logits_processor=LogitsProcessorList([Script()])),
                   settled=settled)
    assert full[0] == cut[0] == ref
    assert cut[1].startswith(ref) and len(cut[1]) < len(ref) + 6 < len(full[1])
    assert len(cut[2]) < 8 < len(full[2])
    for metric in JSON_METRICS:
        assert score(metric, cut, [ref] * 3) == score(metric, full, [ref] * 3), metric
    assert score("json_valid", cut, [ref] * 3) == pytest.approx(100 / 3)


def test_decode_threads_keep_the_faster_setting_and_restore_torchs():
    """DecodeThreads times PROBE decode steps with torch's thread count, then PROBE with one thread, keeps the
    faster for the rest of the call and gives torch its setting back (a made-up clock: no timing here)."""
    import torch
    from backend.evaluation.predict import DecodeThreads

    before = torch.get_num_threads()
    try:
        for cost, expect in (({2: 5.0, 1: 1.0}, 1), ({2: 1.0, 1: 5.0}, 2)):
            torch.set_num_threads(2)
            now = [0.0]
            tuner = DecodeThreads(clock=lambda: now[0])
            ids = torch.zeros((3, 4), dtype=torch.long)
            for _ in range(3 * DecodeThreads.PROBE + 6):
                assert not tuner(ids, None).any()  # never stops a row
                now[0] += cost[torch.get_num_threads()]  # the next decode step, at the thread count now set
            assert tuner.chosen == expect and torch.get_num_threads() == expect
            assert tuner.timed == {2: [cost[2]] * DecodeThreads.PROBE, 1: [cost[1]] * DecodeThreads.PROBE}
            tuner.restore()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_generation_with_the_decode_thread_choice_gives_the_same_answers(tiny_llama, monkeypatch):
    """generate() with the CPU decode-thread choice (two threads probed against one, then the faster kept) gives
    the same greedy answers as with torch's setting throughout, and leaves torch's setting as it was."""
    import torch
    from backend.evaluation.evaluate import eval_examples
    from backend.training.models import load_model, load_tokenizer, resolve_model
    from backend.evaluation import predict
    from backend.evaluation.predict import DecodeThreads, generate, generation_kwargs, split_prompt
    from backend.dataprep.resolve import pick_template

    made = []

    class Seen(DecodeThreads):  # the tuner generate() makes, kept to see that it probed both settings
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(predict, "DecodeThreads", Seen)
    spec = validate_spec({"model_name_or_path": str(tiny_llama), "dataset": "extraction_demo", "max_samples": 8,
                          "max_new_tokens": 3 * DecodeThreads.PROBE + 6, "template": "llama3"}, check_files=False)
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer)
    model = load_model(spec, resolved, for_training=False).eval()
    prompts = [template.render_text(split_prompt(e)[0], None, add_generation_prompt=True)
               for e in eval_examples(spec, log=lambda *a: None)[:4]]
    kwargs = generation_kwargs(spec, tokenizer, template, greedy=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        plain = generate(model, tokenizer, template, prompts, kwargs, tune_threads=False)
        assert generate(model, tokenizer, template, prompts, kwargs) == plain
        assert torch.get_num_threads() == 2
        assert len(made) == 1 and made[0].chosen in (1, 2) and all(len(v) == DecodeThreads.PROBE
                                                                  for v in made[0].timed.values())
        torch.set_num_threads(1)
        assert generate(model, tokenizer, template, prompts, kwargs, tune_threads=False) == plain
    finally:
        torch.set_num_threads(before)
    assert all(plain)
