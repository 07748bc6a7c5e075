"""backend/evaluation/judge.py against a stand-in judge endpoint (tests/fake_teacher.py, modes judge_*), through the
distill teacher's real httpx client: both orders asked, ties when the orders disagree, the interval, the budget,
a refused key, the cache, a judge without verdicts (no score), the probe before training, and the key never
written."""
from __future__ import annotations

import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from backend.evaluation.judge import (JudgeFatal, JudgeSettings, judge_pairs, judge_win_rate, parse_verdict, probe,
                                      summary_line, wilson_interval)
from fake_teacher import KEY, FakeTeacher, no_key_under

PROMPTS = [[{"role": "user", "content": f"Question {i}?"}] for i in range(4)]
TUNED = ["a good answer 0", "a good answer 1", "plain answer 2", "a good answer 3"]
BASE = ["plain answer 0", "plain answer 1", "a good answer 2", "a good reply 3"]


@pytest.fixture
def judge():
    server = FakeTeacher(mode="judge_word", key=KEY).start()
    yield server
    server.stop()


def settings(server, tmp_path, monkeypatch, **kw) -> JudgeSettings:
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    return JudgeSettings(url=server.url, model="judge-model", api_key_env="JUDGE_TEST_KEY",
                         cache_dir=tmp_path / "judge_cache", backoff=0.0, **kw)


def test_wilson_interval_by_hand():
    # 7 wins + 2 ties of 10 rows: p = 0.8; Wilson (z = 1.96): centre (0.8 + 0.19208) / 1.38416, half
    # 1.96 / 1.38416 * sqrt(0.016 + 0.0096040)
    low, high = wilson_interval(8.0, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(5, 5)[1] == 1.0


def test_verdict_parsing():
    assert parse_verdict("Because.\nVerdict: A") == "A"
    assert parse_verdict("verdict: **b**") == "B"
    assert parse_verdict("Verdict: A ... no wait.\nVerdict: tie") == "tie"
    assert parse_verdict("I like the first") is None


def test_both_orders_asked_and_counted(judge, tmp_path, monkeypatch):
    report = judge_pairs(PROMPTS, TUNED, BASE, settings(judge, tmp_path, monkeypatch), log=lambda m: None)
    # every pair went to the endpoint twice, once each way round
    seen = []
    for r in judge.requests:
        text = r["body"]["messages"][-1]["content"]
        a = re.search(r"<answer_a>\n(.*?)\n</answer_a>", text, re.S).group(1)
        b = re.search(r"<answer_b>\n(.*?)\n</answer_b>", text, re.S).group(1)
        seen.append((a, b))
        assert r["headers"]["Authorization"] == f"Bearer {KEY}"
    assert sorted(seen) == sorted([(t, b) for t, b in zip(TUNED, BASE)] + [(b, t) for t, b in zip(TUNED, BASE)])
    assert [r["verdict"] for r in report["per_row"]] == ["win", "win", "loss", "tie"]
    assert (report["wins"], report["ties"], report["losses"]) == (2, 1, 1)
    assert report["win_rate"] == pytest.approx(2.5 / 4)
    assert report["interval"] == pytest.approx(list(wilson_interval(2.5, 4)))
    assert report["requests"] == 8 and report["complete"] and report["stopped"] is None
    row = report["per_row"][0]
    assert [o["order"] for o in row["orders"]] == ["AB", "BA"]
    assert [o["verdict"] for o in row["orders"]] == ["A", "B"]  # the same answer preferred in both places
    assert all("good" in o["reason"] for o in row["orders"])


def test_position_bias_is_a_tie(judge, tmp_path, monkeypatch):
    judge.mode = "judge_first"  # always prefers whatever is shown first
    report = judge_pairs(PROMPTS, TUNED, BASE, settings(judge, tmp_path, monkeypatch), log=lambda m: None)
    assert (report["wins"], report["ties"], report["losses"]) == (0, 4, 0)
    assert report["win_rate"] == 0.5


def test_unparsed_verdict_is_a_flagged_tie(judge, tmp_path, monkeypatch):
    judge.mode = "judge_unparsed"
    report = judge_pairs(PROMPTS[:2], TUNED[:2], BASE[:2], settings(judge, tmp_path, monkeypatch), log=lambda m: None)
    assert report["ties"] == 2 and report["unparsed"] == 4
    assert not any(o["parsed"] for r in report["per_row"] for o in r["orders"])


def test_the_cache_answers_a_second_run(judge, tmp_path, monkeypatch):
    s = settings(judge, tmp_path, monkeypatch)
    first = judge_pairs(PROMPTS, TUNED, BASE, s, log=lambda m: None)
    asked = len(judge.requests)
    second = judge_pairs(PROMPTS, TUNED, BASE, s, log=lambda m: None)
    assert len(judge.requests) == asked == 8
    assert second["requests"] == 0 and second["cached"] == 8
    assert [r["verdict"] for r in second["per_row"]] == [r["verdict"] for r in first["per_row"]]
    # another judge model is another judge: asked again
    s.model = "judge-model-2"
    judge_pairs(PROMPTS[:1], TUNED[:1], BASE[:1], s, log=lambda m: None)
    assert len(judge.requests) == 10


def test_budget_stops_cleanly_with_a_partial_report(judge, tmp_path, monkeypatch):
    # 5 requests hold two rows (a row starts only when the budget holds both its orders): the fifth is not spent
    s = settings(judge, tmp_path, monkeypatch, max_requests=5, concurrency=1)
    report = judge_pairs(PROMPTS, TUNED, BASE, s, log=lambda m: None)
    assert len(judge.requests) == 4 and report["requests"] == 4
    assert report["judged"] == 2 and not report["complete"]
    assert "judge_max_requests 5 spent" in report["stopped"]
    assert [r["verdict"] for r in report["per_row"]] == ["win", "win", "not judged", "not judged"]
    # what was answered is cached: a run without a limit asks only the rest
    s.max_requests = 0
    again = judge_pairs(PROMPTS, TUNED, BASE, s, log=lambda m: None)
    assert again["complete"] and again["requests"] == 4 and again["cached"] == 4 and len(judge.requests) == 8
    # with four workers the rows judged are whole rows too
    judge.requests.clear()
    s = settings(judge, tmp_path / "other", monkeypatch, max_requests=3)
    report = judge_pairs(PROMPTS, TUNED, BASE, s, log=lambda m: None)
    assert report["judged"] == 1 and len(judge.requests) == 2


def test_refused_key_is_one_line_and_the_key_is_never_written(judge, tmp_path, monkeypatch):
    lines = []
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-wrong-key-0123456789")
    s = JudgeSettings(url=judge.url, model="judge-model", api_key_env="JUDGE_TEST_KEY",
                      cache_dir=tmp_path / "judge_cache", backoff=0.0)
    report = judge_pairs(PROMPTS, TUNED, BASE, s, log=lines.append)
    assert report["judged"] == 0 and not report["complete"]
    assert "HTTP 401" in report["error"] and "API key was refused" in report["error"]
    assert "judge_api_key_env" in report["error"] and "teacher" not in report["error"]
    assert "\n" not in report["error"] and "sk-wrong-key" not in report["error"]
    assert len(judge.requests) <= 4  # it stopped at the refusal (one per worker at most), no retries
    with pytest.raises(JudgeFatal, match="HTTP 401"):
        judge_win_rate(PROMPTS, TUNED, BASE, s, log=lines.append)
    # a good key: the report and the cache hold no key
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    report = judge_pairs(PROMPTS, TUNED, BASE, s, log=lines.append)
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "log.txt").write_text("\n".join(lines))
    no_key_under(tmp_path)
    no_key_under(tmp_path, key="sk-wrong-key-0123456789")


