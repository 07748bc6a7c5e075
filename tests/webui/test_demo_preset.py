"""The first run teaches something visible (issue 24): the Train form's first-open preset and `make demo`'s
recipe (examples/sft_lora_identity.yaml) are one setting, measured to make the bundled default model answer
"Who are you?" with its new identity_name. The training itself is checked once, by the slow
test_identity_demo_adapter_answers_with_the_trained_identity (tests/backend/test_engine.py), which trains the
example; this test holds the form to the same values, so a change to one of the two shows up here."""
from backend.core import paths
from backend.core.spec import load_spec, validate_spec
from webui import fields as F

# What decides whether 40 identity rows are learnt: the data, the method, the update size and count.
TEACHING_KEYS = ("model_name_or_path", "stage", "finetuning_type", "dataset", "identity_name", "identity_author",
                 "cutoff_len", "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "seed",
                 "lora_target", "lora_rank", "resolved_lora_alpha", "lora_dropout",
                 "resolved_gradient_checkpointing")


def form_preset_spec():
    """The spec the Train form starts a run with when nothing is changed (top bar + form, preset filled in)."""
    names = list(F.TOPBAR_FIELDS) + [r.name for r in F.form_rows()]
    flat, errors = F.values_to_flat(names, F.preset_values(names))
    assert errors == []
    return validate_spec(flat)


def test_form_preset_and_demo_recipe_agree_on_the_teaching_keys():
    form = form_preset_spec()
    demo = load_spec(paths.EXAMPLES_DIR / "sft_lora_identity.yaml")
    differ = {k: (getattr(form, k), getattr(demo, k)) for k in TEACHING_KEYS if getattr(form, k) != getattr(demo, k)}
    assert differ == {}, f"form preset vs examples/sft_lora_identity.yaml: {differ}"
    # the measured setting itself (see the example's header), so that "agree" cannot mean "both reverted"
    assert (demo.dataset, demo.finetuning_type, demo.lora_target) == ("identity", "lora", "all")
    assert demo.learning_rate >= 1e-3
