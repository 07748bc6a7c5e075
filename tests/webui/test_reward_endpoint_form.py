"""The Train form's check refuses a PPO scoring endpoint (reward_model_type api) the UI may not ask, as it does the
distill teacher and the eval judge (backend.core.teacher_access): an internal address unless the operator allowed
its base URL, a key variable the operator does not offer for that URL; each one line on its own field."""
from __future__ import annotations

from backend.core import teacher_access
from webui import form

FLAT = {"stage": "ppo", "dataset": "identity", "reward_model": "http://127.0.0.1:8001", "reward_model_type": "api"}


def _clear(monkeypatch):
    for name in (teacher_access.KEYS_ENV, teacher_access.URLS_ENV, teacher_access.POLICY_ENV):
        monkeypatch.delenv(name, raising=False)


def test_an_internal_endpoint_and_an_unoffered_key_are_refused_on_their_fields(monkeypatch):
    _clear(monkeypatch)
    spec, errors = form.check(dict(FLAT, reward_model_api_key_env="HOME"), [])
    assert spec is None
    fields = dict(errors)
    assert "127.0.0.1" in fields["reward_model"] and "internal address" in fields["reward_model"]
    assert "$HOME" in fields["reward_model_api_key_env"] and "not a key this server offers" in \
        fields["reward_model_api_key_env"]


def test_the_operators_endpoint_and_key_pass(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv(teacher_access.KEYS_ENV, "RM_KEY=http://127.0.0.1:8001")
    spec, errors = form.check(dict(FLAT, reward_model_api_key_env="RM_KEY"), [])
    assert errors == [] and spec.reward_model_type == "api"
    spec, errors = form.check(dict(FLAT, reward_model_api_key_env="RM_KEY", reward_model="http://127.0.0.1:8002"), [])
    assert spec is None and {f for f, _ in errors} == {"reward_model", "reward_model_api_key_env"}
