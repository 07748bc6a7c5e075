"""Export / Evaluate tab logic without a browser: reading `tuneboard export` output (steps, outcome, checks),
eval results and predictions into tables (worst rows first, base vs tuned), refusals before anything is
launched, and stopping a tool process group."""
from __future__ import annotations

import json
import sys
import time

from webui import jobs, tools
from webui.tabs import evaluate, export

EXPORT_OUTPUT = """[export 1/6] checking the request
[export 2/6] loading tiny in float32 from /m
Loading weights:   0%|          | 0/21\rLoading weights: 100%|##########| 21/21
[export 5/6] verifying: reloading the export in a fresh process
  ok   logits: max |export - (base+adapter)| logit difference 3.58e-07 (tolerance 0.001)
  FAIL greedy: greedy continuation: 30/36 tokens agree
export FAILED verification: greedy: greedy continuation: 30/36 tokens agree
""".strip("\n").split("\n")  # not splitlines(): that also splits at the \r


def test_export_progress_outcome_and_checks_from_the_output():
    assert tools.export_progress([]) == (0, 6, "")
    assert tools.export_progress(EXPORT_OUTPUT) == (5, 6, "verifying: reloading the export in a fresh process")
    assert tools.clean_line(EXPORT_OUTPUT[2]).startswith("Loading weights: 100%")
    assert tools.export_outcome(EXPORT_OUTPUT[:-1]) == (None, "")
    assert tools.export_outcome(EXPORT_OUTPUT)[0] == "failed"
    assert tools.export_outcome(["export PASSED: /x (model.safetensors)"]) == ("passed", "export PASSED: /x (model.safetensors)")
    # no report written: the checks come from the ok/FAIL lines
    assert tools.checks_rows({}, EXPORT_OUTPUT) == [
        ["logits", "✓ ok", "max |export - (base+adapter)| logit difference 3.58e-07 (tolerance 0.001)", ""],
        ["greedy", "✗ FAIL", "greedy continuation: 30/36 tokens agree", ""]]
    report = {"checks": [{"name": "logits", "ok": True, "detail": "d", "figures": {"max_diff": 3.5812e-07}}]}
    assert tools.checks_rows(report, EXPORT_OUTPUT) == [["logits", "✓ ok", "d", "max_diff=3.581e-07"]]


def test_export_spec_and_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path))
    flat = export.export_flat("/models/tiny", "/saves/run-a", "lora", "default", "", "gguf", "q8_0", 2, "cpu", False)
    assert flat["export_dir"].startswith(str(tmp_path / "exports" / "tiny-run-a" / "gguf"))
    assert (flat["export_format"], flat["export_gguf_type"]) == ("gguf", "q8_0") and "export_size" not in flat
    # each format's own field only: a hidden box keeps its value, and validate refuses the other format's key
    safetensors = export.export_flat("m", None, "full", "default", "", "safetensors", "q8_0", 2, "cpu", False)
    assert safetensors["export_size"] == 2 and "export_gguf_type" not in safetensors
    assert "export_imatrix" not in flat
    # the importance-matrix box counts where it is offered (the types llama.cpp quantizes), not when hidden
    assert "export_imatrix" not in export.export_flat("m", None, "full", "default", "", "gguf", "q8_0", 2, "cpu", False, True)
    assert export.export_flat("m", None, "full", "default", "", "gguf", "q4_k_m", 2, "cpu", False, True)["export_imatrix"]
    assert not export.imatrix_offered("safetensors", "q4_k_m") and export.imatrix_offered("gguf", "q6_k")
    st = export.new_state()
    no_adapter = dict(flat, adapter_name_or_path=None)
    st2, msg, started = export.start_export(st, no_adapter)
    assert not started and "adapter" in msg.lower() and st2 is st
    st2, msg, started = export.start_export(st, dict(flat, export_size=0))
    assert not started and "export_size" in msg
    assert not (tmp_path / ".tools").exists()  # nothing launched


