"""Reward models as rewards of the online RL stages, and stage rloo (issue 22 items 2 and 3), on tiny_llama: a
2-step LoRA rm run scores GRPO's completions (weighted with a built-in function, logged as rewards/rm/mean, the
same scores the reward model gives those completions when reloaded), RLOO trains with it and logs exactly what
TRL's RLOOTrainer logs, and a folder that holds no reward model is refused by validate in one line."""
from __future__ import annotations

import json

import pytest

from backend.core.spec import SpecError, validate_spec
from backend.stages import get_stage, matches

COMMON_KEYS = {"step", "total_steps", "epoch", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s",
               "eta_s", "memory_mb"}


def train(spec: dict) -> None:
    from backend.training import train as training  # heavy: torch, only for the tests that train

    out = spec["output_dir"]
    assert training.run(validate_spec(spec)) == 0, open(f"{out}/running_log.txt").read()[-3000:]


def log_rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def online(model, out, stage: str, reward_funcs: str, **extra) -> dict:
    return {"model_name_or_path": str(model), "output_dir": str(out), "stage": stage, "dataset": "identity",
            "max_samples": 8, "template": "llama3", "cutoff_len": 64, "max_completion_length": 8,
            "num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
            "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "plot_loss": False, "temperature": 1.0,
            "reward_funcs": reward_funcs, **extra}


def rm_spec(model, out, finetuning_type: str) -> dict:
    """A reward model trained 2 steps on dpo_en_demo, its 2 held-out pairs scored at the end (do_predict)."""
    return {"model_name_or_path": str(model), "output_dir": str(out), "stage": "rm", "dataset": "dpo_en_demo",
            "finetuning_type": finetuning_type, "max_samples": 10, "val_size": 2, "do_predict": True,
            "template": "llama3", "cutoff_len": 1024, "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1, "max_steps": 2, "learning_rate": 0.01, "save_strategy": "no",
            "plot_loss": False}


@pytest.fixture(scope="module")
def rm_run(tiny_llama, tmp_path_factory):
    """A LoRA reward model (adapter + trained score head): folder name 'rm'."""
    out = tmp_path_factory.mktemp("rm_reward") / "rm"
    train(rm_spec(tiny_llama, out, "lora"))
    return out


@pytest.mark.parametrize("finetuning_type", ["lora", "full"])
def test_a_reward_model_scores_answers_as_its_rm_run_did(finetuning_type, rm_run, tiny_llama, tmp_path):
    """The reward function gives a held-out pair's chosen answer the score the rm run gave it (same template,
    same tokens): a LoRA run (its base + adapter + score head) and a full one (a sequence-classification folder)."""
    from backend.evaluation.reward_score import RewardModelReward  # heavy: the scorer under test

    run = rm_run
    if finetuning_type == "full":
        run = tmp_path / "rm_full"
        train(rm_spec(tiny_llama, run, "full"))
    pairs = [json.loads(line) for line in (run / "generated_predictions.jsonl").read_text().splitlines()]
    scorer = RewardModelReward(str(run), "rm", batch_size=4)
    conversations = [json.dumps({"messages": [{"role": "user", "content": p["question"]}]}) for p in pairs]
    scores = scorer([""] * len(pairs), [p["chosen"] for p in pairs], conversation=conversations)
    assert len(pairs) == 2 and scores == pytest.approx([p["chosen_score"] for p in pairs], abs=1e-4)
    assert scorer.model.training is False and not any(p.requires_grad for p in scorer.model.parameters())


def test_grpo_with_a_reward_model_logs_its_scores(rm_run, tiny_llama, tmp_path):
    from backend.core.rundir import COMPLETIONS_FILE
    from backend.evaluation.reward_score import RewardModelReward  # heavy: the scorer under test, reloaded

    out = tmp_path / "grpo"
    train(online(tiny_llama, out, "grpo", f"json_valid,{rm_run}", reward_weights="0.5,2"))
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the rm's mean score, weighted with json_valid's into the reward
        assert isinstance(r["rewards/rm/mean"], float) and r["rewards/rm/std"] > 0
        assert r["reward"] == pytest.approx(0.5 * r["rewards/json_valid/mean"] + 2 * r["rewards/rm/mean"], abs=1e-4)
    samples = [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]
    assert samples and all(set(s["rewards"]) == {"json_valid", "rm"} for s in samples)
    log = (out / "running_log.txt").read_text()
    assert f"json_valid x 0.5, {rm_run} x 2" in log and "reward model rm: loading" in log
    # the logged scores are the reward model's: the same completions, rendered by its template, score the same
    scorer = RewardModelReward(str(rm_run), "rm", batch_size=4)
    head, tail = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|><|start_header_id|>"
    assert all(s["prompt"].startswith(head) and s["prompt"].count(tail) == 1 for s in samples)
    conversations = [json.dumps({"messages": [{"role": "user", "content": s["prompt"][len(head):].split(tail)[0]}],
                                 "tools": None}) for s in samples]
    again = scorer([s["prompt"] for s in samples], [s["completion"] for s in samples], conversation=conversations)
    assert again == pytest.approx([s["rewards"]["rm"] for s in samples], abs=1e-4)
    conversation = conversations[0]
    texts = ["I am an assistant.", "banana " * 5]
    scores = scorer(["p", "p"], texts, conversation=[conversation] * 2)
    assert len(set(scores)) == 2  # a trained head, not a constant


def test_rloo_trains_with_a_reward_model_and_logs_trls_metrics(rm_run, tiny_llama, tmp_path):
    from backend.core.rundir import COMPLETIONS_FILE

    out = tmp_path / "rloo"
    train(online(tiny_llama, out, "rloo", f"length_penalty,{rm_run}"))
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    declared = get_stage("rloo").metrics
    for r in rows:
        assert all(any(matches(k, p) for p in declared) for k in set(r) - COMMON_KEYS), sorted(set(r) - COMMON_KEYS)
        for key in ("reward", "rewards/rm/mean", "rewards/length_penalty/mean", "kl", "completions/mean_length",
                    "clip_ratio/region_mean"):
            assert isinstance(r[key], float), key
        assert r["reward"] == pytest.approx(r["rewards/length_penalty/mean"] + r["rewards/rm/mean"], abs=1e-4)
    assert (out / "adapter_model.safetensors").is_file() and (out / COMPLETIONS_FILE).is_file()


def test_a_folder_without_a_reward_model_is_refused_in_one_line(tiny_llama, tmp_path):
    for stage in ("grpo", "rloo"):
        with pytest.raises(SpecError) as exc:  # a causal LM: no score head
            validate_spec(online(tiny_llama, tmp_path / "x", stage, f"json_valid,{tiny_llama}"))
        message = str(exc.value)
        assert "\n" not in message.strip()
        assert message.startswith(f"reward_funcs: {tiny_llama} is not a reward model"), message
    with pytest.raises(SpecError, match=r"^reward_funcs: \S+/missing is not a folder"):
        validate_spec(online(tiny_llama, tmp_path / "x", "grpo", f"{tmp_path}/missing"))
