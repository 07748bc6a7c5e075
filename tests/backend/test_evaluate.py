"""Evaluate & Predict: metrics on a fixed set computed by hand, loss against a direct computation,
predictions streamed one line per row."""
import json
import math

import pytest

from backend.core import metrics


def test_rouge_exact_match_and_json_fields_by_hand():
    preds = ["the cat sat on the mat", "hello world", '{"a": 1, "b": "x"}']
    refs = ["the cat sat on the mat", "hello there world", '{"a": 1, "b": "y", "c": 2}']
    m = metrics.compute(preds, refs)
    # row F-measures: rouge-1 1, 0.8 (P 1, R 2/3), 0.6 (a 1 b: P 3/4, R 3/6); rouge-2 1, 0, 0.5 (P 2/3, R 2/5)
    assert m["rouge-1"] == pytest.approx(100 * (1 + 0.8 + 0.6) / 3)
    assert m["rouge-2"] == pytest.approx(100 * (1 + 0 + 0.5) / 3)
    assert m["rouge-l"] == pytest.approx(100 * (1 + 0.8 + 0.6) / 3)
    assert m["exact_match"] == pytest.approx(100 / 3)
    # only the third reference is JSON: leaves a=1 (match), b ("x" vs "y"), c missing -> P 1/2, R 1/3, F1 0.4
    assert m["json_rows"] == 1 and m["json_valid"] == 100
    assert (m["json_field_precision"], m["json_field_recall"]) == (pytest.approx(50), pytest.approx(100 / 3))
    assert m["json_field_f1"] == pytest.approx(40)


def test_bleu4_by_hand():
    # every n-gram of the prediction is in the reference (precisions 5/5, 4/4, 3/3, 2/2); brevity penalty
    # exp(1 - 6/5) for 5 predicted words against 6
    assert metrics.corpus_bleu(["a b c d e"], ["a b c d e f"]) == pytest.approx(100 * math.exp(-0.2), abs=1e-3)
    assert metrics.corpus_bleu(["same words here ok"], ["same words here ok"]) == pytest.approx(100)


def test_json_parsing_and_fields():
    assert metrics.parse_json('```json\n{"x": [1, 2]}\n```') == (True, {"x": [1, 2]})
    assert metrics.parse_json("{broken") == (False, None)
    assert metrics.flatten({"a": {"b": 1}, "c": [2, {"d": 3}]}) == {("a", "b"): 1, ("c", 0): 2, ("c", 1, "d"): 3}
    # an invalid prediction has no fields: precision 0, recall 0 of 2
    assert metrics.field_counts("not json", '{"a": 1, "b": 2}') == {"valid": 0, "matched": 0, "predicted": 0,
                                                                  "expected": 2}
    # strings compare trimmed and case-insensitively, numbers by value, booleans strictly
    assert metrics.field_counts('{"a": " Red ", "n": 2.0, "t": 1}', '{"a": "red", "n": 2, "t": true}')["matched"] == 2
    assert metrics.field_counts("anything", "plain text") is None
    assert metrics.words("Hello, 世界 world!") == ["hello", "世", "界", "world"]


@pytest.fixture()
def tiny_dataset(tmp_path):
    rows = [{"instruction": "Give JSON for a red pen.", "output": '{"item": "pen", "color": "red"}'},
            {"instruction": "Say hello.", "output": "Hello there!"},
            {"instruction": "Count to three.", "output": "One, two, three."}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"tiny_eval": {"file_name": "rows.json"}}))
    return tmp_path


