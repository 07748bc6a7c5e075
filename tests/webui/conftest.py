"""Fixtures the web UI tests share."""
import pytest


@pytest.fixture(autouse=True)
def _no_extra_allowed_roots(monkeypatch):
    """The browser tests' session app adds pytest's whole temp folder to the allowed roots (the env var of
    this process); the UI tests here start from --allow-path unset, as `tuneboard webui` does."""
    monkeypatch.delenv("TUNEBOARD_ALLOW_PATHS", raising=False)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """An empty saves folder that the UI's run listing reads (TUNEBOARD_SAVES)."""
    r = tmp_path / "saves"
    r.mkdir()
    monkeypatch.setenv("TUNEBOARD_SAVES", str(r))
    return r
