"""Stage ppo end to end through `tuneboard train` on the tiny Llama (3 rollout steps, a checkpoint at step 2): it logs
the PPO series, saves the adapter with its value head, writes a completions sample; a resume from the checkpoint
continues the same run (the value head and the KL coefficient come back). A reward model folder scores prompt +
response as the rm stage's loader does; validate checks the reward source.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow
TUNEBOARD = [sys.executable, "-m", "backend.cli"]
LOGGED = ("reward", "reward_std", "rewards/longer/mean", "kl", "kl_coef", "policy_loss", "value_loss",
          "clip_fraction", "value_clip_fraction", "entropy", "approx_kl", "completions/mean_length", "ppo/updates")


def log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def ppo_args(model: Path, out: Path, rewards: Path, *extra: str) -> list[str]:
    return [f"model_name_or_path={model}", f"output_dir={out}", "stage=ppo", "dataset=identity", "template=llama3",
            "cutoff_len=64", "max_completion_length=6", "per_device_train_batch_size=2", "ppo_buffer_size=2",
            "ppo_epochs=2", "gradient_accumulation_steps=1", "learning_rate=0.01", "logging_steps=1", "save_steps=2",
            "temperature=1.0", "top_p=1.0", "lora_rank=4", "init_kl_coef=0.05", f"reward_funcs={rewards}:longer",
            *extra]


@pytest.fixture(scope="module")
def rewards(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ppo_rewards") / "ppo_rewards.py"
    path.write_text("def longer(prompts, completions, **kwargs):\n"
                    "    return [len(c) / 40 for c in completions]\n")
    return path


@pytest.fixture(scope="module")
def trained(tiny_llama, rewards, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo") / "run"
    proc = subprocess.run(TUNEBOARD + ["train", *ppo_args(tiny_llama, out, rewards, "max_steps=3")], cwd="/tmp",
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_ppo_logs_its_series_and_saves_adapter_and_value_head(trained):
    rows = log_rows(trained)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in LOGGED:
        assert all(isinstance(r.get(key), float) for r in rows), key
    # ppo_epochs 2 x ppo_buffer_size 2 optimizer updates per rollout of 2 x 1 x 2 = 4 prompts
    assert all(r["ppo/updates"] == 4 for r in rows)
    assert rows[0]["kl_coef"] == pytest.approx(0.05) and rows[0]["kl"] == pytest.approx(0, abs=1e-4)
    assert rows[-1]["kl_coef"] != rows[0]["kl_coef"]  # adaptive: moved towards ppo_target
    assert all(r["reward"] == pytest.approx(r["rewards/longer/mean"]) and r["reward_std"] > 0 for r in rows)
    assert all(1 <= r["completions/mean_length"] <= 6 and 0 <= r["clip_fraction"] <= 1 for r in rows)
    for folder in (trained, trained / "checkpoint-2"):
        for name in ("adapter_model.safetensors", "value_head.safetensors", "ppo_state.json"):
            assert (folder / name).is_file(), folder / name
    log = (trained / "running_log.txt").read_text()
    assert "reference model: the base model (the adapter disabled; one base model in memory)" in log
    assert "ppo: 4 prompts a step, 2 epochs x 2 updates of 2 x 1 responses" in log
    samples = [json.loads(line) for line in (trained / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 3} and all(set(s["rewards"]) == {"longer"} for s in samples)
    assert all(s["reward"] == pytest.approx(len(s["completion"]) / 40) for s in samples)


def test_resume_continues_the_run_with_its_value_head_and_kl_coefficient(trained, tiny_llama, rewards, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    saved = json.loads((out / "checkpoint-2" / "ppo_state.json").read_text())
    # the run's own max_steps: a larger one stretches the learning-rate schedule, and step 3 is then another step
    proc = subprocess.run(TUNEBOARD + ["train", *ppo_args(tiny_llama, out, rewards, "max_steps=3",
                                                          f"resume_from_checkpoint={out / 'checkpoint-2'}")],
                          cwd="/tmp", capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # the log trimmed to the checkpoint, then continued
    assert rows[2]["kl_coef"] == pytest.approx(saved["kl_coef"], rel=1e-9)  # the coefficient came back
    # the same run: step 3 again from checkpoint-2 (policy, value head, optimizer, sampling seed) gives step 3's figures
    first = log_rows(trained)[2]
    for key in ("loss", "reward", "kl", "value_loss", "policy_loss"):
        assert rows[2][key] == pytest.approx(first[key], rel=1e-4, abs=1e-6), key
    log = (out / "running_log.txt").read_text()
    assert "resumed the policy, the value head and the KL coefficient" in log and "from checkpoint-2" in log
    start = load_file(str(trained / "checkpoint-2" / "value_head.safetensors"))["weight"]
    after = load_file(str(out / "value_head.safetensors"))["weight"]
    assert not after.equal(start)  # trained on from the checkpoint's head, not a fresh one
    assert after.allclose(load_file(str(trained / "value_head.safetensors"))["weight"], atol=1e-6)  # as the run did


def test_a_reward_model_folder_scores_prompt_and_response(tiny_llama, tmp_path):
    """reward_model (a sequence-classification folder, reward_model_type full) is the run's one reward: the scores
    are the reward model's, as stage grpo's reward model reward computes them (its own template)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    from backend.core.spec import SpecError, validate_spec
    from backend.evaluation.reward_score import RewardModelReward
    from backend.stages.ppo import Scorer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    config = AutoConfig.from_pretrained(tiny_llama, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path / "rm"
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    spec = validate_spec({"model_name_or_path": str(tiny_llama), "stage": "ppo", "dataset": "identity",
                          "reward_model": str(folder), "reward_model_type": "full"})
    notes = []
    scorer = Scorer(spec, SimpleNamespace(log=notes.append, warn=notes.append))
    rows = [{"prompt": "p", "reference": None, "schema": None,
             "conversation": json.dumps({"messages": [{"role": "user", "content": question}], "tools": None})}
            for question in ("Hello?", "Who are you, and where?")]
    answers = ["world", "I am a tiny model"]
    scores, parts = scorer(rows, ["p", "p"], answers, [[1], [2]])
    direct = RewardModelReward(str(folder), "rm")(["p", "p"], answers, conversation=[r["conversation"] for r in rows])
    assert scores == pytest.approx(direct) and scores[0] != scores[1]
    assert parts == [{"rm": s} for s in scores] and f"rewards: the reward model {folder}" in notes

    with pytest.raises(SpecError, match="holds a full model .*set reward_model_type full"):
        validate_spec({"model_name_or_path": str(tiny_llama), "stage": "ppo", "dataset": "identity",
                       "reward_model": str(folder)})
    with pytest.raises(SpecError, match="one reward source"):
        validate_spec({"model_name_or_path": str(tiny_llama), "stage": "ppo", "dataset": "identity",
                       "reward_model": str(folder), "reward_model_type": "full", "reward_funcs": "json_valid"})
