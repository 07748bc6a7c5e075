"""The Train tab's view of a GRPO run, on a handcrafted run directory (no training): its reward plots from the
stage contract (one series per reward function, whatever the functions are called) and the completions table."""
from __future__ import annotations

import json

from backend.core.rundir import COMPLETIONS_FILE
from webui import live
from webui import fields as F
from webui.tabs import train as T
from tests.webui.test_stage_views import run_dir_with


def grpo_records(n=3):
    return [{"step": s, "total_steps": n, "loss": 0.01, "lr": 1e-5, "reward": 0.2 * s, "reward_std": 0.1,
             "rewards/json_valid/mean": 0.3 * s, "rewards/json_valid/std": 0.1, "rewards/brevity/mean": 0.1,
             "rewards/brevity/std": 0.0, "kl": 0.01 * s, "completions/mean_length": 20.0 + s,
             "completions/clipped_ratio": 0.5, "clip_ratio/region_mean": 0.0} for s in range(1, n + 1)]


def test_grpo_run_shows_reward_plots_and_the_completions_table(root):
    d = run_dir_with(root, "grpo-run", {"stage": "grpo", "dataset": "extraction_demo", "reward_funcs": "json_valid"},
                     grpo_records())
    samples = [{"step": s, "prompt": "p", "completion": f'{{"a": {s}}}' + "x" * (500 if s == 3 else 0),
                "reward": 0.5 * s, "rewards": {"json_valid": 1.0, "brevity": None}} for s in (1, 2, 3)]
    (d / COMPLETIONS_FILE).write_text("".join(json.dumps(r) + "\n" for r in samples) + "not json\n")
    st = T.attach(str(d))
    out = T.view_updates(st, False)
    assert len(out) == 2 + T.N_VIEW
    n = len(live.plot_names())
    plots = dict(zip(live.plot_names(), out[4:4 + n]))
    assert plots["reward"]["visible"] and T.series_of(plots["reward"]["value"]) == ["reward", "reward_std"]
    assert T.series_of(plots["rewards per function"]["value"]) == ["rewards/brevity/mean", "rewards/json_valid/mean"]
    assert plots["kl"]["visible"] and plots["completion length"]["visible"] and plots["clip ratio"]["visible"]
    assert not plots["rewards"]["visible"]  # the DPO one
    table = out[4 + n]
    assert table["visible"] is True
    frame = table["value"]
    assert list(frame.columns) == list(live.COMPLETION_COLUMNS)
    assert list(frame.step) == [3, 2, 1]  # newest first; the malformed line skipped
    assert frame.rewards[0] == "json_valid 1, brevity –" and frame.completion[0].endswith("…")
    # an sft run hides the table
    s = run_dir_with(root, "sft-run", {"stage": "sft", "dataset": "identity"}, [{"step": 1, "loss": 1.0}])
    assert T.view_updates(T.attach(str(s)), False)[4 + n]["visible"] is False


def test_grpo_fields_on_the_form():
    rows = F.rows_by_name()
    grpo = [r.name for r in F.form_rows() if r.visible_for("grpo", "lora") and not r.visible_for("sft", "lora")]
    assert set(grpo) == {"reward_funcs", "reward_weights", "reward_schema", "reward_regex", "num_generations",
                         "max_completion_length", "grpo_beta", "grpo_epsilon", "use_vllm", "temperature", "top_p"}
    assert rows["reward_funcs"].kind == "dropdown" and rows["reward_funcs"].custom
    assert "json_schema,field_f1" in rows["reward_funcs"].choices
    assert rows["num_generations"].ge == 2 and rows["temperature"].group == "method"


def test_rloo_run_shows_the_same_view_and_form_fields_as_grpo(root):
    """Stage rloo (TRL's RLOOTrainer, grpo's run otherwise): its reward plots, the completions table, grpo's fields."""
    d = run_dir_with(root, "rloo-run", {"stage": "rloo", "dataset": "identity", "reward_funcs": "json_valid"},
                     grpo_records())
    (d / COMPLETIONS_FILE).write_text(json.dumps({"step": 1, "prompt": "p", "completion": "c", "reward": 1.0,
                                                  "rewards": {"json_valid": 1.0}}) + "\n")
    out = T.view_updates(T.attach(str(d)), False)
    n = len(live.plot_names())
    plots = dict(zip(live.plot_names(), out[4:4 + n]))
    assert plots["reward"]["visible"] and plots["rewards per function"]["visible"] and plots["kl"]["visible"]
    assert out[4 + n]["visible"] is True and list(out[4 + n]["value"].step) == [1]
    rows = F.form_rows()
    assert ({r.name for r in rows if r.visible_for("rloo", "lora")} ==
            {r.name for r in rows if r.visible_for("grpo", "lora")})
