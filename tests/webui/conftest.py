"""Fixtures the web UI tests share."""
import pytest


@pytest.fixture
def root(tmp_path, monkeypatch):
    """An empty saves folder that the UI's run listing reads (TUNEBOARD_SAVES)."""
    r = tmp_path / "saves"
    r.mkdir()
    monkeypatch.setenv("TUNEBOARD_SAVES", str(r))
    return r
