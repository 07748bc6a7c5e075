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


@pytest.mark.slow
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
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def ppo_args(model: Path, out: Path, reward_model: str, *extra: str) -> list[str]:
    return [f"model_name_or_path={model}", f"output_dir={out}", "stage=ppo", "dataset=identity", "template=llama3",
            "cutoff_len=64", "max_completion_length=6", "per_device_train_batch_size=2", "ppo_buffer_size=1",
            "ppo_epochs=1", "gradient_accumulation_steps=1", "learning_rate=0.01", "logging_steps=1", "save_steps=10",
            "temperature=1.0", "top_p=1.0", "lora_rank=4", f"reward_model={reward_model}", "reward_model_type=api",
            *extra]


@pytest.mark.slow
def test_ppo_scores_through_a_tuneboard_api_reward_server(tiny_llama, reward_folder, tmp_path):
    from types import SimpleNamespace

    from backend.core.spec import validate_spec
    from backend.evaluation.reward_score import RewardModelReward
    from backend.stages.ppo import Scorer

    proc, url = start_server("--reward-model", str(reward_folder), env={"TUNEBOARD_API_KEY": SECRET})
    try:
        # stage ppo's scorer through the server = its scorer with the reward model in-process, for the same rows
        # (the policy's template here is the rm's own, so both render the same text)
        rm = RewardModelReward(str(reward_folder), "rm")
        base = {"model_name_or_path": str(tiny_llama), "stage": "ppo", "dataset": "identity"}
        rows = [{"prompt": "p", "conversation": c} for c in conversations("Hello?", "Who are you, and where?")]
        answers, log = ["world", "I am a tiny model"], SimpleNamespace(log=print, warn=print)
        os.environ["H22_RM_KEY"] = SECRET
        try:
            remote = Scorer(validate_spec({**base, "reward_model": url, "reward_model_type": "api",
                                           "reward_model_api_key_env": "H22_RM_KEY"}), log, rm.template,
                            rm.tokenizer)(rows, ["p", "p"], answers, [[1], [2]])[0]
        finally:
            del os.environ["H22_RM_KEY"]
        local = Scorer(validate_spec({**base, "reward_model": str(reward_folder), "reward_model_type": "full"}),
                       log)(rows, ["p", "p"], answers, [[1], [2]])[0]
        assert remote == pytest.approx(local, abs=1e-4) and local[0] != local[1]

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
    assert len(served) == 3, "".join(proc.log)[-2000:]  # the check above, then one per rollout batch of 2
    log = (out / "running_log.txt").read_text()
    assert f"rewards: the scoring endpoint {url}/v1/score/evaluation" in log and "$H22_RM_KEY" in log
    # the key went as the Bearer header (the server requires it: a 401 would have failed the run) and nowhere else
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert samples and all(math.isfinite(s["reward"]) for s in samples)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_lora_rm_run_served_by_tuneboard_api_scores_as_in_process(tiny_llama, tmp_path):
    """An rm run's LoRA folder (its base named by its run_spec.yaml) behind `tuneboard api --reward-model NAME=RUN`:
    the route's scores are the in-process RewardModelReward's; a folder without a score head is one error line."""
    import httpx

    from backend.evaluation.reward_api import ApiReward
    from backend.evaluation.reward_score import RewardModelReward

    run = tmp_path / "rm"
    train = subprocess.run(TUNEBOARD + ["train", f"model_name_or_path={tiny_llama}", f"output_dir={run}", "stage=rm",
                                        "dataset=dpo_en_demo", "max_samples=8", "cutoff_len=64", "lora_rank=4",
                                        "per_device_train_batch_size=2", "learning_rate=0.01", "max_steps=2",
                                        "save_steps=100", "plot_loss=false"],
                           cwd="/tmp", capture_output=True, text=True, timeout=900)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert (run / "adapter_config.json").is_file()
    rm = RewardModelReward(str(run), "judge-rm")
    convs, answers = conversations("Hello?", "Name a colour."), ["world", "blue, I think"]
    direct = rm(["p", "p"], answers, conversation=convs)
    texts = ApiReward("http://unused", None, template=rm.template, tokenizer=rm.tokenizer,
                      cutoff_len=rm.cutoff_len).texts(answers, convs)
    proc, url = start_server("--reward-model", f"judge-rm={run}")
    try:
        r = httpx.post(f"{url}/v1/score/evaluation", json={"model": "judge-rm", "messages": texts}, timeout=120)
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
    finally:
        stop_server(proc)
    assert r.status_code == 200, r.text
    assert r.json()["scores"] == pytest.approx(direct, abs=1e-4) and direct[0] != direct[1]
    assert [m["id"] for m in models["data"]] == ["judge-rm"]  # alone, the reward model is the only model served

    bad = subprocess.run(TUNEBOARD + ["api", "--reward-model", str(tiny_llama), "--port", "0"], cwd="/tmp",
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert f"error: --reward-model {tiny_llama}: " in bad.stderr and "is not a reward model" in bad.stderr


def test_http_errors_and_timeouts_are_one_line_naming_the_url_and_status():
    import httpx

    from backend.core.rewards import RewardError
    from backend.evaluation.reward_api import ApiReward

    def reply(status, body=None, exc=None):
        def handler(request):
            if exc:
                raise exc("timed out", request=request)
            assert request.headers["authorization"] == f"Bearer {SECRET}"
            assert json.loads(request.content) == {"model": "model", "messages": ["a", "b"]}
            return httpx.Response(status, json=body)
        return ApiReward("https://rm.example:8443/v1", SECRET, template=None, tokenizer=None, cutoff_len=None,
                         transport=httpx.MockTransport(handler))

    assert reply(200, {"scores": [0.5, -1]}).score(["a", "b"]) == [0.5, -1.0]
    where = "reward_model https://rm.example:8443/v1/score/evaluation"
    cases = [(reply(401, {"error": {"message": f"incorrect API key {SECRET}"}}), f"{where}: HTTP 401: incorrect API "
              "key *** (the key was refused: check reward_model_api_key_env or reward_model_api_key_file)"),
             (reply(503, {"error": {"message": "busy"}}), f"{where}: HTTP 503: busy"),
             (reply(200, {"score": 1}), f"{where}: the answer has no list of numbers under 'scores'"),
             (reply(200, {"scores": [1.0]}), f"{where}: 1 scores for 2 texts"),
             (reply(0, exc=httpx.ReadTimeout), f"{where}: no answer within 300 s")]
    for reward, message in cases:
        with pytest.raises(RewardError) as caught:
            reward.score(["a", "b"])
        assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
        assert SECRET not in str(caught.value)
