"""Evaluate tab with a reward model in the top bar (stage rm's output): the tab knows it from the adapter's /
model's JSON files alone, runs `tuneboard eval` with stage rm on a ranking dataset, offers no compare with
base, and shows the scored pairs (chosen score, rejected score, margin, correct) and pairwise accuracy.

The eval job is a real subprocess launched by the tab's own start function; only the program it runs is a
stand-in (FAKE_EVAL writes the files `tuneboard eval stage=rm` writes, in backend.stages.rm.write_scores'
format), so no model is loaded."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from waiting import wait_for
from webui import jobs, tools
from webui.tabs import evaluate

FAKE_EVAL = r'''
import json, os, sys
from pathlib import Path
import yaml
spec = yaml.safe_load(Path(sys.argv[2]).read_text())
out = Path(spec["output_dir"])
assert spec["stage"] == "rm", spec  # a reward model is evaluated as one
rows = [{"index": 0, "source": "dpo_en_demo", "row": 3, "question": "Name a colour.", "chosen": "Blue.",
         "rejected": "Seven.", "chosen_score": 1.5, "rejected_score": -0.5, "margin": 2.0, "correct": True},
        {"index": 1, "source": "dpo_en_demo", "row": 7, "question": "Say hello.", "chosen": "Hello!",
         "rejected": "Go away.", "chosen_score": 0.25, "rejected_score": 0.75, "margin": -0.5, "correct": False}]
(out / "generated_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(out / "eval_results.json").write_text(json.dumps({"rows": 2, "eval_accuracy": 0.5, "eval_margin": 0.75,
    "eval_rewards/chosen": 0.875, "eval_rewards/rejected": 0.125, "eval_pairs": 2, "seconds": 1.0}))
(out / "status.json").write_text(json.dumps({"state": "completed", "step": 2, "total_steps": 2}))
print("eval done", flush=True)
'''


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A base model folder, a reward adapter (task_type SEQ_CLS) and a causal LM adapter, and a saves folder
    whose `tuneboard` is FAKE_EVAL."""
    cli = tmp_path / "fake_eval.py"
    cli.write_text(FAKE_EVAL)
    monkeypatch.setattr(jobs, "tuneboard_argv", lambda: [sys.executable, str(cli)])
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path / "saves"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    adapters = {}
    for name, task in (("rm", "SEQ_CLS"), ("sft", "CAUSAL_LM")):
        d = tmp_path / "saves" / name
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"task_type": task, "base_model_name_or_path": str(model)}))
        adapters[name] = str(d)
    return str(model), adapters


def test_a_reward_adapter_switches_the_form_to_pairs(setup):
    model, adapters = setup
    note, compare, max_new, dataset = evaluate.reward_mode_update(model, adapters["rm"], ["identity"])
    assert note["visible"] and "Reward model" in note["value"] and "`dpo_en_demo`" in note["value"]
    assert compare == {"__type__": "update", "visible": False, "value": False}  # the base has no score head
    assert max_new["visible"] is False  # nothing is generated
    assert dataset["value"] == ["dpo_en_demo"]  # a ranking dataset replaces the conversations
    kept = evaluate.reward_mode_update(model, adapters["rm"], ["dpo_en_demo"])[3]
    assert kept is not None and "value" not in kept  # a ranking dataset picked already stays
    # back to a causal LM adapter: the plain form, and a dataset it can use
    note, compare, max_new, dataset = evaluate.reward_mode_update(model, adapters["sft"], ["dpo_en_demo"])
    assert note["visible"] is False and compare["visible"] and max_new["visible"]
    assert dataset["value"] == ["identity"]
    assert "value" not in evaluate.reward_mode_update(model, adapters["sft"], ["alpaca_en_demo"])[3]


def test_a_reward_model_eval_is_planned_with_stage_rm(setup):
    model, adapters = setup
    flat = evaluate.eval_flat(model, adapters["rm"], "lora", "none", "auto", ["dpo_en_demo"], 5, 64)
    assert flat["stage"] == "rm" and flat["eval_dataset"] == flat["dataset"] == "dpo_en_demo"
    assert "max_new_tokens" not in flat and "do_sample" not in flat  # keys that would do nothing
    parts, why = evaluate.plan(flat, True)
    assert parts is None and "score head" in why
    wrong = evaluate.eval_flat(model, adapters["rm"], "lora", "none", "auto", ["identity"], 5, 64)
    parts, why = evaluate.plan(wrong, False)
    assert parts is None and "ranking dataset" in why and "identity" in why
    held = evaluate.eval_flat(model, adapters["rm"], "lora", "none", "auto", ["dpo_en_demo"], 5, 64, 0.25)
    assert held["stage"] == "rm" and held["val_size"] == 0.25 and held["eval_dataset"] is None
    plain = evaluate.eval_flat(model, adapters["sft"], "lora", "none", "auto", ["identity"], 5, 64)
    assert "stage" not in plain and plain["max_new_tokens"] == 64
    # a full reward model folder (no adapter) is one too
    full = Path(adapters["rm"]).parent / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                  "id2label": {"0": "LABEL_0"}}))
    assert evaluate.eval_flat(str(full), "", "lora", "none", "auto", ["dpo_en_demo"], 5, 64)["stage"] == "rm"


def test_a_reward_model_eval_runs_and_shows_scored_pairs(setup):
    model, adapters = setup
    flat = evaluate.eval_flat(model, adapters["rm"], "lora", "none", "auto", ["dpo_en_demo"], 5, 64)
    st, message, started = evaluate.start_eval(evaluate.new_state(), flat, False)
    assert started, message
    assert "reward model" in message and "pairs" in message
    part = st["parts"][0]
    assert part["name"] == "tuned" and tools.read_tool_spec(part["dir"])["stage"] == "rm"
    wait_for(lambda: not tools.alive(part["dir"]), what="eval end")
    _, bar, message, metrics, rows, _, timer = evaluate.poll(st, False)
    assert 'data-state="completed"' in bar and "2 pairs" in message and "pairwise accuracy 0.500" in message
    assert metrics.values.tolist()[:4] == [["eval_accuracy", "0.5"], ["eval_margin", "0.75"],
                                           ["eval_rewards/chosen", "0.875"], ["eval_rewards/rejected", "0.125"]]
    frame = rows["value"]
    assert list(frame.columns) == evaluate.PAIR_COLUMNS
    assert frame.values.tolist() == [[0, "Name a colour.", "Blue.", "Seven.", "1.5", "-0.5", "2", "✓"],
                                     [1, "Say hello.", "Hello!", "Go away.", "0.25", "0.75", "-0.5", "✗"]]
    assert rows["column_widths"] and len(rows["column_widths"]) == len(evaluate.PAIR_COLUMNS)
    assert evaluate.rows_frame(st, worst_first=True)["#"].tolist() == [1, 0]  # the wrongly ranked pair first
    detail = evaluate.row_detail(st, 1)
    assert "Pair 1" in detail and "Go away." in detail and "score 0.75" in detail and "✗" in detail
    # a reload picks it up again as a reward model eval
    again = evaluate.attach(tools.find_job("eval"))
    assert evaluate.is_rm(again["spec"]) and "Reward model eval" in evaluate.attached_message(again)
