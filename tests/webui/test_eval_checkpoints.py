"""The Evaluate tab's Checkpoints part: Start (the tab's own handler, as Gradio calls it) runs `tuneboard eval
checkpoints=all` on a real tiny LoRA run under the saves folder as the tab's background job; the part's view
builds the table (checkpoint x metric, ★ on the best) and the plot (metric by step) from the job's
checkpoint_eval.json, and Promote makes the picked checkpoint the run's adapter (backend/core/promote.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend.core.rundir import CHECKPOINT_EVAL_FILE, PROMOTION_FILE
from ui_handlers import form_args
from waiting import wait_for
from webui import eval_checkpoints
from webui.tabs import evaluate


def _on_start(demo):
    return next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_start"
                and any(getattr(c, "elem_id", None) == "eval-ckpt_mode" for c in f.inputs))


@pytest.mark.slow
def test_checkpoints_part_runs_as_the_tabs_job_then_table_plot_and_promote(root, lora_checkpoints_run, tiny_qwen2,
                                                                        monkeypatch):
    from webui.app import create_app

    run = Path(shutil.copytree(lora_checkpoints_run, root / "lora-run"))
    (root / "plain").mkdir()  # a folder without checkpoints is not offered
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(tiny_qwen2))
    assert eval_checkpoints.run_pairs() == [("lora-run", str(run))]  # named as the Runs tab names it
    assert eval_checkpoints.names_update(str(run))["choices"] == ["checkpoint-2", "checkpoint-4", "final"]

    demo = create_app()
    fn = _on_start(demo)
    values = dict(dataset=["identity"], max_samples=2, max_new_tokens=4, ckpt_mode=True, lang="en")
    # nothing picked: one line says what to pick, nothing starts
    st, _, message, *_ = fn.fn(None, *form_args(fn, **values))
    assert message == "✖ Checkpoints mode: pick a training run." and not (st or {}).get("parts")

    st, _, message, *_ = fn.fn(None, *form_args(fn, **values, ckpt_run=str(run), ckpt_names=[], quantization_bit="4"))
    assert st["parts"] and st["spec"]["checkpoints"] == "all", message
    assert st["spec"]["model_name_or_path"] == str(tiny_qwen2)  # the run's own base model
    assert st["spec"]["quantization_bit"] is None  # the run's, not the top bar's 4 bits
    ticks = []

    def ended() -> bool:
        ticks.append(evaluate.poll(st, False))
        return not ticks[-1][-1].active

    wait_for(ended, timeout=300, what="the checkpoints eval to end")
    assert "Eval done" in ticks[-1][2], ticks[-1][2]
    report = json.loads((Path(st["parts"][0]["dir"]) / CHECKPOINT_EVAL_FILE).read_text())
    entries = report["checkpoints"]
    assert [e["checkpoint"] for e in entries] == ["checkpoint-2", "checkpoint-4", "final"]

    summary, table, plot, metric, pick = eval_checkpoints.view(st, "eval_loss", "en")
    assert list(table["checkpoint"]) == ["checkpoint-2", "checkpoint-4", "final"] and list(table["step"]) == [2, 4, 4]
    assert "eval_loss" in table.columns and "rouge-l" in table.columns
    for column in ("eval_loss", "perplexity", "bleu-4", "rouge-l"):  # a ★ where the adapters differ, none on a tie
        raw = {e.get(column if column in ("eval_loss", "perplexity") else f"predict_{column}") for e in entries}
        stars = sum(str(v).endswith("★") for v in table[column])
        assert stars == (1 if len(raw) > 1 else 0), (column, list(table[column]))
    best = report["best"]["eval_loss"]["checkpoint"]
    assert table.loc[table["checkpoint"] == best, "eval_loss"].item().endswith("★")
    assert f"Best eval_loss: `{best}`" in summary
    frame = plot["value"]
    assert list(frame["step"]) == [2, 4, 4] and list(frame["value"]) == [e["eval_loss"] for e in entries]
    assert metric["value"] == "eval_loss" and "predict_rouge-l" in metric["choices"]
    assert pick["choices"] == ["checkpoint-2", "checkpoint-4"]  # the final adapter is the run's already
    # another metric, the same rows
    _, _, plot, _, _ = eval_checkpoints.view(st, "predict_rouge-l", "en")
    assert list(plot["value"]["value"]) == [e["predict_rouge-l"] for e in entries]
    zh, table_zh, *_ = eval_checkpoints.view(st, "eval_loss", "zh")
    assert "最佳 eval_loss" in zh and list(table_zh.columns[:2]) == ["检查点", "步"], list(table_zh.columns)

    message = eval_checkpoints.promote_picked(st, "checkpoint-2", "en")
    assert "`checkpoint-2` is now the adapter of `lora-run`" in message, message
    assert json.loads((run / PROMOTION_FILE).read_text())["checkpoint"] == "checkpoint-2"
    assert (run / "adapter_model.safetensors").read_bytes() == (run / "checkpoint-2" / "adapter_model.safetensors").read_bytes()
    # after a reload the tab re-attaches to the job and the view reads the same files
    again = evaluate.attach(str(Path(st["parts"][0]["dir"]).parent))
    assert eval_checkpoints.view(again, "eval_loss", "en")[1].equals(table)


def test_view_skips_other_jobs_and_flat_keys(tmp_path):
    assert eval_checkpoints.view({"parts": [{"dir": str(tmp_path)}], "spec": {}}, None) == (
        eval_checkpoints.gr.skip(),) * 5
    assert eval_checkpoints.ckpt_flat(False, "x", [], ["loss"]) == {}
    flat = eval_checkpoints.ckpt_flat(True, str(tmp_path), ["checkpoint-2", "final"], ["predict"])
    assert flat == {"adapter_name_or_path": str(tmp_path), "checkpoints": "checkpoint-2,final", "do_eval": False,
                    "do_predict": True}
    assert eval_checkpoints.refusals(dict(flat, do_predict=False)) == "✖ Checkpoints mode: pick at least one metric."


def test_summary_while_running_and_after_a_stop():
    report = {"asked": ["checkpoint-2", "checkpoint-4", "final"],
              "checkpoints": [{"checkpoint": "checkpoint-2", "step": 2, "eval_loss": 2.5}],
              "best": {"eval_loss": {"checkpoint": "checkpoint-2", "step": 2, "value": 2.5}}}
    text = eval_checkpoints.summary_md(report, {"state": "running", "checkpoint": "checkpoint-4", "eta_s": 75})
    assert text.splitlines()[0] == "Evaluating `checkpoint-4`: 1 of 3 done, about 1:15 left  "
    assert "Best eval_loss: `checkpoint-2` (2.5)" in text
    stopped = eval_checkpoints.summary_md(dict(report, stopped="STOP file found"), {"state": "aborted"}, "de")
    assert "Angehalten (STOP file found): 1 von 3 bewertet" in stopped and "Bewerte" not in stopped


def test_a_full_run_is_the_model(tmp_path):
    """A full run's folder (hand-made: its checkpoints are model folders) is offered and becomes the model of
    the eval, not an adapter; Promote acts on it."""
    run = tmp_path / "full-run"
    (run / "checkpoint-2").mkdir(parents=True)
    for name in ("config.json", "trainer_state.json"):
        (run / "checkpoint-2" / name).write_text("{}")
    (run / "config.json").write_text("{}")
    (run / "run_spec.yaml").write_text("model_name_or_path: some/base\nfinetuning_type: full\ntemplate: auto\n")
    assert eval_checkpoints.run_pairs(tmp_path) == [("full-run", str(run))]
    flat = eval_checkpoints.ckpt_flat(True, str(run), [], ["loss"])
    assert flat["model_name_or_path"] == str(run) and flat["adapter_name_or_path"] is None
    assert flat["finetuning_type"] == "full" and flat["checkpoints"] == "all"
    assert eval_checkpoints.run_of(flat) == str(run) and eval_checkpoints.refusals(flat) == ""
