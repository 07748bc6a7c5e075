"""`tuneboard preview` of preference data (what the Data tab shows): a ranking row is its prompt once plus
the chosen and the rejected answer, split and counted exactly as backend.dataprep.preference gives them to the DPO
/ reward trainers; a KTO row carries its desirable / undesirable tag. In-process (main + capsys)."""
import json

import pytest

from backend.dataprep import preview


def run(capsys, *args):
    code = preview.main(list(args))
    out = capsys.readouterr().out
    return code, out


def preview_json(capsys, *args):
    code, out = run(capsys, *args, "--json")
    result = json.loads(out)
    assert code == 0, result
    return result


@pytest.fixture(scope="module")
def tokenizer():
    from backend.training.models import load_tokenizer, resolve_model
    from backend.core.paths import DEFAULT_MODEL_ID

    return load_tokenizer(resolve_model(DEFAULT_MODEL_ID))


def text(part):
    return "".join(s["text"] for s in part["segments"])


def raw_rows(name):
    """The bundled file's own rows (the preview is checked against them, whatever the demo data holds)."""
    from backend.core.paths import DATA_DIR

    path = DATA_DIR / json.loads((DATA_DIR / "dataset_info.json").read_text())[name]["file_name"]
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def test_ranking_row_is_prompt_once_then_chosen_and_rejected(capsys, tokenizer):
    raw = raw_rows("dpo_en_demo")[2]
    row = preview_json(capsys, "--dataset", "dpo_en_demo", "--index", "2")
    assert row["kind"] == "ranking" and row["source"] == "dpo_en_demo" and row["row"] == 2
    prompt, chosen, rejected = text(row["prompt"]), text(row["chosen"]), text(row["rejected"])
    assert prompt.count(raw["instruction"]) == 1 and raw["input"] in prompt
    assert prompt.endswith("<|im_start|>assistant\n")  # the answer's header belongs to the prompt
    assert chosen == raw["chosen"] + "<|im_end|>"
    assert rejected == raw["rejected"] + "<|im_end|>"
    assert raw["chosen"] not in prompt and raw["rejected"] not in prompt
    # the prompt is masked and each answer is trained (as the DPO trainer treats them)
    assert not any(s["trained"] for s in row["prompt"]["segments"])
    assert all(s["trained"] for s in row["chosen"]["segments"] + row["rejected"]["segments"])
    # the shown text is exactly the tokens the trainer gets, and the counts are theirs
    assert tokenizer.decode(row["prompt_ids"]) == prompt
    assert tokenizer.decode(row["chosen_ids"]) == chosen and tokenizer.decode(row["rejected_ids"]) == rejected
    assert [row[k]["num_tokens"] for k in ("prompt", "chosen", "rejected")] == \
        [len(row["prompt_ids"]), len(row["chosen_ids"]), len(row["rejected_ids"])]
    assert row["num_trained"] == len(row["chosen_ids"]) + len(row["rejected_ids"])
    assert row["truncated"] is False


def test_ranking_row_truncation_keeps_the_answers(capsys):
    full = preview_json(capsys, "--dataset", "dpo_en_demo", "--index", "2")
    cutoff = full["num_tokens"] - 8
    row = preview_json(capsys, "--dataset", "dpo_en_demo", "--index", "2", "--cutoff-len", str(cutoff))
    assert row["truncated"] is True
    assert row["prompt"]["num_tokens"] + max(row["chosen"]["num_tokens"], row["rejected"]["num_tokens"]) <= cutoff
    # the answers are untouched: the prompt lost its oldest tokens instead
    assert row["chosen_ids"] == full["chosen_ids"] and row["rejected_ids"] == full["rejected_ids"]
    assert row["prompt"]["num_tokens"] == full["prompt"]["num_tokens"] - 8


def test_kto_rows_carry_their_tag(capsys):
    raw = raw_rows("kto_en_demo")
    good = next(i for i, r in enumerate(raw) if r["label"] is True)
    bad = next(i for i, r in enumerate(raw) if r["label"] is False)
    for i, tag in ((good, "desirable"), (bad, "undesirable")):
        row = preview_json(capsys, "--dataset", "kto_en_demo", "--index", str(i))
        assert (row["kind"], row["tag"], row["kto_tag"]) == ("kto", tag, raw[i]["label"])
        # only the last answer is trained (the completion KTO scores), the rest is its prompt
        trained = "".join(s["text"] for s in row["segments"] if s["trained"])
        assert trained == raw[i]["messages"][-1]["content"] + "<|im_end|>"
        assert row["num_trained"] == len(row["completion_ids"])


def test_human_output_and_stats_of_a_ranking_dataset(capsys):
    code, out = run(capsys, "--dataset", "dpo_en_demo")
    assert code == 0 and "[prompt:" in out and "[chosen:" in out and "[rejected:" in out
    stats = preview_json(capsys, "--dataset", "dpo_en_demo", "--stats")
    assert stats["num_rows"] == len(raw_rows("dpo_en_demo")) and stats["rows_without_trained_tokens"] == [] and stats["max_length"] > 0


def test_a_stage_of_the_wrong_kind_is_refused_naming_the_dataset(capsys):
    code, out = run(capsys, "--dataset", "dpo_en_demo", "--stage", "sft", "--json")
    assert code == 1
    error = json.loads(out)["error"]
    assert "dpo_en_demo" in error and "ranking" in error
