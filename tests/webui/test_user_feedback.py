"""What a new user saw in the browser (issue 11), as handler tests: the Runs tab's final loss is the last
logged loss; the adapter picker names runs and the Train tab says when Start trains an adapter further;
the progress card says what a run does before its first step and knows max_steps; an ended run's message
replaces "Stopping ..."; third-party noise stays out of status lines; numeric histogram bins; Evaluate shows
the question, a row in full and which rows it scores; Compare chat labels its panes and says "stopped"."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from webui import choices, jobs, live, tools
from webui.tabs import chat, data, evaluate, runs
from webui.tabs import train as train_tab


def run_dir(root: Path, name: str, losses: list[float], state: str = "completed", mean: float = 9.9) -> Path:
    d = root / "SmolLM2-135M-Instruct" / "lora" / name
    jobs.write_spec_yaml(d, yaml.safe_dump({"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                            "dataset": "identity", "max_steps": len(losses)}))
    with open(d / "trainer_log.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-4}) + "\n")
        f.write(json.dumps({"step": len(losses), "eval_loss": 5.0}) + "\n")  # a last line without loss
    (d / "status.json").write_text(json.dumps({
        "state": state, "step": len(losses), "total_steps": 20, "started_at": "2026-11-30T14:02:03",
        "final_metrics": {"train_loss": mean}}))
    (d / "adapter_config.json").write_text("{}")
    return d


def test_runs_final_loss_is_the_last_logged_loss_and_names_are_short(tmp_path):
    a = run_dir(tmp_path, "2026-11-30-14-02-03", [3.0, 2.0, 1.63], mean=2.5591)
    b = run_dir(tmp_path, "2026-11-30-14-30-10", [3.0, 1.21], state="aborted")
    rows = {r["name"]: r for r in runs.run_rows(tmp_path)}
    assert rows["SmolLM2-135M-Instruct/lora/2026-11-30-14-02-03"]["final loss"] == "1.6300"  # not 2.5591
    assert rows["SmolLM2-135M-Instruct/lora/2026-11-30-14-30-10"]["final loss"] == "1.2100"
    names = [runs._rel(str(d), tmp_path) for d in (a, b)]
    assert runs.short_names(names) == {names[0]: "2026-11-30-14-02-03", names[1]: "2026-11-30-14-30-10"}
    assert runs.short_names(["x/lora/run", "y/lora/run"]) == {"x/lora/run": "x/lora/run", "y/lora/run": "y/lora/run"}
    frame = runs.overlay_frame([str(a), str(b)], tmp_path)
    assert set(frame["series"]) == {f"2026-11-30-14-{t} {k}" for t in ("02-03", "30-10") for k in ("loss", "eval_loss")}


def test_a_clicked_table_row_picks_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path))
    a = run_dir(tmp_path, "first", [2.0])
    b = run_dir(tmp_path, "second", [1.0], state="aborted")
    assert runs.run_at("SmolLM2-135M-Instruct/lora/first", 1, "all", "") == str(a)  # by name first
    assert runs.run_at(None, 0, "aborted", "") == str(b)  # else by position under the filters
    assert runs.run_at(None, 5, "all", "") is None


def test_adapter_picker_names_runs_and_the_train_tab_says_it_trains_one_further(tmp_path):
    a = run_dir(tmp_path, "2026-11-30-14-02-03", [3.0, 1.63])
    (a / "checkpoint-2").mkdir()
    pairs = choices.adapter_pairs(tmp_path)
    assert pairs[0] == (choices.NO_ADAPTER, "")
    labels = dict((v, k) for k, v in pairs)
    assert labels[str(a)] == "SmolLM2-135M-Instruct · lora · sft · 11-30 14:02 · loss 1.630"
    assert labels[str(a / "checkpoint-2")].endswith("· checkpoint-2")
    note, clear = train_tab.adapter_banner("")
    assert note["visible"] is False and clear["visible"] is False
    note, clear = train_tab.adapter_banner(str(a))
    assert note["visible"] and clear["visible"]
    assert "Continue training from adapter" in note["value"] and str(a) in note["value"]  # full path shown


def test_phase_before_the_first_step_and_the_known_total():
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled GGUF
    assert live.phase([], 20, model).startswith("starting")
    lines = ["Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'",
             "[15:00:01] stage sft, lora, model HuggingFaceTB/SmolLM2-135M-Instruct, output /s/run"]
    assert "GGUF model is converted" in live.phase(lines, 20, model)
    assert "GGUF" not in live.phase(lines, 20, "/models/tiny")
    lines += ["[15:00:30] template: smollm2",
              "[15:00:31] dataset identity (alpaca, identity.json): 91 rows, 80 kept"]
    assert live.phase(lines, 20, model) == "tokenizing 80 rows"
    lines += ["[15:00:32] train rows: 80 rows", "[15:00:33] model: LlamaForCausalLM",
              "[15:00:40] trainable parameters: 1,000 of 135,000 (0.7%)"]
    # the model is ready; the Trainer is built next (no step runs yet: the trainer's status says when one does)
    assert live.phase(lines, 20, model).startswith("preparing the trainer")
    assert train_tab.spec_total({"max_steps": 20}) == 20 and train_tab.spec_total({"max_steps": -1}) is None
    html = live.progress_html(live.progress([], {}), "running", "r", "tokenizing 80 rows")
    assert 'data-phase="tokenizing 80 rows"' in html


def test_status_lines_leave_out_third_party_noise():
    lines = ["[15:00:01] loading", "Failed to load CPU gemm_4bit_forward from kernels-community: No module "
             "named 'kernels'", "Loading weights:  50%|█████     | 1/2 [00:01<00:01,  1.2it/s]", ""]
    assert live.status_line(lines) == "[15:00:01] loading"
    assert live.status_line(["rnels-community: No module named 'kernels'"]) == ""


def test_a_run_is_summarised_by_last_smoothed_and_lowest_loss(tmp_path):
    """Issue 24, item 7: the last loss is one noisy batch (1.63 on a curve zig-zagging 1.6-3.7); beside it the
    plot's smoothed curve at its last point and the lowest loss, each labelled, in the Runs table, the summary
    and the end message, from one definition (backend.core.curves)."""
    from backend.core.curves import loss_summary, smooth

    zigzag = [3.7, 1.6, 3.5, 1.7, 3.1, 1.63]
    d = run_dir(tmp_path, "2026-11-30-15-00-00", zigzag)
    row = next(r for r in runs.run_rows(tmp_path) if r["name"].endswith("15-00-00"))
    expected = smooth(zigzag)[-1]
    assert 1.63 < expected < 3.7 and expected == live.smooth(zigzag)[-1]  # the plot's own smoothing
    assert (row["final loss"], row["smoothed loss"], row["lowest loss"]) == ("1.6300", f"{expected:.4f}", "1.6000")
    summary = loss_summary(zigzag)
    status = {"step": 6, "total_steps": 6, "final_metrics": {**summary, "train_loss": 2.56}}
    message = train_tab.ended_message(str(d), "completed", status)
    assert f"final loss 1.63 (smoothed {expected:.4g}, lowest 1.6)" in message, message
    md = live.final_metrics_md(status)
    assert md.index("final loss (last logged)") < md.index("smoothed loss (the plot's curve") \
        < md.index("lowest logged loss") < md.index("mean train loss")
    assert "lissée" in train_tab.ended_message(str(d), "completed", status, lang="fr")
    assert runs.run_rows(tmp_path / "nothing-here") == [] and loss_summary([]) == {}


def test_an_ended_run_says_how_it_ended(tmp_path):
    d = run_dir(tmp_path, "r", [2.0, 1.5, 1.2], state="aborted")
    (d / "checkpoint-3").mkdir()
    message = train_tab.ended_message(str(d), "aborted", {"step": 3, "total_steps": 20})
    assert "stopped at step 3 of 20" in message and "checkpoint-3" in message and "saved" in message
    assert "completed" in train_tab.ended_message(str(d), "completed", {"step": 20, "total_steps": 20,
                                                                        "final_metrics": {"final_loss": 1.2}})
    md = live.final_metrics_md({"final_metrics": {"train_loss": 2.55, "final_loss": 1.63}})
    assert md.index("final loss (last logged)") < md.index("mean train loss")


def test_histogram_bins_are_in_numeric_order():
    frame, order = data.histogram([49, 53, 101, 105, 120, 120, 60])
    assert order == list(frame["tokens"])
    lows = [int(label.split("-")[0]) for label in order]
    assert lows == sorted(lows) and frame["rows"].sum() == 7
    md, hist = data.cleared_stats()
    assert md == "" and hist["visible"] is False


def test_eval_rows_show_the_question_a_row_in_full_and_which_rows_are_scored(tmp_path):
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n<|im_start|>user\n"
              "Who are you?<|im_end|>\n<|im_start|>assistant\n")
    assert tools.last_user_turn(prompt) == "Who are you?"
    assert tools.last_user_turn("Human: What is 2+2?</s>\nAssistant:") == "What is 2+2?"
    st = evaluate.new_state()
    st["parts"] = [{"name": "tuned", "dir": "t"}, {"name": "base", "dir": "b"}]
    st["rows"] = {"tuned": [{"index": 0, "prompt": prompt, "label": "TuneBoard", "predict": "I am TuneBoard",
                             "rouge-l": 50.0, "exact_match": False}],
                  "base": [{"index": 0, "prompt": prompt, "label": "TuneBoard", "predict": "SmolLM", "rouge-l": 0.0}]}
    frame = evaluate.rows_frame(st, False)
    assert frame["question"].tolist() == ["Who are you?"] and frame["exact"].tolist() == ["✗"]
    detail = evaluate.row_detail(st, 0)
    for text in ("Who are you?", "TuneBoard", "I am TuneBoard", "SmolLM", "rouge-l 50", "named SmolLM"):
        assert text in detail
    first = evaluate.eval_flat("m", "", "lora", "none", "auto", ["identity"], 20, 8)
    assert "first 20 rows" in evaluate.rows_scored(first)
    held = evaluate.eval_flat("m", "", "lora", "none", "auto", ["identity"], 20, 8, 0.1)
    assert held["eval_dataset"] is None and held["dataset"] == "identity" and held["val_size"] == 0.1
    assert "held-out 10%" in evaluate.rows_scored(held)


def test_compare_chat_labels_its_panes_and_says_stopped():
    a, b = chat.pane_labels("/m/tiny", "/saves/run-b", True, None)
    assert a.startswith("tuned") and "run-b" in a and b.startswith("base") and "tiny" in b
    st = chat.empty_state()
    st.update(a="tuned", b="base", hist_a=[{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hel"}],
              hist_b=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}])
    assert chat.waiting(st["hist_b"])[-1]["content"] == chat.WAITING
    shown_a, shown_b, speed, st = chat.stopped(st)
    assert speed.startswith("■ Stopped") and "base: not answered" in speed and "tuned: cut short" in speed
    # the question stays on both sides, each answer marked as stopped (the empty one too: turns alternate)
    assert [m["role"] for m in st["hist_b"]] == ["user", "assistant"] and st["hist_b"][-1]["stopped"]
    assert shown_a[-1]["content"] == "Hel (stopped)" and shown_b[-1]["content"] == "(stopped)"


def test_no_bitsandbytes_kernels_notice_without_quantization():
    """peft imports bitsandbytes, whose CPU backend logged "Failed to load CPU gemm_4bit_forward from
    kernels-community" at the top of every run's log and into Chat's load status; backend.training.models drops it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import backend.training.models, peft"], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parents[2]), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gemm_4bit_forward" not in proc.stderr + proc.stdout


