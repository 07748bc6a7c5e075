"""The Evaluate tab's Benchmarks section: Run benchmarks (the tab's handler, as Gradio calls it) launches
`tuneboard eval` with tasks as the tab's background job on a tiny model + adapter; the table shows the shipped
task's accuracy for the base and the tuned model side by side with the delta, also after the state is rebuilt
from the job folder (a page reload); bad inputs are one line each, nothing launched."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from backend.core.benchmark_tasks import SHIPPED_TASK, lm_eval_missing
from backend.core.rundir import LM_EVAL_FILE
from ui_handlers import form_args
from waiting import wait_for
from webui import bench_view
from webui.tabs import evaluate

pytestmark = pytest.mark.skipif(lm_eval_missing() is not None, reason="the lm-eval extra is not installed")


def test_run_benchmarks_as_the_tabs_job_base_and_tuned_side_by_side(root, tiny_llama, random_llama_adapter, monkeypatch):
    from webui.app import create_app

    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", os.pathsep.join([str(tiny_llama), str(random_llama_adapter)]))
    demo = create_app()
    fn = next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_start"
              and any(getattr(c, "elem_id", None) == "eval-bench_tasks" for c in f.inputs))
    values = dict(model_name_or_path=str(tiny_llama), adapter_name_or_path=str(random_llama_adapter), finetuning_type="lora",
                  template="llama3", lang="en")

    # bad inputs: one line each, nothing launched
    st, _, message, *_ = fn.fn(None, *form_args(fn, **values, bench_tasks=[]))
    assert message == "✖ `tasks`: pick or type at least one task." and not st.get("parts")
    st, _, message, *_ = fn.fn(None, *form_args(fn, **values, bench_limit="ten"))
    assert message == "✖ `limit`: 'ten' is not a number." and not st.get("parts")
    st, _, message, *_ = fn.fn(None, *form_args(fn, **values, bench_tasks=["nowhere/task.yaml"]))
    assert "nowhere/task.yaml: no such task file" in message and not st.get("parts")

    st, _, message, *_ = fn.fn(None, *form_args(fn, **values, bench_limit="6"))  # the shipped task is the default
    assert len(st["parts"]) == 1 and st["spec"]["tasks"] == str(SHIPPED_TASK), message
    assert message == f"Running the benchmarks {SHIPPED_TASK} on the base model and the tuned one…"
    assert "eval_dataset" not in st["spec"] and "max_new_tokens" not in st["spec"]
    ticks = []

    def ended() -> bool:
        ticks.append(evaluate.poll(st, False))
        return not ticks[-1][-1].active

    wait_for(ended, timeout=600, what="the benchmark eval to end")
    assert "**Benchmarks done**" in ticks[-1][2], ticks[-1][2]
    assert any("scoring model" in str(t[1]) for t in ticks[:-1]) or len(ticks) < 3
    assert 'data-step="2"' in ticks[-1][1] and "<b>2 / 2</b>" in ticks[-1][1]  # both models scored, not "0 rows"
    report = json.loads((Path(st["parts"][0]["dir"]) / LM_EVAL_FILE).read_text())
    summary, frame = bench_view.refresh(st, "en")
    assert "**Benchmarks**" in summary and "tuneboard_mc.yaml" in summary and str(random_llama_adapter) in summary
    assert list(frame.columns) == bench_view.COLUMNS
    assert list(zip(frame["task"], frame["metric"])) == [("tuneboard_mc", "acc"), ("tuneboard_mc", "acc_norm")]
    acc = next(r for r in report["rows"] if r["metric"] == "acc")
    assert acc["n"] == 6 and frame["n"][0] == 6
    assert frame["base"][0] == f"{acc['base']:.4f} ± {acc['base_stderr']:.4f}"
    assert frame["tuned"][0] == f"{acc['tuned']:.4f} ± {acc['tuned_stderr']:.4f}"
    assert frame["delta"][0] == f"{acc['tuned'] - acc['base']:+.4f}"

    # a reload: the state rebuilt from the job folder shows the same table, in another language too
    again = evaluate.attach(str(Path(st["parts"][0]["dir"]).parent))
    summary_zh, frame_zh = bench_view.refresh(again, "zh")
    assert "基准测试" in summary_zh and frame_zh.equals(frame)
