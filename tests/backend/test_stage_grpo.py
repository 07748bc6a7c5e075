"""Stage grpo end to end through `tuneboard train` subprocesses on a tiny model: it learns a toy reward, logs the
reward / kl / length series and a completions sample, its adapter chats, a STOP file during generation stops
it at the next step with no process left, and a user's reward function that raises fails the run in one line.

The toy task: a random tiny model samples nearly uniformly over 49k tokens, which no reward can move in a few
steps. Its output head is scaled up (sharper, as trained models are) and the reward is the share of completion
tokens among the 10% of the vocabulary whose output embeddings point most along one fixed direction: a LoRA
adapter can push every hidden state along that direction, so the reward is reachable in a dozen steps.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
TUNEBOARD = [sys.executable, "-m", "backend.cli"]
STEPS = 10
MARGIN = 0.4  # the mean reward of the last 3 steps beats the first 3 by at least this (on a 0..1 reward)


def log_rows(out: Path) -> list[dict]:
    path = out / "trainer_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


@pytest.fixture(scope="module")
def toy(tiny_llama, tmp_path_factory):
    """(sharp tiny model folder, reward file) for the toy task."""
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("grpo_toy")
    model = root / "tiny_sharp"
    shutil.copytree(tiny_llama, model)
    weights = load_file(model / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 25
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    head = weights["lm_head.weight"]
    direction = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
    targets = torch.argsort(head @ direction, descending=True)[: head.shape[0] // 10].tolist()
    (root / "targets.json").write_text(json.dumps(targets))
    rewards = root / "toy_rewards.py"
    rewards.write_text(
        "import json\n"
        f"TARGETS = set(json.load(open({str(root / 'targets.json')!r})))\n\n"
        "def aligned(prompts, completions, completion_ids, **kwargs):\n"
        "    return [sum(t in TARGETS for t in ids) / max(len(ids), 1) for ids in completion_ids]\n\n"
        "def broken(prompts, completions, **kwargs):\n"
        "    raise KeyError('score')\n")
    return model, rewards


def grpo_args(model: Path, out: Path, *extra: str) -> list[str]:
    return [f"model_name_or_path={model}", f"output_dir={out}", "stage=grpo", "dataset=identity", "template=llama3",
            "cutoff_len=64", "max_completion_length=8", "num_generations=4", "per_device_train_batch_size=8",
            "gradient_accumulation_steps=1", "learning_rate=0.03", "logging_steps=1", "save_steps=1000",
            "temperature=1.0", "top_p=1.0", "lora_rank=8", *extra]


@pytest.fixture(scope="module")
def learned(toy, tmp_path_factory):
    """One GRPO run on the toy reward (plus json_valid at weight 0: logged, not rewarded)."""
    model, rewards = toy
    out = tmp_path_factory.mktemp("grpo") / "run"
    proc = subprocess.run(TUNEBOARD + ["train", *grpo_args(model, out, f"max_steps={STEPS}",
                                                           f"reward_funcs={rewards}:aligned,json_valid",
                                                           "reward_weights=1,0")],
                          cwd="/tmp", capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_grpo_learns_the_toy_reward(learned):
    rows = log_rows(learned)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + MARGIN, rewards
    # the total is the weighted sum: json_valid has weight 0, so the total is the toy reward itself
    assert all(r["reward"] == pytest.approx(r["rewards/aligned/mean"]) for r in rows)
    assert all(r["rewards/json_valid/mean"] is not None and r["reward_std"] is not None for r in rows)


def test_grpo_logs_kl_length_and_clip_series(learned):
    rows = log_rows(learned)
    for key in ("kl", "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "entropy",
                "rewards/aligned/std"):
        assert all(isinstance(r.get(key), float) for r in rows), key
    assert rows[0]["kl"] == 0 and max(r["kl"] for r in rows) > 0  # the policy moved away from its start
    assert all(1 <= r["completions/mean_length"] <= 8 for r in rows)
    assert all(r["tokens_per_s"] for r in rows[1:])


def test_completions_sample_in_the_run_dir_and_log(learned):
    from backend.core.rundir import COMPLETIONS_FILE

    samples = [json.loads(line) for line in (learned / COMPLETIONS_FILE).read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(1, STEPS + 1))
    assert all(set(s["rewards"]) == {"aligned", "json_valid"} and s["completion"] for s in samples)
    assert all(s["prompt"].startswith("<|begin_of_text|><|start_header_id|>user") for s in samples)
    assert all(s["reward"] == pytest.approx(s["rewards"]["aligned"]) for s in samples)
    last = [s for s in samples if s["step"] == STEPS]
    assert sum(s["reward"] for s in last) / len(last) > 0.5
    log = (learned / "running_log.txt").read_text()
    assert log.count("completion (reward ") == STEPS and ":aligned x 1, json_valid x 0" in log
    assert "reference model: the base model" in log


def test_grpo_adapter_chats(learned, toy, capsys):
    """The saved adapter (one adapter: no copy of TRL's reference adapter) loads and answers in chat."""
    from backend.serving import chat
    from backend.core.spec import load_spec

    assert (learned / "adapter_model.safetensors").is_file() and not (learned / "ref").exists()
    spec = load_spec(None, [f"model_name_or_path={toy[0]}", f"adapter_name_or_path={learned}", "template=llama3",
                            "do_sample=false", "max_new_tokens=6"])
    assert chat.main(spec, query="Who are you?") == 0
    printed = capsys.readouterr().out
    engine = list(chat.load_engines(spec, include_base=False).values())[-1]
    reply = engine.chat([{"role": "user", "content": "Who are you?"}])
    assert reply.text.strip() and printed.strip() == reply.text.strip()


def test_stop_file_during_generation_stops_at_the_next_step(toy, tmp_path):
    model, rewards = toy
    out = tmp_path / "stopped"
    proc = subprocess.Popen(TUNEBOARD + ["train", *grpo_args(model, out, "max_steps=200", "max_completion_length=16",
                                                             "per_device_train_batch_size=4",
                                                             f"reward_funcs={rewards}:aligned")],
                            cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while not log_rows(out) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    seen = len(log_rows(out))  # the next step is generating now
    (out / "STOP").touch()
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, output[-3000:]
    st = status(out)
    assert st["state"] == "aborted" and seen <= st["step"] <= seen + 2 < 200
    assert "stop requested (STOP file found)" in (out / "running_log.txt").read_text()
    with pytest.raises(ProcessLookupError):  # nothing of the run's process group is left
        os.killpg(proc.pid, 0)


def test_a_reward_function_that_raises_fails_the_run_naming_it(toy, tmp_path):
    model, rewards = toy
    out = tmp_path / "broken"
    proc = subprocess.run(TUNEBOARD + ["train", *grpo_args(model, out, "max_steps=2",
                                                           f"reward_funcs={rewards}:broken")],
                          cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    st = status(out)
    assert st["state"] == "failed"
    assert st["error"] == f"reward function {rewards}:broken raised KeyError: 'score'"
    assert "Traceback" not in (out / "running_log.txt").read_text()
