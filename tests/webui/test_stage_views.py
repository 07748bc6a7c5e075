"""The web UI side of the preference stages, on handcrafted run directories (no training): the Train tab's
stage plots from the stage contract, the Runs overlay of any logged metric, "Continue with DPO", the
memory pre-flight of reference model and pairs, and the Data tab's rendering of ranking / KTO rows."""
from __future__ import annotations

import json
from html import escape
from pathlib import Path

import gradio as gr
import pytest
import yaml

from backend.core.paths import DEFAULT_MODEL_ID
from backend.core.spec import validate_spec
from backend.stages import STAGES
from webui import datasets as D
from webui import jobs, live, preflight
from webui.tabs import runs
from webui.tabs import train as T

TOP = list(T.F.TOPBAR_FIELDS)
NAMES = [r.name for r in T.F.form_rows()]


def dpo_records(n=4, eval_at=()):
    """trainer_log.jsonl lines as the callback writes them for a DPO run (the declared metric keys)."""
    out = []
    for step in range(1, n + 1):
        r = {"step": step, "total_steps": n, "epoch": step / n, "loss": 0.7 - 0.05 * step, "eval_loss": None,
             "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 10.0, "elapsed_s": step, "eta_s": n - step,
             "memory_mb": 100, "rewards/chosen": 0.01 * step, "rewards/rejected": -0.01 * step,
             "rewards/margins": 0.02 * step, "rewards/accuracies": min(1.0, 0.25 * step),
             "logps/chosen": -40.0, "logps/rejected": -45.0}
        out.append(r)
        if step in eval_at:
            out.append({"step": step, "eval_loss": 0.6, "eval_rewards/accuracies": 0.5,
                        "eval_rewards/chosen": 0.0, "eval_rewards/rejected": 0.0, "eval_rewards/margins": 0.0})
    return out


