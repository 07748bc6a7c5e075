"""tuneboard export of a reward model (stage rm): a LoRA rm run (adapter task_type SEQ_CLS, score head in
modules_to_save) and a full rm run both export as a merged AutoModelForSequenceClassification folder whose
scores equal the source's; GGUF is refused at validate and at export; the light check that says "reward
model" from JSON / YAML files alone; the reward verification catching a bad export."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from backend.exporting.export import ExportError, compare_reward, export
from backend.core.rundir import is_reward_model_dir, reward_model_folder
from backend.core.spec import SpecError, validate_spec

TUNEBOARD = [sys.executable, "-m", "backend.cli"]
PAIRS = [  # not the export's own probe pairs: the test scores pairs of its own
    {"messages": [{"role": "user", "content": "Name a colour."}], "chosen": {"role": "assistant", "content": "Blue."},
     "rejected": {"role": "assistant", "content": "Seven hundred."}},
    {"messages": [{"role": "user", "content": "Say hello in French."}],
     "chosen": {"role": "assistant", "content": "Bonjour!"}, "rejected": {"role": "assistant", "content": "Goodbye."}},
]


def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(TUNEBOARD + list(args), cwd="/tmp", capture_output=True, text=True, timeout=900)
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def train_rm(model, out, *extra: str):
    cli("train", f"model_name_or_path={model}", f"output_dir={out}", "stage=rm", "dataset=dpo_en_demo",
        "max_samples=16", "cutoff_len=64", "per_device_train_batch_size=4", "gradient_accumulation_steps=1",
        "learning_rate=0.01", "max_steps=2", "save_steps=100", "plot_loss=false", *extra)
    return out


@pytest.fixture(scope="module")
def rm_lora(tiny_qwen2, tmp_path_factory):
    return train_rm(tiny_qwen2, tmp_path_factory.mktemp("rm") / "lora")


def scores_of(model_name_or_path, adapter, pairs=PAIRS) -> list[tuple[float, float]]:
    """Scores through the rm stage's own loader (base + score head + adapter), the reference."""
    from backend.training.models import resolve_model
    from backend.dataprep.preference import build_preference_dataset
    from backend.dataprep.resolve import pick_template
    from backend.evaluation.reward_score import load_reward_model, score_pairs

    spec = validate_spec({"model_name_or_path": str(model_name_or_path), "stage": "rm", "dataset": "dpo_en_demo",
                          "adapter_name_or_path": str(adapter) if adapter else None,
                          "finetuning_type": "lora" if adapter else "full"})
    model, tok = load_reward_model(spec)
    template = pick_template("auto", resolve_model(str(model_name_or_path)), tok)
    rows, _ = build_preference_dataset(pairs, template, tok, None)
    return score_pairs(model, tok, rows), rows


