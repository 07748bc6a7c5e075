"""Evaluate tab: "compare with adapter" runs the same rows with two adapters on one base (an SFT adapter and the
GRPO run that continued it) and puts their metrics and predictions side by side (no eval process here)."""
from __future__ import annotations

import pandas as pd

from webui.tabs import evaluate


def flat(adapter):
    return evaluate.eval_flat("HuggingFaceTB/SmolLM2-135M-Instruct", adapter, "lora", None, "auto",
                              ["extraction_demo"], 20, 128)


def adapter_folder(root, name: str) -> str:
    """An adapter folder (validate checks that each adapter path is one; nothing loads it here)."""
    (root / name).mkdir(parents=True)
    (root / name / "adapter_config.json").write_text("{}")
    return str(root / name)


def test_two_adapters_become_two_named_parts(root):
    sft, grpo = adapter_folder(root, "m/lora/sft-extract"), adapter_folder(root, "m/lora/grpo-extract/checkpoint-20")
    parts, why = evaluate.plan(flat(sft), False, grpo)
    assert why == "" and [p["name"] for p in parts] == ["sft-extract", "grpo-extract-checkpoint-20"]
    assert [p["adapter"] for p in parts] == [sft, grpo]
    assert parts[0]["dir"] != parts[1]["dir"]
    assert evaluate.part_names("/a/run", "/b/run") == ("run", "run-2")
    # without an adapter in the top bar, or the same one twice, or one that is not there: refused with the reason
    assert evaluate.plan(flat(""), False, "/x/grpo")[0] is None
    assert "top bar too" in evaluate.plan(flat(""), False, "/x/grpo")[1]
    assert "pick another one" in evaluate.plan(flat(sft), False, sft)[1]
    assert f"{root / 'gone'} does not exist" in evaluate.plan(flat(sft), False, str(root / "gone"))[1]
    # no second adapter: base vs tuned as before
    assert [p["name"] for p in evaluate.plan(flat(sft), True)[0]] == ["tuned", "base"]


def test_side_by_side_metrics_and_rows_name_both_adapters():
    st = evaluate.new_state()
    st["parts"] = [{"name": "sft", "dir": "/x/sft", "adapter": "a"}, {"name": "grpo", "dir": "/x/grpo", "adapter": "b"}]
    st["spec"] = {"eval_dataset": "extraction_demo"}
    st["results"] = {"sft": {"predict_json_valid": 80.0, "predict_json_field_f1": 61.5},
                     "grpo": {"predict_json_valid": 95.0, "predict_json_field_f1": 70.25}}
    st["rows"] = {"sft": [{"index": 0, "prompt": "q", "label": "{}", "predict": "{", "rouge-l": 10.0}],
                  "grpo": [{"index": 0, "prompt": "q", "label": "{}", "predict": "{}", "rouge-l": 100.0}]}
    metrics = evaluate.metrics_frame(st)
    assert list(metrics.columns) == ["metric", "sft", "grpo"]
    by_metric = {r.metric: (r.sft, r.grpo) for r in metrics.itertuples()}
    assert by_metric["json_valid"] == ("80", "95") and by_metric["json_field_f1"] == ("61.5", "70.25")
    rows = evaluate.rows_frame(st, False)
    assert isinstance(rows, pd.DataFrame) and rows["grpo prediction"].tolist() == ["{}"]