def run_dir_with(root: Path, name: str, spec: dict, records: list[dict], state="completed", adapter=False) -> Path:
    d = root / name
    jobs.write_spec_yaml(d, yaml.safe_dump({"model_name_or_path": DEFAULT_MODEL_ID, "output_dir": str(d), **spec}))
    (d / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = max((r["step"] for r in records), default=0)
    (d / "status.json").write_text(json.dumps({"state": state, "step": steps, "total_steps": steps}))
    if adapter:
        (d / "adapter_config.json").write_text("{}")
    return d


# ------------------------------------------------------------------ Train tab: the stage's plots

def test_every_declared_plot_has_a_component_and_a_label():
    from webui.app import create_app

    declared = {name for s in STAGES.values() for name, _ in s.plots}
    assert declared and set(live.plot_names()) == declared
    items = create_app().tb_registry.items
    for name in declared:
        comp = items[live.plot_elem_id(name)][0]
        assert isinstance(comp, gr.LinePlot) and comp.visible is False  # shown only for a stage that has it
    assert live.stage_plots("pt") == {} and live.plots_when_logged("dpo") == ()
    # sft's task metric plot (eval_metric at each save) shows only once a run has logged it
    assert list(live.stage_plots("sft")) == list(live.plots_when_logged("sft")) == ["task metric"]
    assert live.stage_plots("dpo")["accuracy"] == ("rewards/accuracies",)


def test_metric_frame_takes_the_declared_keys_and_their_eval_variants():
    frame = live.metric_frame(dpo_records(4, eval_at=(2, 4)), ("rewards/accuracies",))
    assert T.series_of(frame) == ["rewards/accuracies", "eval_rewards/accuracies"]
    train = frame[frame.series == "rewards/accuracies"]
    assert list(train.step) == [1, 2, 3, 4] and list(train.value) == [0.25, 0.5, 0.75, 1.0]
    assert list(frame[frame.series == "eval_rewards/accuracies"].step) == [2, 4]
    # a key that is absent makes no series; a run label prefixes each series (the Runs overlay)
    assert len(live.metric_frame(dpo_records(2), ("kl",))) == 0
    assert T.series_of(live.metric_frame(dpo_records(2, eval_at=(2,)), ("kl", "rewards/margins"), run_label="r")) \
        == ["r", "r eval"]
    # numeric columns even when empty (an object column makes the plot draw the values as categories)
    for f in (live.metric_frame([], ("kl",)), live.loss_frame([]), frame):
        assert str(f["value"].dtype) == "float64" and str(f["step"].dtype) == "int64"


def _view(run_dir):
    st = T.attach(str(run_dir))
    out = T.view_updates(st, False)
    n = len(live.plot_names())
    assert len(out) == 2 + T.N_VIEW
    return st, dict(zip(live.plot_names(), out[4:4 + n]))


def test_live_view_shows_the_plots_of_the_attached_runs_stage(root):
    d = run_dir_with(root, "dpo-run", {"stage": "dpo", "dataset": "dpo_en_demo"}, dpo_records(3))
    st, plots = _view(d)
    assert st["stage"] == "dpo"
    assert plots["rewards"]["visible"] is True and plots["accuracy"]["visible"] is True
    assert plots["kl"]["visible"] is False
    assert T.series_of(plots["rewards"]["value"]) == ["rewards/chosen", "rewards/rejected", "rewards/margins"]
    acc = plots["accuracy"]["value"]
    assert list(acc.value) == [0.25, 0.5, 0.75]
    # the legend of each plot is rebuilt once for its series, then left alone
    first = T.legend_updates(st, ["loss", *live.plot_names()])
    assert first[0]["colors_in_legend"] == ["loss", "smoothed"]
    by_name = dict(zip(live.plot_names(), first[1:]))
    assert by_name["accuracy"]["colors_in_legend"] == ["rewards/accuracies"]
    assert all(u["__type__"] == "update" and "colors_in_legend" not in u for u in
               T.legend_updates(st, ["loss", *live.plot_names()]))
    # a kto run shows its kl plot instead of the accuracy one
    k = run_dir_with(root, "kto-run", {"stage": "kto", "dataset": "kto_en_demo"},
                     [{"step": 1, "loss": 0.5, "kl": 0.1, "rewards/chosen": 0.2}])
    _, plots = _view(k)
    assert plots["kl"]["visible"] is True and plots["accuracy"]["visible"] is False
    assert list(plots["kl"]["value"].value) == [0.1]


def test_sft_run_shows_no_stage_plot(root):
    d = run_dir_with(root, "sft-run", {"stage": "sft", "dataset": "identity"},
                     [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}])
    st, plots = _view(d)
    assert st["stage"] == "sft"
    assert all(u["visible"] is False for u in plots.values())
    # no new record: nothing is redrawn on the next tick
    out = T.view_updates(st, False)
    assert all(u["__type__"] == "update" and len(u) == 1 for u in out[4:4 + len(live.plot_names())])


# ------------------------------------------------------------------ Runs tab

def test_runs_table_has_the_stage_and_the_overlay_plots_any_logged_metric(root):
    a = run_dir_with(root, "a", {"stage": "dpo", "dataset": "dpo_en_demo"}, dpo_records(3, eval_at=(3,)))
    b = run_dir_with(root, "b", {"stage": "sft", "dataset": "identity"}, [{"step": 1, "loss": 1.0, "lr": 1e-4}])
    table = runs.table(runs.run_rows(root), "all", "")
    assert dict(zip(table["name"], table["stage"])) == {"a": "dpo", "b": "sft"}
    offered = runs.overlay_metrics([str(a), str(b)])
    assert offered[0] == "loss"
    assert {"rewards/accuracies", "rewards/margins", "logps/chosen", "lr", "grad_norm"} <= set(offered)
    assert "step" not in offered and "eval_rewards/accuracies" not in offered  # drawn with its train key
    assert runs.overlay_metrics([str(b)]) == ["loss", "lr"]
    frame = runs.overlay_frame([str(a), str(b)], root=root, metric="rewards/accuracies")
    assert T.series_of(frame) == ["a", "a eval"]  # b logged no such metric
    assert str(frame["value"].dtype) == "float64"
    assert T.series_of(runs.overlay_frame([str(a), str(b)], root=root)) == ["a loss", "a eval_loss", "b loss"]