def export_scores(folder, rows) -> list[tuple[float, float]]:
    """Scores of the exported folder loaded the plain transformers way, with its own tokenizer's pad id."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from backend.evaluation.reward_score import score_pairs

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    return score_pairs(model, AutoTokenizer.from_pretrained(folder), rows)


def _close(a, b, tol=1e-4):
    return all(abs(x - y) <= tol for p, q in zip(a, b) for x, y in zip(p, q)) and len(a) == len(b)


@pytest.mark.slow
def test_lora_reward_model_exports_as_a_merged_sequence_classifier(rm_lora, tiny_qwen2, tmp_path):
    out = tmp_path / "rm-export"
    report = export(validate_spec({"model_name_or_path": str(tiny_qwen2), "adapter_name_or_path": str(rm_lora),
                                   "finetuning_type": "lora", "export_dir": str(out)}))
    assert report["ok"], report["checks"]
    assert {c["name"] for c in report["checks"]} >= {"scores", "ranking", "score_head", "tokenizer", "shards"}
    assert report["source"]["reward_model"] is True
    assert json.loads((out / "export_report.json").read_text())["ok"] is True
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    assert config["pad_token_id"] is not None
    assert not (out / "adapter_config.json").exists() and is_reward_model_dir(out)

    want, rows = scores_of(tiny_qwen2, rm_lora)
    got = export_scores(out, rows)
    assert _close(want, got), (want, got)
    # the trained head is in the export (not a fresh random one): it is the adapter's saved score weight
    from safetensors.torch import load_file

    saved = load_file(rm_lora / "adapter_model.safetensors")
    head = next(v for k, v in saved.items() if k.endswith("score.weight"))
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(exported["score.weight"], head.to(exported["score.weight"].dtype))

    # the export is itself a reward model for the rm stage's loader (eval, PPO's reward_model)
    again, _ = scores_of(out, None)
    assert _close(want, again)


@pytest.mark.slow
def test_full_reward_model_run_exports_with_its_scores(tiny_qwen2, tmp_path):
    run = train_rm(tiny_qwen2, tmp_path / "full", "finetuning_type=full", "learning_rate=0.001")
    out = tmp_path / "full-export"
    proc = cli("export", f"model_name_or_path={run}", "finetuning_type=full", f"export_dir={out}")
    assert "export PASSED" in proc.stdout
    report = json.loads((out / "export_report.json").read_text())
    assert report["ok"] and report["source"]["reward_model"] and report["source"]["adapters"] == []
    want, rows = scores_of(run, None)
    assert _close(want, export_scores(out, rows))


@pytest.mark.slow
def test_gguf_of_a_reward_model_is_refused_naming_the_field(rm_lora, tiny_qwen2, tmp_path):
    args = [f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={rm_lora}", "finetuning_type=lora",
            f"export_dir={tmp_path / 'g'}", "export_format=gguf"]
    proc = cli("validate", *args, ok=False)
    assert "export_format" in proc.stderr and "reward model" in proc.stderr and "safetensors" in proc.stderr
    proc = cli("export", *args, ok=False)
    assert "export_format" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "g").exists()
    # at export start too, where validation skipped the file checks
    spec = validate_spec(dict(a.split("=", 1) for a in args), check_files=False)
    with pytest.raises(ExportError, match="export_format: gguf .* is a reward model"):
        export(spec)


def test_reward_model_light_check(tmp_path):
    def folder(name, files: dict):
        d = tmp_path / name
        d.mkdir()
        for fname, text in files.items():
            (d / fname).write_text(text)
        return d

    rm_adapter = folder("a", {"adapter_config.json": json.dumps({"task_type": "SEQ_CLS"}),
                              "run_spec.yaml": "stage: rm\n"})
    lm_adapter = folder("b", {"adapter_config.json": json.dumps({"task_type": "CAUSAL_LM"}),
                              "run_spec.yaml": "stage: rm\n"})  # the adapter's own file decides
    full = folder("c", {"config.json": json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                   "id2label": {"0": "LABEL_0"}})})
    two_labels = folder("d", {"config.json": json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                         "id2label": {"0": "a", "1": "b"}})})
    lm = folder("e", {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]})})
    unsaved = folder("f", {"run_spec.yaml": "stage: rm\nmodel_name_or_path: x\n"})
    sft_unsaved = folder("g", {"run_spec.yaml": "stage: sft\n"})
    broken = folder("h", {"adapter_config.json": "{not json", "run_spec.yaml": "stage: [rm"})
    assert [is_reward_model_dir(d) for d in (rm_adapter, lm_adapter, full, two_labels, lm, unsaved, sft_unsaved,
                                              broken, tmp_path / "missing", None)] == \
        [True, False, True, False, False, True, False, False, False, False]
    assert reward_model_folder(str(lm), str(rm_adapter)) == str(rm_adapter)
    assert reward_model_folder(str(full), None) == str(full)
    assert reward_model_folder(str(lm), f"{rm_adapter},{lm_adapter}") is None  # the last adapter holds the head
    # validate refuses GGUF for it, naming the field; safetensors is fine
    with pytest.raises(SpecError) as info:
        validate_spec({"model_name_or_path": str(full), "finetuning_type": "full", "export_format": "gguf"})
    assert "reward model" in dict(info.value.errors)["export_format"]
    validate_spec({"model_name_or_path": str(full), "finetuning_type": "full", "export_format": "safetensors"})


def test_reward_verification_fails_an_export_with_other_scores():
    src = {"prompts": [[1, 2]], "scores": [(1.0, -1.0), (0.5, 0.25)]}
    got = {"scores": [(1.0, -1.0), (0.5, 0.25)], "architecture": "LlamaForSequenceClassification", "num_labels": 1,
           "pad_token_id": 0, "tokenizer_pad_id": 0, "renders": ["r"], "ids": [[1, 2]], "shards": ["model.safetensors"]}
    expected = {"rendered": ["r"]}
    assert all(c["ok"] for c in compare_reward(src, got, stored="float32", expected=expected))
    bad = compare_reward(src, dict(got, scores=[(1.0, -1.0), (0.1, 0.3)], pad_token_id=None), stored="float32",
                         expected=expected)
    failed = {c["name"] for c in bad if not c["ok"]}
    assert failed == {"scores", "ranking", "score_head"}