def test_handler_texts_are_translated_in_every_locale(tmp_path):
    """Subtitle, progress card, messages and table headers follow the language picker; every translation
    keeps the {fields} of the English text (a lost field would fall back to English)."""
    import re
    import string

    from webui.i18n import LANGS, strings, tr

    en = strings("en")
    keys = [k for k in en if k.split(".")[0] in ("card", "state", "phase", "msg", "col")] + ["tb-header-block"]
    fields = lambda text: {f for _, f, _, _ in string.Formatter().parse(text) if f}  # noqa: E731
    for lang in LANGS[1:]:
        for key in keys:
            assert key in strings(lang), (lang, key)
            assert fields(strings(lang)[key]) == fields(en[key]), (lang, key)
    card = live.progress_html(live.progress([], {}), "running", "r", "", lang="zh")
    assert "运行中" in card and "步" in card and "tokens/s" not in card and 'data-state="running"' in card
    d = run_dir(tmp_path, "r", [2.0, 1.5, 1.2], state="aborted")
    (d / "checkpoint-3").mkdir()
    assert "gestoppt" in train_tab.ended_message(str(d), "aborted", {"step": 3, "total_steps": 20}, "de")
    assert re.search(r"[\u3040-\u30ff]", live.phase([], 20, "m", "ja"))  # kana
    frame = runs.table(runs.run_rows(tmp_path), "all", "", "fr")
    assert "perte finale" in frame.columns and "final loss" not in frame.columns
    assert tr("ko", "msg.started", name="x") != tr("en", "msg.started", name="x")


