"""eval_metric in the web UI (issue 20 item 1): the Train tab's task metric plot from what the run logged at each
save, the form's eval accordion offering the keys, and the pre-flight's scoring cost. Handcrafted run folders."""
from __future__ import annotations

import json

import yaml

from backend.core.spec import validate_spec
from webui import fields as F
from webui import jobs, live, preflight
from webui.tabs import train as T


def sft_run(root, name: str, records: list[dict]):
    d = root / name
    jobs.write_spec_yaml(d, yaml.safe_dump({"model_name_or_path": "m", "output_dir": str(d), "stage": "sft",
                                            "dataset": "extraction_demo", "val_size": 0.1,
                                            "eval_metric": "json_field_f1"}))
    (d / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = max(r["step"] for r in records)
    (d / "status.json").write_text(json.dumps({"state": "running", "step": steps, "total_steps": 40}))
    return d


def _plots(run_dir):
    st = T.attach(str(run_dir))
    out = T.view_updates(st, False)
    return st, dict(zip(live.plot_names(), out[4:4 + len(live.plot_names())]))


def test_train_tab_plots_the_task_metric_logged_at_each_save(root):
    losses = [{"step": s, "total_steps": 40, "loss": 2.0 - 0.01 * s} for s in range(1, 21)]
    scores = {10: 41.5, 20: 57.25}
    records = losses[:10] + [{"step": 10, "eval_json_field_f1": scores[10], "eval_seconds": 3.2}] + losses[10:] \
        + [{"step": 20, "eval_json_field_f1": scores[20], "eval_seconds": 3.1}]
    st, plots = _plots(sft_run(root, "scored", records))
    task = plots["task metric"]
    assert task["visible"] is True
    frame = task["value"]
    assert T.series_of(frame) == ["eval_json_field_f1"]
    assert dict(zip(frame.step, frame.value)) == scores
    assert st["series"]["task metric"] == ["eval_json_field_f1"]
    assert all(u["visible"] is False for name, u in plots.items() if name != "task metric")
    # before the first save the plot stays hidden (an sft run without eval_metric never shows it)
    _, early = _plots(sft_run(root, "early", losses[:5]))
    assert early["task metric"]["visible"] is False


def test_eval_accordion_offers_the_keys():
    rows = F.rows_by_name()
    for name in ("eval_metric", "eval_samples", "metric_for_best_model"):
        assert rows[name].group == "eval", name
    assert "json_field_f1" in (rows["eval_metric"].choices or [])
    names, top = [r.name for r in F.form_rows()], list(F.TOPBAR_FIELDS)
    spec = validate_spec({"eval_metric": "rouge_l", "val_size": 0.1, "eval_samples": 8, "load_best_model_at_end": True})
    flat, _ = T.collect(names, top, T.spec_to_inputs(spec, top, names))  # the form round-trips the keys
    assert flat["eval_metric"] == "rouge_l" and flat["eval_samples"] == 8 and flat["load_best_model_at_end"] is True
    assert validate_spec(flat).best_by_task_metric


def test_preflight_shows_the_scoring_cost():
    flat = {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "finetuning_type": "lora",
            "eval_metric": "json_field_f1", "eval_samples": 32, "max_steps": 40, "save_steps": 10,
            "per_device_eval_batch_size": 8, "max_new_tokens": 128}
    cost = preflight.scoring_cost(flat)
    assert cost == {"metric": "json_field_f1", "samples": 32, "tokens": 128, "saves": 4, "total_tokens": 32 * 128 * 4}
    md = preflight.summary_md(flat)
    assert "32 held-out rows" in md and "4 saves" in md and f"{32 * 128 * 4:,}" in md
    assert "one forward pass" in preflight.summary_md({**flat, "eval_metric": "eval_loss"})
    assert preflight.scoring_cost({**flat, "eval_metric": None}) is None
    assert "held-out" not in preflight.summary_md({**flat, "eval_metric": None})
    assert "每次保存" in preflight.scoring_md({**flat, "max_steps": -1}, "zh")