def test_eval_run_loss_and_streamed_predictions(tiny_llama, tiny_dataset, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backend.evaluation.evaluate import PREDICTIONS_FILE, RESULTS_FILE, predict, run
    from backend.dataprep.preprocess import build_sft_dataset
    from backend.core.spec import validate_spec
    from backend.dataprep.templates import get_template

    out = tmp_path / "eval"
    spec = validate_spec({"model_name_or_path": str(tiny_llama), "template": "llama3", "finetuning_type": "full",
                          "dataset_dir": str(tiny_dataset), "dataset": "tiny_eval", "eval_dataset": "tiny_eval", "output_dir": str(out),
                          "max_new_tokens": 4, "per_device_eval_batch_size": 2})
    assert run(spec) == 0
    results = json.loads((out / RESULTS_FILE).read_text())
    lines = [json.loads(x) for x in (out / PREDICTIONS_FILE).read_text().splitlines()]
    assert [r["label"] for r in lines] == ['{"item": "pen", "color": "red"}', "Hello there!", "One, two, three."]
    assert {"prompt", "predict", "bleu-4", "rouge-l", "exact_match"} <= set(lines[0]) and "field_f1" in lines[0]
    assert results["predict_rows"] == 3 and results["predict_json_rows"] == 1
    assert json.loads((out / "status.json").read_text())["state"] == "completed"

    # eval loss = token-weighted mean cross-entropy over the assistant tokens, computed here directly
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    template = get_template("llama3", tok)
    examples = [{"messages": [{"role": "user", "content": r["instruction"]},
                              {"role": "assistant", "content": r["output"]}]}
                for r in json.loads((tiny_dataset / "rows.json").read_text())]
    rows, _ = build_sft_dataset(examples, template, tok, 1024)
    total = count = 0
    with torch.no_grad():
        for row in rows:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            count += n
    assert results["eval_tokens"] == count
    assert results["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert results["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)

    # streamed: when row n is reported, the file already holds n complete lines
    seen = []

    def progress(n, total_rows, row):
        seen.append((n, len((tmp_path / "stream.jsonl").read_text().splitlines())))

    predict(model, tok, template, examples, tmp_path / "stream.jsonl", spec, progress)
    assert seen == [(1, 1), (2, 2), (3, 3)]


def test_eval_stopped_by_sigterm_keeps_and_scores_the_finished_rows(tiny_llama, tmp_path):
    """`tuneboard eval` in a subprocess, SIGTERM after two rows: exit 130, status aborted, and
    eval_results.json scores exactly the rows whose predictions were written (no half-generated row)."""
    import signal
    import subprocess
    import sys

    from backend.core.paths import REPO_ROOT
    from waiting import wait_for

    rows = [{"instruction": f"Write a long story number {i}.", "output": "Once upon a time."} for i in range(40)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"many": {"file_name": "rows.json"}}))
    out = tmp_path / "eval"
    proc = subprocess.Popen([sys.executable, "-m", "backend.cli", "eval", f"model_name_or_path={tiny_llama}",
                             "template=llama3", "finetuning_type=full", f"dataset_dir={tmp_path}",
                             "dataset=many", "eval_dataset=many", f"output_dir={out}", "do_predict=true", "max_new_tokens=300"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status = out / "status.json"
        wait_for(lambda: proc.poll() is not None or (status.exists() and
                                                      json.loads(status.read_text()).get("step", 0) >= 2),
                 timeout=300, what="two rows predicted")
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    st = json.loads(status.read_text())
    assert st["state"] == "aborted" and st["stop_reason"] == "received SIGTERM"
    written = (out / "generated_predictions.jsonl").read_text().splitlines()
    results = json.loads((out / "eval_results.json").read_text())
    assert 2 <= len(written) < 40 and results["predict_rows"] == len(written)
    assert results["stopped"] == "received SIGTERM"


def test_a_val_size_that_takes_every_row_evaluates_them_all():
    """eval needs only the held-out rows: `max_samples=4 val_size=8` (or a dataset with 6 usable rows and val_size 6)
    stopped the eval after launch with "leaves no training rows"; every row is evaluated, and the log says why. A
    val_size below the row count holds out the rows a training run would."""
    from backend.core.spec import validate_spec
    from backend.dataprep.data import split_train_val
    from backend.evaluation.evaluate import eval_examples

    for val_size in (8, 4, 0.99):
        said: list[str] = []
        spec = validate_spec({"dataset": "identity", "max_samples": 4, "val_size": val_size}, check_files=False)
        assert len(eval_examples(spec, log=said.append)) == 4
        assert [line for line in said if line.startswith(f"val_size {val_size:g} holds out all 4 usable rows")]
    spec = validate_spec({"dataset": "identity", "max_samples": 4, "val_size": 3}, check_files=False)
    rows = eval_examples(spec, log=lambda line: None)
    everything = eval_examples(validate_spec({"dataset": "identity", "max_samples": 4}, check_files=False),
                               log=lambda line: None)
    assert rows == split_train_val(everything, 3, spec.seed)[1] and len(rows) == 3
