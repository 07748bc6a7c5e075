"""Stages kto and rm through the real CLI (`tuneboard train`, `tuneboard eval`, `tuneboard chat`) on a tiny
Qwen2, with the bundled kto_en_demo / dpo_en_demo (which must be learnable), and their validate refusals.
Each training run happens once per module and several tests read it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.core.spec import SpecError, validate_spec
from backend.stages import get_stage

TUNEBOARD = [sys.executable, "-m", "backend.cli"]
slow = pytest.mark.slow
# trainer_log.jsonl keys every stage writes; the rest are the stage's declared metrics
COMMON_KEYS = {"step", "total_steps", "epoch", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s",
               "eta_s", "memory_mb"}


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(TUNEBOARD + list(args), cwd="/tmp", capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def log_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "trainer_log.jsonl").read_text().splitlines()]


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def scores(path: Path) -> list[tuple[float, float]]:
    return [(r["chosen_score"], r["rejected_score"]) for r in map(json.loads, path.read_text().splitlines())]


# ------------------------------------------------------------------------------------------------ KTO
@pytest.fixture(scope="module")
def kto_run(tiny_qwen2, tmp_path_factory):
    """LoRA KTO on the first 16 rows of kto_en_demo: 4 batches of 4 per epoch, 3 epochs. Every epoch sees the same
    16 rows (shuffled), so the epochs' means compare like for like."""
    out = tmp_path_factory.mktemp("kto") / "run"
    cli("train", f"model_name_or_path={tiny_qwen2}", f"output_dir={out}", "stage=kto", "dataset=kto_en_demo",
        "max_samples=16", "cutoff_len=128", "per_device_train_batch_size=4", "gradient_accumulation_steps=1",
        "learning_rate=0.01", "max_steps=12", "logging_steps=1", "save_steps=100", "plot_loss=false")
    return out


