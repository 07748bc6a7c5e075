"""Form <-> spec both ways for every stage and method, validation errors mapped to their fields, and the
live-view frames (zeros kept, smoothing, eval loss)."""
import pytest

from backend.core.spec import STAGES, validate_spec
from webui import fields as F
from webui import live
from webui.tabs import train as T

TOP = list(F.TOPBAR_FIELDS)
NAMES = [r.name for r in F.form_rows()]


def form_values(overrides=None, booster="auto", extra=""):
    table = F.rows_by_name()
    flat = {**{n: table[n].default for n in TOP + NAMES}, **F.PRESET, **(overrides or {})}
    vals = [F.to_widget(table[n], flat[n]) for n in TOP + NAMES]
    return vals[:len(TOP)] + [booster, extra] + vals[len(TOP):]


def test_preset_is_a_valid_quick_run():
    flat, pre = T.collect(NAMES, TOP, form_values())
    spec, errors = T.check(flat, pre)
    assert errors == [] and spec.max_steps == -1 and spec.num_train_epochs == 3.0 and spec.cutoff_len == 256
    assert spec.dataset == "identity" and spec.finetuning_type == "lora"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("method", ["lora", "freeze", "full"])
def test_spec_to_form_to_spec_round_trip(stage, method):
    data = {"stage": stage, "finetuning_type": method, "dataset": "identity", "max_steps": 7,
            "lora_rank": 4, "learning_rate": 3e-5, "packing": True, "gradient_checkpointing": True,
            "save_total_limit": 3}
    if stage in ("rm", "dpo", "orpo", "simpo"):
        data["dataset"] = "dpo_en_demo"
    if stage == "kto":
        data["dataset"] = "kto_en_demo"
    if method == "lora":
        data.update(quantization_bit=4, use_dora=True)
    if stage == "ppo":  # a reward function, and its own keys off their defaults
        data.update(packing=False, reward_funcs="json_valid", ppo_epochs=2, init_kl_coef=0.1, gamma=0.99, temperature=0.8)
    if stage == "grpo":  # its reward settings and its sampling keys (shown for grpo only) survive the round trip
        data.update(packing=False, reward_funcs="json_schema,field_f1", reward_weights="1,0.5", num_generations=2,
                    temperature=0.8, top_p=0.9, grpo_beta=0.0)
    try:
        spec = validate_spec(data)
    except Exception as exc:  # a combination the spec itself refuses is not the form's business
        pytest.skip(f"spec refuses {stage}/{method}: {exc}")
    values = T.spec_to_inputs(spec, TOP, NAMES)
    flat, pre = T.collect(NAMES, TOP, values)
    back, errors = T.check(flat, pre)
    assert errors == []
    assert back.flat_dict() == spec.flat_dict()


def test_booster_and_passthrough_round_trip():
    spec = validate_spec({"enable_liger_kernel": True})
    values = T.spec_to_inputs(spec, TOP, NAMES)
    assert values[len(TOP)] == "liger"
    flat, _ = T.collect(NAMES, TOP, form_values(booster="fa2", extra="dataloader_num_workers: 0\n"))
    assert flat["flash_attn"] == "fa2" and flat["dataloader_num_workers"] == 0
    assert T.check(flat, [])[1] == []


def test_errors_map_to_the_fields_that_caused_them():
    flat, pre = T.collect(NAMES, TOP, form_values({"lora_rank": 0, "cutoff_len": 2}))
    spec, errors = T.check(flat, pre)
    assert spec is None
    fields = {f for f, _ in errors}
    assert {"lora_rank", "cutoff_len"} <= fields
    ups = T.error_updates(errors, TOP + NAMES)
    by_name = dict(zip(TOP + NAMES, ups))
    assert by_name["lora_rank"]["elem_classes"] == ["tb-field-error"]
    assert by_name["lora_rank"]["info"].startswith("must be >= 1")  # the message, no emoji the fonts may lack
    assert by_name["learning_rate"]["elem_classes"] == []


def test_unknown_passthrough_key_and_bad_yaml_are_reported():
    flat, pre = T.collect(NAMES, TOP, form_values(extra="lora_alpah: 3\n"))
    _, errors = T.check(flat, pre)
    assert any("lora_alpah" in f or "lora_alpah" in m for f, m in errors)
    flat, pre = T.collect(NAMES, TOP, form_values(extra="a: [1,\n"))
    assert T.check(flat, pre)[1][0][0] == "extra_args"


def test_quantization_dropdown_keeps_int_type():
    row = F.rows_by_name()["quantization_bit"]
    assert F.dropdown_ids(row) == ["none", "4", "8"]
    assert F.from_widget(row, "4") == 4 and F.from_widget(row, "none") is None


def test_loss_frame_keeps_zeros_and_adds_smoothed_and_eval():
    recs = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 0.0}, {"step": 2, "eval_loss": 1.5},
            {"step": 3, "loss": None}, {"bad": 1}]
    df = live.loss_frame(recs)
    assert sorted(df[df.series == "loss"].value) == [0.0, 2.0]
    assert len(df[df.series == "smoothed"]) == 2
    assert list(df[df.series == "eval_loss"].value) == [1.5]
    assert live.smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])
    log = live.loss_frame(recs, log_scale=True)
    assert log[log.series == "loss"].value.min() == pytest.approx(-8.0)


def test_progress_numbers():
    recs = [{"step": 5, "total_steps": 20, "elapsed_s": 10.0, "tokens_per_s": 120.0}]
    p = live.progress(recs, {"state": "running", "step": 5, "total_steps": 20})
    assert p["fraction"] == 0.25 and p["eta"] == pytest.approx(30.0) and p["tokens_per_s"] == 120.0
    html = live.progress_html(p, "running", "m/lora/x")
    assert 'data-step="5"' in html and "25.0%" in html


def test_a_whole_number_field_refuses_a_fraction_rather_than_rounding_it():
    """A bug hunt typed 2.5 into Gradient accumulation: gr.Number(precision=0) handed the form 2 and the run took
    it silently. The box hands on what was typed (its own preprocess, as the page's event does) and the spec
    names the field; a whole number still arrives as an int."""
    from webui.app import create_app

    box = create_app().tb_registry.items[F.rows_by_name()["gradient_accumulation_steps"].elem_id][0]
    typed = box.preprocess(2.5)
    flat, pre = T.collect(NAMES, TOP, form_values({"gradient_accumulation_steps": typed}))
    spec, errors = T.check(flat, pre)
    assert spec is None and [f for f, _ in errors] == ["gradient_accumulation_steps"], errors
    assert "got 2.5" in dict(errors)["gradient_accumulation_steps"]
    flat, pre = T.collect(NAMES, TOP, form_values({"gradient_accumulation_steps": box.preprocess(4.0)}))
    assert flat["gradient_accumulation_steps"] == 4 and type(flat["gradient_accumulation_steps"]) is int