def test_the_subtitle_is_relabelled_with_the_page():
    from webui.app import create_app
    from webui.i18n import strings

    reg = create_app().tb_registry
    ids = list(reg.items)
    value = reg.relabel("ru")[ids.index("tb-header-block")]["value"]
    assert strings("ru")["tb-header-block"] in value and "TuneBoard" in value


def test_export_checks_show_their_figures():
    """The checks table's "figures" column was empty: backend/exporting/export.py puts them beside name/ok/detail."""
    report = {"checks": [{"name": "logits", "ok": True, "max_abs_diff": 3.5e-07, "tolerance": 0.001, "detail": "d"},
                         {"name": "eos", "ok": True, "generation_config_eos": [2, 7], "detail": "e"}]}
    rows = tools.checks_rows(report)
    assert rows[0][3] == "max_abs_diff=3.5e-07, tolerance=0.001" and rows[1][3] == "generation_config_eos=[2, 7]"


def test_data_tab_names_the_system_prompt_the_template_adds():
    from webui import datasets as D

    row = {"segments": [{"text": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                 "Hugging Face<|im_end|>\n", "trained": False}, {"text": "Hi", "trained": True}]}
    assert "named SmolLM" in D.template_system_prompt(row)
    assert D.template_system_prompt({"segments": [{"text": "<|im_start|>system\nBe brief.<|im_end|>"}]}) is None