def test_continue_with_dpo_from_a_finished_sft_lora_run(root):
    sft = run_dir_with(root, "sft-lora", {"stage": "sft", "dataset": "identity", "max_steps": 7,
                                          "learning_rate": 5e-5, "lora_rank": 4}, [{"step": 1, "loss": 1.0}],
                       adapter=True)
    spec, msg = runs.continue_dpo_spec(str(sft))
    assert spec is not None, msg
    assert spec.stage == "dpo" and spec.dataset == runs.DPO_DATASET == "dpo_en_demo"
    assert spec.adapter_name_or_path == str(sft) and spec.output_dir is None
    assert spec.finetuning_type == "lora" and spec.lora_rank == 4 and spec.max_steps == 7  # the run's settings
    # into the form: the top bar's adapter picker gets the run, the form the stage and dataset
    values = T.spec_to_inputs(spec, TOP, NAMES)
    assert values[TOP.index("adapter_name_or_path")] == str(sft)
    form = dict(zip(NAMES, values[len(TOP) + 2:]))
    assert form["stage"] == "dpo" and form["dataset"] == "dpo_en_demo"
    flat, pre = T.collect(NAMES, TOP, values)
    back, errors = T.check(flat, pre)
    assert errors == [] and back.stage == "dpo"


@pytest.mark.parametrize("case, words", [
    ("dpo", "SFT run"), ("full", "LoRA"), ("running", "not completed"), ("no_adapter", "adapter"), ("none", "Pick"),
])
def test_continue_with_dpo_refusals(root, case, words):
    spec = {"stage": "sft", "dataset": "identity"}
    state, adapter = "completed", True
    if case == "dpo":
        spec = {"stage": "dpo", "dataset": "dpo_en_demo"}
    if case == "full":
        spec["finetuning_type"] = "full"
    if case == "running":
        state = "aborted"
    if case == "no_adapter":
        adapter = False
    d = run_dir_with(root, case, spec, [{"step": 1, "loss": 1.0}], state=state, adapter=adapter)
    got, msg = runs.continue_dpo_spec(None if case == "none" else str(d))
    assert got is None and words in msg, msg


# ------------------------------------------------------------------ memory pre-flight

BASE = {"model_name_or_path": "SmolLM2-1.7B", "per_device_train_batch_size": 2, "cutoff_len": 512}


def est(**kw):
    return preflight.estimate({**BASE, **kw})


def test_preflight_counts_a_reference_copy_only_where_one_is_loaded():
    weights = est()["weights"]
    assert est(stage="sft", finetuning_type="full")["reference"] == 0
    assert est(stage="dpo", finetuning_type="full")["reference"] == pytest.approx(weights)
    assert est(stage="kto", finetuning_type="freeze")["reference"] == pytest.approx(weights)
    # LoRA: the reference is the base with the adapter switched off, no copy ...
    assert est(stage="dpo", finetuning_type="lora")["reference"] == 0
    # ... unless ref_model names one (its own size when the name says it)
    assert est(stage="dpo", finetuning_type="lora", ref_model="x/SmolLM2-360M")["reference"] == \
        pytest.approx(360e6 * 4.0)
    # ORPO / SimPO need no reference model at all
    for kw in ({"stage": "orpo"}, {"stage": "simpo"}, {"stage": "dpo", "pref_loss": "simpo"}):
        assert est(finetuning_type="full", **kw)["reference"] == 0
    full_dpo, full_sft = est(stage="dpo", finetuning_type="full"), est(stage="sft", finetuning_type="full")
    assert full_dpo["total"] > full_sft["total"]
    assert "reference model copy" in preflight.summary_md({**BASE, "stage": "dpo", "finetuning_type": "full"})
    assert "reference" not in preflight.summary_md({**BASE, "stage": "sft"})