@slow
def test_kto_trains_and_logs_exactly_trls_metrics(kto_run):
    st = status(kto_run)
    assert st["state"] == "completed" and st["exit_code"] == 0 and st["step"] == 12
    rows = log_rows(kto_run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    declared = set(get_stage("kto").metrics)
    # what TRL's KTOTrainer logs is what the stage declares (aux_loss: MoE models only); a shuffled batch of only
    # desirable (or only undesirable) rows logs no metrics of the other kind, nor margins
    logged = [set(row) - COMMON_KEYS for row in rows]
    assert all(keys <= declared for keys in logged) and set().union(*logged) == declared - {"aux_loss"}, logged
    assert rows[0].get("rewards/chosen", 0) == 0 and rows[0].get("rewards/rejected", 0) == 0  # reference = start
    assert any(r["kl"] > 0 for r in rows)
    assert (kto_run / "adapter_config.json").is_file() and (kto_run / "adapter_model.safetensors").is_file()
    assert not (kto_run / "ref").exists()  # no reference adapter copy saved next to the trained one
    assert "reference model: the base model" in (kto_run / "running_log.txt").read_text()


@slow
def test_kto_raises_chosen_over_rejected_rewards(kto_run):
    rows = log_rows(kto_run)
    first, last = rows[:4], rows[8:]  # epoch 1 and epoch 3: the same four batches

    def mean(key, part):  # over the steps whose batch had both kinds of rows
        values = [r[key] for r in part if key in r]
        return sum(values) / len(values)

    assert mean("rewards/chosen", last) > mean("rewards/rejected", last)
    assert mean("rewards/margins", last) > mean("rewards/margins", first) + 0.1, [r.get("rewards/margins") for r in rows]


@slow
def test_kto_adapter_chats(kto_run, tiny_qwen2):
    proc = cli("chat", f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={kto_run}", "max_new_tokens=4",
               "--query", "What is the capital of France?", timeout=300)
    assert proc.stdout.strip()


# ------------------------------------------------------------------------------------------------ RM
@pytest.fixture(scope="module")
def rm_run(tiny_qwen2, tmp_path_factory):
    """LoRA reward model on dpo_en_demo, a quarter held out, its held-out pairs scored at the end."""
    out = tmp_path_factory.mktemp("rm") / "run"
    cli("train", f"model_name_or_path={tiny_qwen2}", f"output_dir={out}", "stage=rm", "dataset=dpo_en_demo",
        "val_size=0.25", "do_predict=true", "cutoff_len=128", "per_device_train_batch_size=4",
        "gradient_accumulation_steps=1", "learning_rate=0.01", "max_steps=30", "logging_steps=5", "save_steps=100",
        "plot_loss=false")
    return out


@pytest.fixture(scope="module")
def rm_eval(rm_run, tiny_qwen2):
    """`tuneboard eval` of that run's adapter on the same held-out pairs: a fresh process reloads it."""
    out = rm_run.parent / "eval"
    cli("eval", f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={rm_run}", "stage=rm",
        "dataset=dpo_en_demo", "val_size=0.25", "cutoff_len=128", f"output_dir={out}")
    return out


@slow
def test_rm_trains_and_logs_its_metrics(rm_run):
    st = status(rm_run)
    assert st["state"] == "completed" and st["exit_code"] == 0
    rows = [r for r in log_rows(rm_run) if r["loss"] is not None]
    declared = set(get_stage("rm").metrics)
    assert rows and all(set(r) - COMMON_KEYS == declared for r in rows), sorted(set(rows[0]) - COMMON_KEYS)
    for r in rows:  # our mean chosen / rejected scores agree with TRL's own margin
        assert r["margin"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-4)
    config = json.loads((rm_run / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    from safetensors.torch import load_file

    assert any(".score." in k for k in load_file(rm_run / "adapter_model.safetensors"))  # the trained head


@slow
def test_rm_accuracy_on_held_out_pairs(rm_run, rm_eval):
    final = status(rm_run)["final_metrics"]
    assert final["eval_accuracy"] > 0.8 and final["eval_margin"] > 0, final
    results = json.loads((rm_eval / "eval_results.json").read_text())
    assert results["eval_pairs"] == 20  # a quarter of dpo_en_demo's 80 pairs
    assert results["eval_accuracy"] > 0.8 and results["eval_margin"] > 0, results
    assert results["eval_accuracy"] == pytest.approx(final["eval_accuracy"])


@slow
def test_rm_reloads_with_the_same_scores(rm_run, rm_eval):
    trained, reloaded = scores(rm_run / "generated_predictions.jsonl"), scores(rm_eval / "generated_predictions.jsonl")
    assert len(trained) == len(reloaded) == 20
    assert len({round(c, 3) for c, _ in trained}) > 1  # real scores, not a constant
    for (c1, r1), (c2, r2) in zip(trained, reloaded):
        assert c1 == pytest.approx(c2, abs=1e-5) and r1 == pytest.approx(r2, abs=1e-5)
    # each line carries the pair's text too (the Evaluate tab's pair view shows it)
    first = json.loads((rm_eval / "generated_predictions.jsonl").read_text().splitlines()[0])
    assert first["question"] and first["chosen"] and first["rejected"] and first["chosen"] != first["rejected"]


@slow
def test_rm_run_dir_names_its_base_for_ppo(rm_run, tiny_qwen2):
    from backend.evaluation.reward_score import reward_model_location

    assert reward_model_location(rm_run) == (str(tiny_qwen2), str(rm_run.resolve()))
    with pytest.raises(ValueError, match="not a reward model"):
        reward_model_location(tiny_qwen2)


@slow
def test_full_reward_model_saves_a_model_that_reloads(tiny_qwen2, tmp_path):
    run = tmp_path / "full"
    cli("train", f"model_name_or_path={tiny_qwen2}", f"output_dir={run}", "stage=rm", "dataset=dpo_en_demo",
        "finetuning_type=full", "max_samples=24", "val_size=4", "do_predict=true", "cutoff_len=128",
        "per_device_train_batch_size=4", "gradient_accumulation_steps=1", "learning_rate=0.001", "max_steps=2",
        "save_steps=100", "plot_loss=false")
    config = json.loads((run / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["pad_token_id"] is not None
    cli("eval", f"model_name_or_path={run}", "stage=rm", "dataset=dpo_en_demo", "max_samples=24", "val_size=4",
        "cutoff_len=128", f"output_dir={tmp_path / 'eval'}")
    trained, reloaded = scores(run / "generated_predictions.jsonl"), scores(tmp_path / "eval" / "generated_predictions.jsonl")
    assert len(trained) == len(reloaded) == 4
    for (c1, r1), (c2, r2) in zip(trained, reloaded):
        assert c1 == pytest.approx(c2, abs=1e-5) and r1 == pytest.approx(r2, abs=1e-5)


@slow
def test_a_model_without_a_trained_score_head_is_not_loaded_as_a_reward_model(kto_run, tiny_qwen2):
    from backend.evaluation.reward_score import load_reward_model

    with pytest.raises(ValueError, match="model_name_or_path: .* is not a reward model"):
        load_reward_model(validate_spec({"model_name_or_path": str(tiny_qwen2), "stage": "rm", "dataset": "dpo_en_demo"}))
    with pytest.raises(ValueError, match="adapter_name_or_path: .* is not a reward model"):  # a KTO (causal LM) adapter
        load_reward_model(validate_spec({"model_name_or_path": str(tiny_qwen2), "adapter_name_or_path": str(kto_run),
                                         "stage": "rm", "dataset": "dpo_en_demo"}))


# ------------------------------------------------------------------------------------------------ validate
def refusals(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate_spec(data)
    return dict(info.value.errors)


def test_kto_settings_it_cannot_run_are_refused():
    m = refusals({"stage": "kto", "dataset": "kto_en_demo", "per_device_train_batch_size": 1, "pref_ftx": 0.5,
                  "train_sampling_strategy": "random"})
    assert "2 or more rows per batch" in m["per_device_train_batch_size"]
    assert "no SFT loss term" in m["pref_ftx"]
    assert "train_sampling_strategy" not in m  # the KL pairs are fixed before sampling: any order works


def test_kto_pairs_kl_rows_as_llama_factory_and_shuffles_the_rows(tiny_qwen2, tmp_path):
    """Each prompt's KL completion is the previous row's answer within chunks of preprocessing_batch_size rows
    (LLaMA-Factory's preprocessing batches), not within training batches as TRL pairs them; so the rows are shuffled
    as every stage's are, or read in order with train_sampling_strategy: sequential."""
    from datasets import Dataset
    from torch.utils.data import RandomSampler, SequentialSampler
    from trl import KTOConfig

    from backend.stages import kto
    from backend.stages.base import trainable_model, training_arguments
    from backend.training.models import load_tokenizer, resolve_model

    rows = [{"prompt_ids": [5, 6], "completion_ids": [10 + i], "label": i % 2 == 0} for i in range(7)]
    samplers = {}
    for order in ("default", "sequential"):
        spec = validate_spec({"model_name_or_path": str(tiny_qwen2), "stage": "kto", "dataset": "kto_en_demo",
                              "preprocessing_batch_size": 3, "per_device_train_batch_size": 2, "max_steps": 1,
                              "report_to": "none", "save_strategy": "no", "lora_rank": 2,
                              **({} if order == "default" else {"train_sampling_strategy": order})},
                             check_files=False)
        model = trainable_model(spec, _Quiet(), resolve_model(spec.model_name_or_path))
        args = training_arguments(spec, tmp_path / order, has_eval=False, args_class=KTOConfig,
                                  extra={"max_length": 64, "train_sampling_strategy": "sequential"})
        trainer = kto._kto_trainer_class(spec)(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                               processing_class=load_tokenizer(resolve_model(str(tiny_qwen2))))
        assert trainer.train_dataset["KL_completion_ids"] == [[12], [10], [11], [15], [13], [14], [16]]
        samplers[order] = type(trainer._get_train_sampler())
    assert samplers == {"default": RandomSampler, "sequential": SequentialSampler}


class _Quiet:
    def log(self, message):
        pass

    warn = log


@pytest.mark.parametrize("stage, dataset", [("kto", "kto_en_demo"), ("rm", "dpo_en_demo")])
def test_packing_and_prompt_loss_are_refused_for_scored_pairs(stage, dataset):
    m = refusals({"stage": stage, "dataset": dataset, "packing": True, "train_on_prompt": True})
    assert "packing does not apply" in m["packing"] and "no prompt loss" in m["train_on_prompt"]
    assert "packing does not apply" in refusals({"stage": stage, "dataset": dataset, "neat_packing": True})["packing"]


@pytest.mark.parametrize("stage, dataset", [("kto", "kto_en_demo"), ("rm", "dpo_en_demo")])
def test_lora_dropout_is_refused_where_the_trainer_switches_dropout_off(stage, dataset):
    assert "dropout off" in refusals({"stage": stage, "dataset": dataset, "lora_dropout": 0.1})["lora_dropout"]
    validate_spec({"stage": stage, "dataset": dataset, "lora_dropout": 0.1, "finetuning_type": "full"})


def test_kto_and_rm_defaults_validate():
    validate_spec({"stage": "kto", "dataset": "kto_en_demo"})
    validate_spec({"stage": "rm", "dataset": "dpo_en_demo", "per_device_train_batch_size": 1})