def test_two_starts_in_one_second_get_two_run_folders(tmp_path, monkeypatch):
    """The default output_dir is named by the second: a second Start within it was refused ("already holds a
    run"); it gets the next free name, also past a run still waiting in the queue."""
    monkeypatch.setenv("TUNEBOARD_SAVES", str(tmp_path))
    base = tmp_path / "m" / "lora" / "20261130-154020"
    assert train_tab.unique_run_dir(base) == base
    jobs.write_spec_yaml(base, "stage: sft\n")
    jobs.JobQueue().enqueue("stage: sft\n", base.with_name(base.name + "-2"))
    assert train_tab.unique_run_dir(base) == base.with_name(base.name + "-3")


def test_the_default_model_says_it_is_the_bundled_gguf():
    """Issue 24, item 8: the top bar names the default model with its real source; other models keep their id."""
    from backend.core import paths
    from webui.app import create_app

    assert "bundled" in paths.weights_note("HuggingFaceTB/SmolLM2-135M-Instruct") and paths.weights_note("x/y") is None
    box = create_app().tb_registry.items["top-model_name_or_path"][0]
    labels = dict((value, label) for label, value in box.choices)
    assert labels[paths.DEFAULT_MODEL_ID] == f"{paths.DEFAULT_MODEL_ID} · bundled Q4_1 GGUF"
    assert all(label == value for value, label in labels.items() if value != paths.DEFAULT_MODEL_ID)


def test_the_runs_table_reads_an_ended_runs_summary_from_its_status(tmp_path):
    """An ended run's three loss numbers come from its status (written at the end), so a refresh does not read
    every run's whole log; a running run's (or an older run's) are computed from its log."""
    d = run_dir(tmp_path, "2026-11-30-16-00-00", [3.0, 2.0, 1.5])
    status = json.loads((d / "status.json").read_text())
    status["final_metrics"].update(final_loss=1.5, smoothed_loss=1.9, min_loss=1.25)  # not the log's
    (d / "status.json").write_text(json.dumps(status))
    row = next(r for r in runs.run_rows(tmp_path) if r["name"].endswith("16-00-00"))
    assert (row["final loss"], row["smoothed loss"], row["lowest loss"]) == ("1.5000", "1.9000", "1.2500")
    assert runs.loss_numbers(str(d), dict(status, state="running"))["min_loss"] == 1.5  # from the log


def test_numbers_the_spec_bounds_are_refused_by_the_spec_naming_the_field(root):
    """gr.Number's own minimum refuses a value with a toast that names no field ('Value 0 is less than minimum value
    1.'), so the numbers a spec checks carry no bounds in the page: the tab's start names the key instead. Only the
    Runs and Data tabs' own counters keep theirs (no spec reads them)."""
    import gradio as gr

    from webui.app import create_app
    from webui.tabs import export

    demo = create_app()
    numbers = [b for b in demo.blocks.values() if isinstance(b, gr.Number)]
    bounded = {b.elem_id for b in numbers if b.minimum is not None or b.maximum is not None}
    assert {"export-size", "eval-max_samples", "eval-val_size", "distill-concurrency"} <= {b.elem_id for b in numbers}
    assert bounded == {"runs-max_concurrent", "runs-continue_n", "data-index"}, bounded

    flat = export.export_flat("HuggingFaceTB/SmolLM2-135M-Instruct", None, "full", "auto", "", "safetensors", "f16",
                              0, "cpu", False)
    st, message, started = export.start_export(export.new_state(), flat)
    assert not started and message == "✖ `export_size`: must be > 0 (got 0.0)", message
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    for args, said in [((0, 128), "`max_samples`: must be >= 1 (got 0)"),
                       ((20, 128, -0.5), "`val_size`: must be >= 0 (got -0.5)")]:
        parts, why = evaluate.plan(evaluate.eval_flat(model, None, "lora", None, "auto", ["identity"], *args), False,
                                   None)
        assert parts is None and said in why, why