def test_judge_win_rate_for_the_task_metric(judge, tmp_path, monkeypatch):
    s = settings(judge, tmp_path, monkeypatch)
    assert judge_win_rate(PROMPTS, TUNED, BASE, s, log=lambda m: None) == pytest.approx(0.625)
    assert math.isnan(judge_win_rate(PROMPTS, TUNED, BASE,
                                     JudgeSettings(url=judge.url, model="m", api_key_env="JUDGE_TEST_KEY",
                                                   max_requests=1, backoff=0.0), log=lambda m: None))


def test_key_file(judge, tmp_path):
    key_file = tmp_path / "key.txt"
    key_file.write_text(KEY + "\n")
    s = JudgeSettings(url=judge.url, model="judge-model", api_key_env=None, api_key_file=str(key_file))
    assert judge_pairs(PROMPTS[:1], TUNED[:1], BASE[:1], s, log=lambda m: None)["wins"] == 1


def test_spec_keys_reach_the_judge_and_are_refused_without_one(tmp_path, capsys):
    from backend import cli
    from backend.core.spec import SpecError, validate_spec

    key_file = tmp_path / "key.txt"
    key_file.write_text(KEY)
    spec = validate_spec({"do_judge": True, "judge_url": "http://127.0.0.1:9/v1", "judge_model": "j",
                          "judge_api_key_env": "MY_JUDGE_KEY", "judge_api_key_file": str(key_file),
                          "judge_max_requests": 7, "judge_against": "reference"}, check_files=False)
    s = JudgeSettings.from_spec(spec, tmp_path / "cache")
    assert (s.url, s.model, s.api_key_env, s.api_key_file, s.max_requests, s.cache_dir) == \
        ("http://127.0.0.1:9/v1", "j", "MY_JUDGE_KEY", str(key_file), 7, tmp_path / "cache")
    refusals = {
        "judge_url": {"judge_url": "http://x/v1"},  # no judge to use it
        "judge_api_key": {"judge_api_key": KEY},  # a secret is never a spec key
        "do_judge": {"do_judge": True, "judge_url": "http://x/v1", "judge_model": "j"},  # base needs an adapter
        "judge_model": {"do_judge": True, "judge_url": "http://x/v1", "judge_against": "reference"},
    }
    for field, flat in refusals.items():
        with pytest.raises(SpecError) as info:
            validate_spec(flat, check_files=False)
        assert field in [f for f, _ in info.value.errors], (field, info.value.errors)
    # do_judge is for `tuneboard eval`: `tuneboard train` refuses it in one line
    assert cli.main(["train", "do_judge=true", "judge_url=http://x/v1", "judge_model=j",
                     "judge_against=reference"]) == 1
    err = capsys.readouterr().err
    assert "do_judge: the judge runs in `tuneboard eval`" in err and "Traceback" not in err


