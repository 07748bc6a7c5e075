"""reward_model_type api (LLaMA-Factory's convention): stage ppo scores each rollout batch through an OpenAI-compatible
scoring endpoint, POST {reward_model}/v1/score/evaluation, in one request with the key as a Bearer header; `tuneboard
api --reward-model RM` answers that route with the score the reward model gives in-process. The route's scores equal
the in-process ones; a PPO run against a real server subprocess logs the server's scores, one request per rollout
batch, and its run folder never holds the key; a non-URL, a URL with lora/full, an unreachable URL are one line each.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api_server import start_server, stop_server

pytestmark = pytest.mark.slow
TUNEBOARD = [sys.executable, "-m", "backend.cli"]
SECRET = "sk-h22-never-on-disk-0123456789"


@pytest.fixture(scope="module")
def reward_folder(tiny_llama, tmp_path_factory) -> Path:
    """A sequence-classification model on the tiny Llama (a full reward model: reward_model_type full's folder)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    config = AutoConfig.from_pretrained(tiny_llama, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("reward_api") / "rm"
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def conversations(*questions: str) -> list[str]:
    return [json.dumps({"messages": [{"role": "user", "content": q}], "tools": None}) for q in questions]


def test_the_score_route_gives_the_in_process_reward_model_score(reward_folder):
    from fastapi.testclient import TestClient

    from backend.evaluation.reward_api import ApiReward
    from backend.evaluation.reward_score import RewardModelReward
    from backend.serving.api import create_app

    rm = RewardModelReward(str(reward_folder), "rm")
    convs, answers = conversations("Hello?", "Who are you, and where?"), ["world", "I am a tiny model"]
    direct = rm(["p", "p"], answers, conversation=convs)
    # the texts a PPO run sends (rendered by the rm's own template here, so the two must agree)
    texts = ApiReward("http://unused", None, template=rm.template, tokenizer=rm.tokenizer,
                      cutoff_len=rm.cutoff_len).texts(answers, convs)
    client = TestClient(create_app({}, api_key=SECRET, scorers={"rm": rm}))
    headers = {"Authorization": f"Bearer {SECRET}"}
    r = client.post("/v1/score/evaluation", json={"model": "model", "messages": texts}, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "rm" and body["object"] == "score.evaluation" and body["id"].startswith("scoreeval-")
    assert body["scores"] == pytest.approx(direct, abs=1e-4) and direct[0] != direct[1]

    assert client.post("/v1/score/evaluation", json={"model": "rm", "messages": texts}).status_code == 401
    r = client.post("/v1/chat/completions", headers=headers,
                    json={"model": "rm", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "reward model" in r.json()["error"]["message"]
    r = client.post("/v1/score/evaluation", json={"model": "rm", "messages": ["x", ""]}, headers=headers)
    assert r.status_code == 400 and "messages[1]" in r.json()["error"]["message"]
    r = client.post("/v1/score/evaluation", json={"model": "rm", "messages": []}, headers=headers)
    assert r.status_code == 422


def ppo_args(model: Path, out: Path, reward_model: str, *extra: str) -> list[str]:
    return [f"model_name_or_path={model}", f"output_dir={out}", "stage=ppo", "dataset=identity", "template=llama3",
            "cutoff_len=64", "max_completion_length=6", "per_device_train_batch_size=2", "ppo_buffer_size=1",
            "ppo_epochs=1", "gradient_accumulation_steps=1", "learning_rate=0.01", "logging_steps=1", "save_steps=10",
            "temperature=1.0", "top_p=1.0", "lora_rank=4", f"reward_model={reward_model}", "reward_model_type=api",
            *extra]


def test_ppo_scores_through_a_tuneboard_api_reward_server(tiny_llama, reward_folder, tmp_path):
    proc, url = start_server("--reward-model", str(reward_folder), env={"TUNEBOARD_API_KEY": SECRET})
    try:
        out = tmp_path / "run"
        run = subprocess.run(TUNEBOARD + ["train", *ppo_args(tiny_llama, out, url, "max_steps=2",
                                                             "reward_model_api_key_env=H22_RM_KEY")],
                             cwd="/tmp", capture_output=True, text=True, timeout=900,
                             env={**os.environ, "H22_RM_KEY": SECRET})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        stop_server(proc)
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["reward"]) and r["reward"] == pytest.approx(r["rewards/reward_model/mean"])
               for r in rows)
    served = [line for line in proc.log if "rm scored 2 texts" in line]
    assert len(served) == 2, "".join(proc.log)[-2000:]  # one request per rollout batch of 2 responses
    log = (out / "running_log.txt").read_text()
    assert f"rewards: the scoring endpoint {url}/v1/score/evaluation" in log and "$H22_RM_KEY" in log
    # the key went as the Bearer header (the server requires it: a 401 would have failed the run) and nowhere else
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert samples and all(math.isfinite(s["reward"]) for s in samples)


def test_the_reward_endpoint_is_checked(tiny_llama, reward_folder, tmp_path):
    from backend.core.spec import SpecError, validate_spec

    base = {"model_name_or_path": str(tiny_llama), "stage": "ppo", "dataset": "identity"}
    assert validate_spec({**base, "reward_model": "http://127.0.0.1:8000", "reward_model_type": "api"})
    with pytest.raises(SpecError, match="is not an http\\(s\\) URL: with reward_model_type api"):
        validate_spec({**base, "reward_model": str(reward_folder), "reward_model_type": "api"})
    with pytest.raises(SpecError, match="is a URL: set reward_model_type api"):
        validate_spec({**base, "reward_model": "http://127.0.0.1:8000", "reward_model_type": "full"})
    with pytest.raises(SpecError, match="reward_model_api_key_env .*applies with reward_model_type api"):
        validate_spec({**base, "reward_model": str(reward_folder), "reward_model_type": "full",
                       "reward_model_api_key_env": "X"})
    with pytest.raises(SpecError, match="reward_model_api_key_file: .* is not a file"):
        validate_spec({**base, "reward_model": "http://127.0.0.1:8000", "reward_model_type": "api",
                       "reward_model_api_key_file": str(tmp_path / "missing")})

    out = tmp_path / "run"
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    run = subprocess.run(TUNEBOARD + ["train", *ppo_args(tiny_llama, out, dead, "max_steps=1")], cwd="/tmp",
                         capture_output=True, text=True, timeout=900)
    terminal = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in terminal
    line = f"reward_model {dead}/v1/score/evaluation: cannot reach it"
    assert line in terminal and line in (out / "running_log.txt").read_text()


def test_the_key_comes_from_its_variable_or_file_and_stays_out_of_the_log(tiny_llama, tmp_path, monkeypatch):
    """reward_model_api_key_file wins over reward_model_api_key_env (the distill teacher's rule); the run log
    names where the key came from, never the key."""
    from types import SimpleNamespace

    from backend.core.spec import validate_spec
    from backend.stages.ppo import scoring_endpoint

    key_file = tmp_path / "rm.key"
    key_file.write_text(SECRET + "-file\n")
    monkeypatch.setenv("H22_RM_KEY", SECRET)
    base = {"model_name_or_path": str(tiny_llama), "stage": "ppo", "dataset": "identity",
            "reward_model": "http://127.0.0.1:8000/v1", "reward_model_type": "api",
            "reward_model_api_key_env": "H22_RM_KEY"}
    for extra, key, source in (({}, SECRET, "$H22_RM_KEY"),
                               ({"reward_model_api_key_file": str(key_file)}, SECRET + "-file", str(key_file))):
        notes = []
        reward = scoring_endpoint(validate_spec({**base, **extra}), SimpleNamespace(log=notes.append), None, None)
        assert reward.url == "http://127.0.0.1:8000/v1/score/evaluation"
        assert reward.client.headers["authorization"] == f"Bearer {key}"
        assert source in notes[0] and SECRET not in " ".join(notes)
    notes = []
    scoring_endpoint(validate_spec({**base, "reward_model_api_key_env": "H22_UNSET"}),
                     SimpleNamespace(log=notes.append), None, None)
    assert "no API key ($H22_UNSET holds none)" in notes[0]
