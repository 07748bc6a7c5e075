"""Issue #25 part 2: a UI user sends none of the server's environment variables to a URL, and makes the server
call no internal address (backend.core.teacher_access), checked by `tuneboard distill` itself when the web UI
started it (TUNEBOARD_TEACHER_POLICY=webui); the teacher client never follows a redirect, for anybody.
Real listeners (tests/fake_teacher.py) catch what would have leaked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_teacher import KEY, SCHEMA, TASK, FakeTeacher, make_docs
from test_distill import generate

from backend.core import teacher_access as ta
from backend.distill import read_progress

SECRET = "leaked-secret-value-31337"


@pytest.fixture(autouse=True)
def _no_policy(monkeypatch):
    """Every test starts as a CLI user (no policy, no offered key, no allowed URL) and sets what it needs."""
    for name in (ta.POLICY_ENV, ta.KEYS_ENV, ta.URLS_ENV):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores it, whatever ta.configure() writes
        monkeypatch.delenv(name)


@pytest.fixture
def listener():
    server = FakeTeacher("valid").start()
    yield server
    server.stop()


def spec_args(tmp_path, model, teacher_url: str, key_env: str) -> list[str]:
    docs = make_docs(tmp_path / "docs")
    return [f"documents={docs}", "text_column=body", f"task={TASK}", f"json_schema={json.dumps(SCHEMA)}",
            f"teacher={teacher_url}", "teacher_model=fake", f"model_name_or_path={model}", "cutoff_len=128",
            "answer_tokens=40", "concurrency=1", "max_retries=0", f"dataset_dir={tmp_path / 'data'}",
            f"output_dir={tmp_path / 'run'}"] + ([f"teacher_api_key_env={key_env}"] if key_env else [])


def distill_as_ui(args: list[str], **env) -> subprocess.CompletedProcess:
    """`tuneboard distill` as the web UI starts it: with TUNEBOARD_TEACHER_POLICY=webui in its environment."""
    return subprocess.run([sys.executable, "-m", "backend.cli", "distill", *args], cwd="/tmp", capture_output=True,
                          text=True, timeout=600, env={**os.environ, ta.POLICY_ENV: ta.POLICY_WEBUI, **env})


@pytest.mark.parametrize("name", ["HOME", "HF_TOKEN"])
def test_a_ui_run_sends_no_server_variable_to_a_url(tmp_path, tiny_qwen2, listener, name):
    """The probe: any variable of the server named as the key's variable, a URL on a listener of ours (the
    operator allowed the URL, so only the key rule is at stake): nothing reaches the listener."""
    args = spec_args(tmp_path, tiny_qwen2, listener.url, name)
    proc = distill_as_ui(args, **{name: SECRET, ta.URLS_ENV: listener.url})
    assert proc.returncode == 1
    assert f"teacher_api_key_env: ${name} is not a key this server offers" in proc.stderr
    assert not any("Authorization" in r["headers"] for r in listener.requests)
    assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_ui_run_reaches_no_internal_address(tmp_path, tiny_qwen2, listener, host):
    url = listener.url.replace("127.0.0.1", host)
    proc = distill_as_ui(spec_args(tmp_path, tiny_qwen2, url, ""), OPENAI_API_KEY=SECRET)  # the spec's default
    assert proc.returncode == 1
    assert f"teacher: {host} is 127.0.0.1, an internal address" in proc.stderr, proc.stderr
    assert listener.requests == []


def test_an_offered_key_goes_to_its_own_base_url_and_nowhere_else(tmp_path, tiny_qwen2, monkeypatch):
    """--teacher-key-env NAME=URL: the key reaches that URL; the same variable with another URL is refused
    before any request (even an allowed one)."""
    from backend.distill.pipeline import DistillError

    own, other = FakeTeacher("valid", key=KEY).start(), FakeTeacher("valid").start()
    try:
        monkeypatch.setenv("OFFERED_KEY", KEY)
        monkeypatch.setenv(ta.POLICY_ENV, ta.POLICY_WEBUI)
        ta.configure([f"OFFERED_KEY={own.url}/"], [other.url])
        flat = {"documents": str(make_docs(tmp_path / "docs")), "text_column": "body", "task": TASK,
                "json_schema": SCHEMA, "teacher": own.url, "teacher_model": "fake", "teacher_api_key_env": "OFFERED_KEY",
                "model_name_or_path": str(tiny_qwen2), "cutoff_len": 128, "answer_tokens": 40, "eval_ratio": 0.3,
                "dataset_dir": str(tmp_path / "data"), "output_dir": str(tmp_path / "run"), "dataset_name": "facts"}
        assert generate(flat)[0] == 0
        assert own.requests and all(r["headers"]["Authorization"] == f"Bearer {KEY}" for r in own.requests)
        with pytest.raises(DistillError, match=rf"the key in \$OFFERED_KEY is only sent to {own.url}, not to"):
            generate({**flat, "teacher": other.url, "output_dir": str(tmp_path / "run2")})
        assert other.requests == []
    finally:
        own.stop()
        other.stop()


def test_the_client_follows_no_redirect(tmp_path, tiny_qwen2, monkeypatch):
    """For everybody (no policy): a 307 to another host is the end of the run, named; the key stays home."""
    from backend.distill.pipeline import DistillError

    first, elsewhere = FakeTeacher("redirect", key=KEY).start(), FakeTeacher("valid").start()
    try:
        first.redirect_to = elsewhere.url.removesuffix("/v1")
        monkeypatch.setenv("REDIRECT_TEST_KEY", KEY)
        flat = {"documents": str(make_docs(tmp_path / "docs")), "text_column": "body", "task": TASK,
                "teacher": first.url, "teacher_model": "fake", "teacher_api_key_env": "REDIRECT_TEST_KEY",
                "model_name_or_path": str(tiny_qwen2), "cutoff_len": 128, "answer_tokens": 40,
                "dataset_dir": str(tmp_path / "data"), "output_dir": str(tmp_path / "run")}
        with pytest.raises(DistillError, match=r"HTTP 307 redirect to http://127\.0\.0\.1:\d+/v1/chat/completions: "
                                               "redirects are not followed"):
            generate(flat)
        assert first.requests and elsewhere.requests == []
    finally:
        first.stop()
        elsewhere.stop()


def test_the_guarded_client_does_not_connect_to_an_internal_address(listener):
    """The connect-time check (a name that resolved to a public address at the UI's check and to an internal
    one now): the guarded client refuses 127.0.0.1 before a byte is sent."""
    from backend.distill.teacher import Budget, Teacher, TeacherFatal

    teacher = Teacher(listener.url, "fake", "sk-guarded", timeout=5, max_retries=0, backoff=0, temperature=0,
                      max_tokens=16, budget=Budget(0), guard=True)
    try:
        with pytest.raises(TeacherFatal, match="127.0.0.1 resolves to 127.0.0.1, an internal address"):
            teacher.ask([{"role": "user", "content": "hi"}])
    finally:
        teacher.close()
    assert listener.requests == []


def test_the_run_s_own_local_teacher_still_works_under_the_policy(tmp_path, tiny_qwen2, monkeypatch):
    """teacher: local (a `tuneboard api` on loopback, started by the run): not a URL the user gives."""
    from backend.distill.pipeline import DistillError

    monkeypatch.setenv(ta.POLICY_ENV, ta.POLICY_WEBUI)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Acme widget costs twelve dollars.")
    (docs / "b.txt").write_text("The Zeta gadget weighs 120 grams.")
    flat = {"documents": str(docs), "task": "Summarize.", "answer_format": "text", "teacher": "local",
            "model_name_or_path": str(tiny_qwen2), "cutoff_len": 128, "answer_tokens": 16, "eval_ratio": 0.0,
            "dataset_dir": str(tmp_path / "data"), "output_dir": str(tmp_path / "run")}
    try:
        generate(flat)
    except DistillError as exc:  # a random tiny model may answer nothing usable; it was asked all the same
        assert "no training pair accepted" in str(exc)
    progress = read_progress(tmp_path / "run")
    assert progress["asked"] == 2 and progress["failed"] == 0


# ------------------------------------------------------------------------------ the operator's lists
def test_configure_reads_the_flags_and_normalizes_the_urls(monkeypatch):
    ta.configure(["TEAM_KEY=HTTPS://API.Example.com:443/v1/"], ["http://10.0.0.5:8000/v1/"])
    assert os.environ[ta.POLICY_ENV] == "webui" and ta.restricted()
    assert ta.offered_keys() == {"TEAM_KEY": "https://api.example.com/v1"}
    assert ta.allowed_urls() == {"https://api.example.com/v1", "http://10.0.0.5:8000/v1"}
    ta.configure(["TEAM_KEY=https://api.example.com/v1"], [])  # the same binding again: fine
    with pytest.raises(ValueError, match="TEAM_KEY is bound to https://api.example.com/v1 already"):
        ta.configure(["TEAM_KEY=https://elsewhere.example.com/v1"], [])
    for bad in ("TEAM_KEY", "1BAD=https://x.example/v1", "K=ftp://x.example", "K=https://u:p@x.example/v1"):
        with pytest.raises(ValueError):
            ta.configure([bad], [])
    assert ta.check_teacher("local", "HOME", None) == []
    assert [r.what for r in ta.check_teacher("http://10.0.0.5:8000/v1", "TEAM_KEY", None)] == ["key_url"]
    assert ta.check_teacher("http://10.0.0.5:8000/v1", "", None) == []  # allowed URL, no key
    assert [r.what for r in ta.check_teacher("http://169.254.169.254/latest", "", None)] == ["private"]
    assert [r.what for r in ta.check_teacher("http://[::1]:8000/v1", "", None)] == ["private"]
    assert [r.what for r in ta.check_teacher("http://0.0.0.0:8000/v1", "", None)] == ["private"]
    assert [r.what for r in ta.check_teacher("http://[fd00::1]/v1", "", None)] == ["private"]
    assert [r.what for r in ta.check_teacher("http://2130706433/v1", "", None)] == ["private"]  # 127.0.0.1


def test_an_endpoints_error_body_is_one_short_line():
    """error_line reads OpenAI's, FastAPI's and plain error bodies alike (teacher, judge, reward endpoint)."""
    from backend.core.teacher_access import error_line

    assert error_line(b'{"error": {"message": "bad\\n  key"}}', "Unauthorized") == "bad key"
    assert error_line('{"error": "over quota"}', "Too Many Requests") == "over quota"
    assert error_line('{"detail": "Not Found"}', "Not Found") == "Not Found"
    assert error_line("<html>\n oops </html>", "Bad Gateway") == "<html> oops </html>"
    assert error_line(b"", "Bad Gateway") == "Bad Gateway"
    assert error_line("x" * 1000, "") == "x" * 300
    assert error_line(b"\xff{", "Bad Request") == "\ufffd{"
