"""The Train tab's dataset picker follows the stage: the sets of the bundled data/dataset_info.json that fit each
stage's declared data kind (backend/stages), and a switch, said in one line, when the current set does not fit."""
import pytest

from backend.core import paths
from backend.core.spec import SpecError, validate_spec
from backend.stages import DATA_KINDS, IMPLEMENTED, get_stage
from webui import choices
from webui import datasets as D
from webui.tabs import train as T

INFO = choices.dataset_info()


def test_every_data_kind_has_its_accepted_dataset_kinds():
    assert set(D.ACCEPTS) == set(DATA_KINDS)


def test_bundled_sets_have_the_kind_their_entries_say():
    kinds = {name: D.entry_kind(entry) for name, entry in INFO.items()}
    assert kinds["dpo_en_demo"] == "ranking" and kinds["kto_en_demo"] == "kto" and kinds["c4_demo"] == "text"
    assert kinds["identity"] == kinds["alpaca_en_demo"] == kinds["toolcall_demo"] == "plain"


def test_the_offered_sets_are_of_the_stage_kind():
    assert D.fitting_datasets("dpo", INFO) == D.fitting_datasets("rm", INFO) == ["dpo_en_demo"]
    assert D.fitting_datasets("orpo", INFO) == D.fitting_datasets("simpo", INFO) == ["dpo_en_demo"]
    assert D.fitting_datasets("kto", INFO) == ["kto_en_demo"]
    sft = D.fitting_datasets("sft", INFO)
    assert "identity" in sft and not {"dpo_en_demo", "kto_en_demo", "c4_demo"} & set(sft)
    assert D.fitting_datasets("pt", INFO)[0] == "c4_demo" and "dpo_en_demo" not in D.fitting_datasets("pt", INFO)
    assert "extraction_demo" in D.fitting_datasets("grpo", INFO)


@pytest.mark.parametrize("stage", [s for s in IMPLEMENTED if get_stage(s).data in ("ranking", "kto")])
def test_each_offered_set_passes_validate_for_its_stage(stage):
    """What the picker offers is what `validate` accepts for the stage (the spec's own data-kind check)."""
    for name in D.fitting_datasets(stage, INFO):
        validate_spec({"model_name_or_path": paths.DEFAULT_MODEL_ID, "stage": stage, "dataset": name})
    misfit = next(n for n in INFO if n not in D.fitting_datasets(stage, INFO))
    with pytest.raises(SpecError):
        validate_spec({"model_name_or_path": paths.DEFAULT_MODEL_ID, "stage": stage, "dataset": misfit})


def test_fit_dataset_switches_only_what_does_not_fit():
    assert D.fit_dataset("dpo", "identity", INFO) == ("dpo_en_demo", ["identity"])
    assert D.fit_dataset("kto", "identity,dpo_en_demo", INFO) == ("kto_en_demo", ["identity", "dpo_en_demo"])
    assert D.fit_dataset("sft", "identity", INFO) == ("identity", [])
    # a name the file does not register (registered later, another folder) is the user's: kept
    assert D.fit_dataset("dpo", "my_pairs", INFO) == ("my_pairs", [])
    assert D.fit_dataset("dpo", "my_pairs,identity", INFO) == ("my_pairs", ["identity"])
    assert D.fit_dataset("kto", "identity", {"identity": {}}) == ("", ["identity"])  # nothing fits


def test_picking_dpo_switches_the_form_and_says_so_in_the_page_language():
    dataset, message = T.dataset_for_stage("dpo", "identity", "", "de")
    assert dataset["value"] == "dpo_en_demo" and dataset["choices"] == ["dpo_en_demo"]
    assert "identity" in message and "dpo_en_demo" in message and "DPO" in message and "Präferenzpaaren" in message
    # a set that fits stays, with the stage's sets offered and no message
    dataset, message = T.dataset_for_stage("sft", "identity", "", "en")
    assert "value" not in dataset and "identity" in dataset["choices"] and "dpo_en_demo" not in dataset["choices"]
    assert message is not None and not isinstance(message, str)  # gr.skip(): the message line keeps its text