def test_eval_plan_refusals_and_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path))
    model = tmp_path / "m"  # validate checks that a model path holds a model
    model.mkdir()
    (model / "config.json").write_text("{}")
    flat = evaluate.eval_flat(str(model), "", "lora", "none", "auto", [], 3, 8)
    assert evaluate.plan(flat, False)[0] is None and "dataset" in evaluate.plan(flat, False)[1]
    flat = evaluate.eval_flat(str(model), "", "lora", "none", "auto", ["identity", "alpaca_en_demo"], 3, 8)
    assert flat["eval_dataset"] == "identity,alpaca_en_demo" and flat["do_sample"] is False
    parts, why = evaluate.plan(flat, True)
    assert parts is None and "adapter" in why
    parts, _ = evaluate.plan(flat, False)
    assert [p["name"] for p in parts] == ["base"]
    adapter = tmp_path / "a"  # and an adapter path an adapter folder
    flat = evaluate.eval_flat(str(model), str(adapter), "lora", "4", "auto", ["identity"], 3, 8)
    assert evaluate.plan(flat, True)[0] is None and f"{adapter} does not exist" in evaluate.plan(flat, True)[1]
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert flat["quantization_bit"] == 4
    parts, _ = evaluate.plan(flat, True)
    assert [(p["name"], p["adapter"]) for p in parts] == [("tuned", str(adapter)), ("base", None)]
    assert parts[0]["dir"].startswith(str(tmp_path / ".tools" / "eval-"))


def _pred(i, score, pred):
    return {"index": i, "prompt": f"p{i}", "label": f"ref{i}", "predict": pred, "rouge-l": score,
            "bleu-4": score / 2, "exact_match": score == 100.0}


def test_eval_tables_worst_first_and_side_by_side(tmp_path):
    tuned, base = tmp_path / "tuned", tmp_path / "base"
    for d, rows, res in ((tuned, [_pred(0, 80.0, "good"), _pred(1, 10.0, "bad"), _pred(2, 100.0, "ref2")],
                          {"rows": 3, "eval_loss": 1.5, "predict_rouge-l": 63.3, "seconds": 4.0}),
                         (base, [_pred(0, 5.0, "b0"), _pred(1, 0.0, "b1")],
                          {"rows": 3, "eval_loss": 9.25, "predict_rouge-l": 1.7})):
        d.mkdir()
        (d / tools.PREDICTIONS).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"index": 9, "pre')
        (d / tools.EVAL_RESULTS).write_text(json.dumps(res))
    st = evaluate.new_state()
    st["parts"] = [{"name": "tuned", "dir": str(tuned), "adapter": "/a", "launched": True},
                   {"name": "base", "dir": str(base), "adapter": None, "launched": True}]
    st["results"] = {p["name"]: tools.read_results(p["dir"]) for p in st["parts"]}
    st["rows"] = {p["name"]: tools.read_predictions(p["dir"]) for p in st["parts"]}
    assert len(st["rows"]["tuned"]) == 3  # the unfinished last line is skipped
    m = evaluate.metrics_frame(st)
    assert list(m.columns) == ["metric", "tuned", "base"]
    assert m.values.tolist() == [["eval_loss", "1.5", "9.25"], ["rouge-l", "63.3", "1.7"]]
    rows = evaluate.rows_frame(st, worst_first=False)
    assert rows["#"].tolist() == [0, 1, 2]
    assert rows["base prediction"].tolist() == ["b0", "b1", ""]
    worst = evaluate.rows_frame(st, worst_first=True)
    assert worst["#"].tolist() == [1, 0, 2] and worst["rouge-l"].tolist() == [10.0, 80.0, 100.0]
    assert worst["exact"].tolist() == ["✗", "✗", "✓"]  # a miss says so (blank read as "not scored")


def test_stop_kills_the_tool_process_group(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    jobs.launch(job, [sys.executable, "-c", "import subprocess, sys, time; "
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    assert tools.alive(job)
    time.sleep(0.5)
    assert tools.stop(job, grace_s=2, wait=True)
    assert not tools.alive(job)
    assert tools.stop(job) is False
    assert tools.alive(None) is False