def test_a_web_ui_process_refuses_a_judge_its_operator_did_not_allow(monkeypatch):
    """Under the web UI's policy (backend.core.teacher_access) validate refuses an internal judge address and a key
    variable the operator does not offer, naming the field; allowed once the operator offers the key for it."""
    from backend.core import teacher_access
    from backend.core.spec import SpecError, validate_spec

    flat = {"do_judge": True, "judge_url": "http://127.0.0.1:9/v1", "judge_model": "j", "judge_against": "reference",
            "judge_api_key_env": "MY_JUDGE_KEY"}
    for name in (teacher_access.KEYS_ENV, teacher_access.URLS_ENV):
        monkeypatch.delenv(name, raising=False)
    validate_spec(flat, check_files=False)  # a command line: not restricted
    monkeypatch.setenv(teacher_access.POLICY_ENV, teacher_access.POLICY_WEBUI)
    with pytest.raises(SpecError) as info:
        validate_spec(flat, check_files=False)
    errors = dict(info.value.errors)
    assert "internal address" in errors["judge_url"] and "MY_JUDGE_KEY" in errors["judge_api_key_env"]
    monkeypatch.setenv(teacher_access.KEYS_ENV, "MY_JUDGE_KEY=http://127.0.0.1:9/v1")
    validate_spec(flat, check_files=False)


def test_a_judge_that_gives_no_verdict_gives_no_score(judge, tmp_path, monkeypatch):
    """Every reply without a verdict line (each a tie): no win rate (not 0.500), one line saying why, and the task
    metric gets NaN (no score for that save)."""
    judge.mode = "judge_unparsed"
    s = settings(judge, tmp_path, monkeypatch)
    report = judge_pairs(PROMPTS, TUNED, BASE, s, log=lambda m: None)
    assert report["win_rate"] is None and report["interval"] == [None, None]
    assert "verdict in 0 of its 8 replies" in report["no_score"] and "judge_model" in report["no_score"]
    line = summary_line(report)
    assert "no win rate" in line and "0.500" not in line and "\n" not in line
    assert math.isnan(judge_win_rate(PROMPTS, TUNED, BASE, s, log=lambda m: None))
    judge.mode = "judge_word"  # verdicts again: a win rate
    assert judge_pairs(PROMPTS, TUNED, BASE, settings(judge, tmp_path / "other", monkeypatch),
                       log=lambda m: None)["no_score"] is None


def test_probe_asks_one_pair_and_fails_in_one_line(judge, tmp_path, monkeypatch):
    s = settings(judge, tmp_path, monkeypatch, max_retries=1)
    assert probe(s) == "tie" and len(judge.requests) == 1  # "Yes." and "No." both lack the judge's word
    assert not (tmp_path / "judge_cache").exists()  # not cached
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-wrong-key-0123456789")
    with pytest.raises(JudgeFatal) as info:
        probe(s)
    message = str(info.value)
    assert "HTTP 401" in message and "$JUDGE_TEST_KEY" in message and "sk-wrong" not in message
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(JudgeFatal, match=r"no key was sent \(\$JUDGE_TEST_KEY is not set\)"):
        probe(s)
    with pytest.raises(JudgeFatal, match=r"^judge_url http://127.0.0.1:9/v1: no answer to a test request: cannot "):
        probe(JudgeSettings(url="http://127.0.0.1:9/v1", model="j", backoff=0.0, max_retries=0))


def test_a_404_names_judge_url_and_judge_model(tmp_path):
    """The teacher's 404 hint ("check teacher (the base URL ...) and teacher_model") in the judge's words."""
    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b'{"error": {"message": "The model does not exist"}}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        with pytest.raises(JudgeFatal) as info:
            probe(JudgeSettings(url=url, model="j", api_key_env=None, backoff=0.0))
        report = judge_pairs(PROMPTS[:1], TUNED[:1], BASE[:1], JudgeSettings(url=url, model="j", api_key_env=None),
                             log=lambda m: None)
    finally:
        server.shutdown()
        server.server_close()
    for message in (str(info.value), report["error"]):
        assert "HTTP 404" in message and "check judge_url (the base URL, ending in /v1) and judge_model" in message
        assert "teacher" not in message
