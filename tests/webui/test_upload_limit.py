"""Uploads have a size limit (issue 9: huge uploads): `tuneboard webui --max-upload SIZE` (default 2gb) is
Gradio's max_file_size. An app launched in-process with a 4 kB limit refuses a 8 kB upload with HTTP 413 and
a message naming the limit, takes a small one, and keeps answering. No assertion on a duration."""
from __future__ import annotations

import os

import httpx
import pytest
from gradio_client import Client

from backend.core import allowed, teacher_access
from webui import app

LIMIT = 4 * 1024


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    saves = tmp_path_factory.mktemp("saves")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TUNEBOARD_SAVES", str(saves))
        demo = app.create_app()
        for _ in range(5):
            try:
                _, address, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True,
                                            quiet=True, **app.launch_kwargs(max_upload="4kb"))
                break
            except OSError:
                continue
        else:
            raise RuntimeError("could not start the app")
        yield address.rstrip("/")
        demo.close()


def test_an_oversized_upload_is_refused_and_the_ui_stays_up(url):
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/config").json()["max_file_size"] == LIMIT  # what the page checks before sending
        big = http.post("/gradio_api/upload", files={"files": ("big.jsonl", b"x" * (2 * LIMIT))})
        assert big.status_code == 413, big.text
        assert f"maximum allowed size of {LIMIT} bytes" in big.text, big.text
        small = http.post("/gradio_api/upload", files={"files": ("small.jsonl", b'{"a": 1}\n')})
        assert small.status_code == 200, small.text
        (path,) = small.json()
        with open(path, "rb") as fh:
            assert fh.read() == b'{"a": 1}\n'
    client = Client(url, analytics_enabled=False, verbose=False)  # the app still answers its API
    picker, summary = client.predict(dataset_dir="data", api_name="/list_datasets")
    assert "alpaca" in str(picker), picker


def test_max_upload_option(monkeypatch):
    assert app.parse_args([]).max_upload == "2gb"
    assert app.parse_args(["--max-upload", "500 MB"]).max_upload == "500mb"
    for bad in ("lots", "0gb", "5pb", "-1mb"):
        with pytest.raises(SystemExit):
            app.parse_args(["--max-upload", bad])
    launched = {}

    class FakeApp:
        def launch(self, **kwargs):
            launched.update(kwargs)

    class FakeWorker:
        def start(self):
            return self

        def stop(self):
            pass

    for name in (allowed.CODE_ENV, allowed.ENV, teacher_access.POLICY_ENV, teacher_access.KEYS_ENV,
                 teacher_access.URLS_ENV):  # main() sets the UI's policy for itself and its
        monkeypatch.setenv(name, os.environ.get(name, ""))  # subprocesses: restored after this test
    monkeypatch.setattr(app, "create_app", FakeApp)
    monkeypatch.setattr(app.jobs, "QueueWorker", FakeWorker)
    monkeypatch.setattr(app, "free_port", lambda host, port: port)
    assert app.main(["--max-upload", "3mb"]) == 0
    assert launched["max_file_size"] == "3mb"
    assert app.main([]) == 0 and launched["max_file_size"] == "2gb"
