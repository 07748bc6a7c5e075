"""Tailer edge cases: partial line, truncation, rotation, in-place rewrite, malformed line, missing file,
and that only new bytes are read."""
from __future__ import annotations

import json
import os
import pickle

from webui.tailer import FileTail, JsonlTail, RunTail, StatusFile


def _append(path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


def test_partial_line_is_held_until_finished(tmp_path):
    p = tmp_path / "log.txt"
    t = FileTail(str(p))
    _append(p, "one\ntw")
    assert t.read_lines() == ["one"]
    assert t.read_lines() == []
    _append(p, "o\nthree")
    assert t.read_lines() == ["two"]
    _append(p, "\n")
    assert t.read_lines() == ["three"]


def test_reads_only_new_bytes(tmp_path):
    p = tmp_path / "log.txt"
    t = FileTail(str(p))
    _append(p, "a\n" * 1000)
    assert len(t.read_lines()) == 1000
    assert t.offset == 2000
    _append(p, "b\n")
    assert t.read_lines() == ["b"]
    assert t.offset == 2002


def test_missing_file_then_created(tmp_path):
    p = tmp_path / "later.jsonl"
    t = JsonlTail(str(p))
    assert t.read() == ([], False)
    _append(p, json.dumps({"step": 1, "loss": 2.0}) + "\n")
    recs, reset = t.read()
    assert recs == [{"step": 1, "loss": 2.0}] and not reset


def test_truncation_restarts_from_the_beginning(tmp_path):
    p = tmp_path / "m.jsonl"
    t = JsonlTail(str(p))
    _append(p, "".join(json.dumps({"step": i}) + "\n" for i in range(5)))
    assert len(t.read()[0]) == 5
    p.write_text(json.dumps({"step": 100}) + "\n")  # shorter than before
    recs, reset = t.read()
    assert reset and recs == [{"step": 100}]


def test_rewrite_in_place_not_shorter_is_noticed(tmp_path):
    p = tmp_path / "m.jsonl"
    t = JsonlTail(str(p))
    _append(p, json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert len(t.read()[0]) == 1
    with open(p, "r+b") as fh:  # same inode, new content, longer
        fh.write((json.dumps({"step": 7, "loss": 9.0}) + "\n" + json.dumps({"step": 8}) + "\n").encode())
    recs, reset = t.read()
    assert reset and [r["step"] for r in recs] == [7, 8]


def test_rotation_new_inode_is_read_from_start(tmp_path):
    p = tmp_path / "log.txt"
    t = FileTail(str(p))
    _append(p, "old 1\nold 2\nold 3\n")
    assert len(t.read_lines()) == 3
    os.rename(p, tmp_path / "log.txt.1")
    _append(p, "new 1\nnew 2\nnew 3\nnew 4\n")  # longer than the old one: size alone would not tell
    assert t.read_lines() == ["new 1", "new 2", "new 3", "new 4"]
    assert t.resets == 1


def test_file_deleted_then_recreated(tmp_path):
    p = tmp_path / "log.txt"
    t = FileTail(str(p))
    _append(p, "x\n")
    assert t.read_lines() == ["x"]
    p.unlink()
    assert t.read_lines() == []
    _append(p, "y\n")
    assert t.read_lines() == ["y"]


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    p = tmp_path / "m.jsonl"
    t = JsonlTail(str(p))
    _append(p, '{"step": 1, "loss": 0.0}\n{"step": 2, "lo\n[1, 2]\n\n{"step": 3, "loss": 1.5}\n')
    recs, _ = t.read()
    assert recs == [{"step": 1, "loss": 0.0}, {"step": 3, "loss": 1.5}]
    assert t.malformed == 2
    assert "m.jsonl" in t.last_error


def test_log_tail_starts_near_the_end_of_a_big_file(tmp_path):
    p = tmp_path / "running_log.txt"
    _append(p, "".join(f"line {i}\n" for i in range(100_000)))
    t = FileTail(str(p), start_tail_bytes=1000)
    lines = t.read_lines()
    assert lines[-1] == "line 99999"
    assert 50 < len(lines) < 200
    assert all(line.startswith("line ") for line in lines)  # first cut line dropped


def test_status_file_rereads_only_on_change_and_keeps_last_good(tmp_path):
    p = tmp_path / "status.json"
    s = StatusFile(str(p))
    assert s.read() == {}
    p.write_text(json.dumps({"state": "running", "step": 1}))
    assert s.read()["step"] == 1
    os.utime(p, ns=(1, 1))
    p.write_text('{"state": "runn')  # a torn write by a non-atomic writer
    assert s.read()["state"] == "running"


def test_run_tail_collects_metrics_log_and_status_and_pickles(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    rt = RunTail(str(d))
    assert rt.poll() == {} and rt.records == []
    _append(d / "trainer_log.jsonl", '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 0.0}\n')
    _append(d / "running_log.txt", "starting\nstep 1\n")
    (d / "status.json").write_text(json.dumps({"state": "running", "step": 2, "total_steps": 10}))
    st = rt.poll()
    assert st["state"] == "running"
    assert [r["loss"] for r in rt.records] == [3.0, 0.0]  # zero kept
    assert rt.log_text() == "starting\nstep 1"
    rt2 = pickle.loads(pickle.dumps(rt))  # lives in gr.State
    _append(d / "trainer_log.jsonl", '{"step": 3, "loss": 1.0}\n')
    rt2.poll()
    assert [r["step"] for r in rt2.records] == [1, 2, 3]
    # the process output file, once present, is the log source (it has tracebacks too)
    _append(d / "process_output.log", "Traceback (most recent call last):\n")
    rt2.poll()
    assert "Traceback" in rt2.log_text() and "starting" not in rt2.log_text()