def test_preflight_is_refreshed_by_the_fields_it_reads():
    form = set(NAMES) | set(TOP)
    assert set(preflight.FIELDS) <= form, set(preflight.FIELDS) - form
    flat, _ = T.collect(NAMES, TOP, T.spec_to_inputs(validate_spec({"stage": "dpo", "dataset": "dpo_en_demo"}),
                                                     TOP, NAMES))
    assert "chosen + rejected" in preflight.summary_md(flat)


def test_preflight_doubles_the_batch_of_pairwise_stages(monkeypatch):
    # plain checkpointing: whether selective checkpointing's extra is added depends on this machine's free memory
    monkeypatch.setenv("TUNEBOARD_SELECTIVE_CHECKPOINT", "0")
    sft = est(stage="sft")["activations"]
    for stage in ("dpo", "orpo", "simpo", "rm"):
        assert est(stage=stage)["activations"] == pytest.approx(2 * sft), stage
        assert est(stage=stage)["pairs"] is True
    assert est(stage="kto")["activations"] == pytest.approx(sft)  # one completion per row
    assert "chosen + rejected" in preflight.summary_md({**BASE, "stage": "dpo"})


# ------------------------------------------------------------------ Data tab rendering

def test_ranking_row_renders_prompt_once_then_both_answers():
    seg = lambda text, trained: {"text": text, "trained": trained, "role": "assistant" if trained else "user"}  # noqa: E731
    row = {"kind": "ranking", "source": "pairs", "row": 3, "num_trained": 9, "truncated": False,
           "prompt": {"segments": [seg("<user>What is 2+2?</user>", False)], "num_tokens": 8},
           "chosen": {"segments": [seg("4<end>", True)], "num_tokens": 3},
           "rejected": {"segments": [seg("5 & <b>six</b><end>", True)], "num_tokens": 6}}
    html = D.render_row(row)
    assert html.count("What is 2+2?") == 1
    assert html.index('data-part="prompt"') < html.index('data-part="chosen"') < html.index('data-part="rejected"')
    assert '<span class="tb-trained">4&lt;end&gt;</span>' in html
    assert "&lt;b&gt;six&lt;/b&gt;" in html and "<b>six</b>" not in html  # escaped
    assert '<span class="tb-masked">&lt;user&gt;' in html
    summary = D.row_summary(row)
    assert "prompt 8" in summary and "chosen 3" in summary and "rejected 6" in summary


def test_kto_row_shows_its_tag():
    for tag, flag in (("desirable", True), ("undesirable", False)):
        row = {"kind": "kto", "tag": tag, "kto_tag": flag, "num_tokens": 5, "num_trained": 2, "source": "k",
               "row": 0, "segments": [{"text": "q", "trained": False}, {"text": "a", "trained": True}]}
        html = D.render_row(row)
        assert f'data-tag="{tag}"' in html and '<span class="tb-trained">a</span>' in html
        assert tag in D.row_summary(row)


def test_data_tab_previews_a_bundled_ranking_row_through_the_backend():
    """The real `tuneboard preview --json` subprocess: the Data tab shows dpo_en_demo row 0 as a pair."""
    from webui.tabs import data as data_tab

    from backend.core.paths import DATA_DIR

    raw = json.loads((DATA_DIR / "dpo_en_demo.json").read_text())[0]
    summary, shown = data_tab.show_row("", "dpo_en_demo", 0, "", "auto", 256)
    assert "✖" not in summary, summary
    assert "prompt" in summary and "chosen" in summary
    prompt, rest = shown.split('data-part="chosen"')
    chosen, rejected = rest.split('data-part="rejected"')
    assert prompt.count(escape(raw["instruction"])) == 1 and escape(raw["instruction"]) not in rest
    assert escape(raw["chosen"]) in chosen and escape(raw["rejected"]) in rejected
