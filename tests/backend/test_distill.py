"""tuneboard distill, fast tier: the spec's messages, documents and chunks, and the generate step in-process
against a local HTTP teacher that misbehaves on purpose (tests/fake_teacher.py). No network, no training."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fake_teacher import KEY, LONG, TASK, FakeTeacher, distill_flat, make_docs, no_key_under

from backend.distill import PAIRS_FILE, PROGRESS_FILE, REJECTED_FILE, read_progress
from backend.distill.spec import DistillSpecError, validate_distill


@pytest.fixture(scope="module")
def teacher():
    server = FakeTeacher("valid", key=KEY).start()
    yield server
    server.stop()


@pytest.fixture
def flat(tmp_path, tiny_qwen2, teacher, monkeypatch):
    """A distill spec on the fake teacher, with its key in an environment variable only."""
    monkeypatch.setenv("FAKE_TEACHER_KEY", KEY)
    return distill_flat(tmp_path, teacher, tiny_qwen2)


def generate(flat: dict) -> tuple[int, Path]:
    from backend.distill.pipeline import generate as gen
    from backend.core.rundir import RunDir

    spec = validate_distill(flat)
    run_dir = RunDir(spec.resolved_output_dir())
    run_dir.start()
    try:
        return gen(spec, run_dir, stop=lambda: False), spec.resolved_output_dir()
    finally:
        run_dir.close()


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


# ------------------------------------------------------------------------------------------- spec
def test_spec_errors_name_the_key(tmp_path):
    def errors(**data):
        with pytest.raises(DistillSpecError) as exc:
            validate_distill({"documents": str(tmp_path), "task": "t", **data})
        return dict(exc.value.errors)

    assert "did you mean teacher_model" in errors(teacher_modle="x")["teacher_modle"]
    assert "environment variable" in errors(teacher_api_key="sk-1")["teacher_api_key"]
    assert "required" in errors(teacher="http://127.0.0.1:1/v1")["teacher_model"]
    assert "no room" in errors(cutoff_len=128, answer_tokens=120)["answer_tokens"]
    assert "not a valid JSON Schema" in errors(json_schema={"type": "nope"})["json_schema"]
    assert "choose from generate, train, score" in errors(steps="generate,deploy")["steps"]
    assert "does not exist" in errors(documents=str(tmp_path / "missing"))["documents"]
    assert "unknown run-spec key" in errors(steps="train", train_args={"lora_rnak": 4})["train_args"]
    with pytest.raises(DistillSpecError) as exc:
        validate_distill({"documents": str(tmp_path)})
    assert dict(exc.value.errors)["task"].startswith("required")
    spec = validate_distill({"documents": str(tmp_path), "task": "t", "steps": "score,generate"})
    assert spec.steps == ["generate", "score"]


# ------------------------------------------------------------------------------- documents, chunks
def test_documents_of_every_kind_chunks_and_duplicates(tmp_path, tiny_qwen2):
    from transformers import AutoTokenizer

    from backend.distill.documents import chunk_documents, load_documents, near_duplicates, split_documents

    folder = make_docs(tmp_path / "docs")
    (folder / "long.txt").write_text(LONG, encoding="utf-8")
    docs = {d.id: d.text for d in load_documents(str(folder), "body")}
    assert set(docs) == {"a.txt", "a_copy.txt", "b.md", "c.html", "d.pdf", "e.jsonl:1", "e.jsonl:2", "long.txt"}
    assert "42 teeth" in docs["c.html"] and "hidden" not in docs["c.html"]  # the script is dropped
    assert "Gamma gear with 17 teeth" in docs["d.pdf"]
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    chunks = chunk_documents(load_documents(str(folder), "body"), tok, chunk_tokens=40, overlap=8)
    long = [c for c in chunks if c.doc_id == "long.txt"]
    assert len(long) > 3 and all(c.tokens <= 40 for c in chunks)
    assert all(c.text in LONG for c in long)  # slices of the document
    assert long[0].text[-15:] in long[1].text  # neighbours overlap
    dupes = near_duplicates(chunks, 0.8)
    assert dupes == {"a_copy.txt#0": "a.txt#0"}
    held = split_documents(list(docs), 0.3, seed=1)
    assert 1 <= len(held) < len(docs) and held == split_documents(list(docs), 0.3, seed=1)
    with pytest.raises(ValueError, match=r"e.jsonl line 1: no 'text' field \(text_column\)"):
        load_documents(str(folder), "text")


# ---------------------------------------------------------------------------------- generate step
def test_generate_validates_every_pair_and_registers_the_dataset(flat, teacher, tmp_path):
    teacher.mode = "mixed"  # the first word of a chunk picks the fault
    make_docs(Path(flat["documents"]), ["empty answer please", "prose answer please", "wrong schema please",
                                        "long answer please"])
    code, out = generate(flat)
    assert code == 0
    rejected = {r["chunk"]: r["reason"] for r in lines(out / REJECTED_FILE)}
    assert rejected == {"a_copy.txt#0": "duplicate", "e.jsonl:3#0": "empty", "e.jsonl:4#0": "not JSON",
                        "e.jsonl:5#0": "schema error", "e.jsonl:6#0": "too long"}
    progress = read_progress(out)
    assert progress["state"] == "completed" and progress["accepted"] == 6
    assert progress["rejected"] == {"duplicate": 1, "empty": 1, "not JSON": 1, "schema error": 1, "too long": 1}
    assert progress["requests"] == 10 and len(teacher.requests) == 10  # the duplicate was never asked
    assert progress["prompt_tokens"] == 100 and progress["latest"]
    # every request carried the schema and the key; the key is in no file
    assert all(r["headers"]["Authorization"] == f"Bearer {KEY}" for r in teacher.requests)
    assert '"first_word"' in teacher.requests[0]["body"]["messages"][0]["content"]
    no_key_under(out, tmp_path / "data")
    # the dataset: alpaca rows, registered, train and eval never share a document
    info = json.loads((tmp_path / "data" / "dataset_info.json").read_text())
    assert info["facts"]["file_name"] == "facts.json" and info["facts_eval"]["file_name"] == "facts_eval.json"
    train = json.loads((tmp_path / "data" / "facts.json").read_text())
    held = json.loads((tmp_path / "data" / "facts_eval.json").read_text())
    assert len(train) + len(held) == 6 and held
    assert not {r["document"] for r in train} & {r["document"] for r in held}
    for row in train + held:
        assert row["instruction"] == TASK and json.loads(row["output"]) == json.loads(row["output"])
        assert set(json.loads(row["output"])) == {"first_word", "words", "topic"}
    assert progress["dataset"]["train_rows"] == len(train) and progress["dataset"]["cutoff_len"] <= 128
    assert len(lines(out / PAIRS_FILE)) == 6
    # the backend's own loader reads it with the template
    from backend.dataprep.data import load_examples

    examples, _ = load_examples("facts", tmp_path / "data")
    assert examples[0]["messages"][0]["content"].startswith(TASK + "\n")


def test_429_then_ok_is_retried_and_a_rerun_answers_from_the_cache(flat, teacher):
    teacher.mode, teacher.fail_times = "429_then_ok", 2
    code, out = generate(flat)
    asked = 6  # 7 documents, one chunk each, minus the duplicate
    assert code == 0 and read_progress(out)["accepted"] == asked
    assert len(teacher.requests) == 3 * asked  # two 429s, then the answer
    assert "HTTP 429: rate limited; retry 1/2" in (out / "running_log.txt").read_text()
    first = (Path(flat["dataset_dir"]) / "facts.json").read_bytes()
    teacher.requests = []
    code, out = generate(flat)
    assert code == 0 and teacher.requests == [] and read_progress(out)["cached"] == asked
    assert (Path(flat["dataset_dir"]) / "facts.json").read_bytes() == first


@pytest.mark.parametrize("mode, said", [("500", "HTTP 500: boom"), ("bad_body", "malformed reply"),
                                        ("truncated", "the connection broke mid-reply"),
                                        ("slow", "timed out after 0.5 s (request_timeout)")])
def test_a_failing_teacher_ends_in_one_clear_line(flat, teacher, mode, said):
    from backend.distill.pipeline import DistillError

    teacher.mode, teacher.delay = mode, 3.0
    flat.update(request_timeout=0.5, max_retries=1)
    with pytest.raises(DistillError, match="the teacher answered none of the first") as exc:
        generate(flat)
    assert said in str(exc.value) and "after 2 attempts" in str(exc.value)
    # each failed chunk had its 2 attempts, and the run stopped early instead of trying all 6 chunks
    assert len(teacher.requests) <= 2 * 4
    assert KEY not in str(exc.value)


def test_refused_key_is_fatal_with_a_hint_and_never_shown(flat, teacher, monkeypatch):
    from backend.distill.pipeline import DistillError

    monkeypatch.setenv("FAKE_TEACHER_KEY", "sk-wrong-key-42")
    with pytest.raises(DistillError, match=r"HTTP 401: Incorrect API key provided \(the API key was refused: "
                                           "check the variable named by teacher_api_key_env"):
        generate(flat)
    assert len(teacher.requests) <= flat["concurrency"]  # no retry of a 401


def test_request_budget_stops_asking_and_a_bigger_budget_continues(flat, teacher):
    flat.update(max_requests=3, eval_ratio=0.0, concurrency=1)
    code, out = generate(flat)
    assert code == 0 and len(teacher.requests) == 3
    progress = read_progress(out)
    assert progress["accepted"] == 3 and progress["dataset"]["train_rows"] == 3
    status = json.loads((out / "status.json").read_text())
    assert any("max_requests 3 spent: 3 chunks were not asked" in w for w in status["warnings"])
    flat["max_requests"] = 0
    code, out = generate(flat)
    assert code == 0 and len(teacher.requests) == 6 and read_progress(out)["accepted"] == 6


def test_no_accepted_pair_is_an_error_not_an_empty_dataset(flat, teacher):
    from backend.distill.pipeline import DistillError

    teacher.mode = "answer_not_json"
    with pytest.raises(DistillError, match=r"no training pair accepted \(0 accepted, rejected: 6 not JSON, 1 duplicate"):
        generate(flat)
    assert not (Path(flat["dataset_dir"]) / "dataset_info.json").exists()
    rejected = lines(Path(flat["output_dir"]) / REJECTED_FILE)
    assert {r["reason"] for r in rejected} == {"duplicate", "not JSON"}
    assert read_progress(flat["output_dir"])["state"] == "failed"


def test_a_name_registered_for_another_file_is_refused(flat, tmp_path):
    from backend.distill.pipeline import DistillError

    data = Path(flat["dataset_dir"])
    data.mkdir(parents=True)
    (data / "theirs.json").write_text(json.dumps([{"instruction": "q", "output": "a"}]))
    (data / "dataset_info.json").write_text(json.dumps({"facts": {"file_name": "theirs.json"}}))
    with pytest.raises(DistillError, match="dataset_name: 'facts' is already registered .* for theirs.json"):
        generate(flat)
    assert json.loads((data / "dataset_info.json").read_text()) == {"facts": {"file_name": "theirs.json"}}
    assert re.search(r"accepted", (Path(flat["output_dir"]) / "running_log.txt").read_text())
    assert (Path(flat["output_dir"]) / PROGRESS_FILE).exists()


def test_the_example_recipe_validates_and_reads_its_documents(monkeypatch):
    from backend.distill.documents import load_documents
    from backend.distill.spec import load_distill
    from backend.core.paths import REPO_ROOT

    monkeypatch.chdir(REPO_ROOT)  # its paths are relative to the repository, where the README runs it
    spec = load_distill(["examples/distill/extraction.yaml"])
    assert spec.steps == ["generate"] and spec.schema_dict()["required"] == ["product", "price", "colors"]
    assert spec.example_list()[0]["output"]["price"] == 45
    docs = load_documents(spec.documents, spec.text_column)
    assert len(docs) == 5 and any("$129" in d.text and "track" not in d.text for d in docs)


def test_a_stopped_generation_keeps_its_answers_and_the_next_run_continues(flat, teacher):
    from backend.distill.pipeline import generate as gen
    from backend.core.rundir import RunDir

    flat.update(concurrency=1)
    spec = validate_distill(flat)
    run_dir = RunDir(spec.resolved_output_dir())
    code = gen(spec, run_dir, stop=lambda: len(teacher.requests) >= 2)  # Abort / SIGTERM after two answers
    run_dir.close()
    assert code == 130
    progress = read_progress(spec.resolved_output_dir())
    assert progress["state"] == "aborted" and "run the same spec again to continue" in progress["message"]
    assert not (Path(flat["dataset_dir"]) / "facts.json").exists()  # no half dataset
    code, out = generate(flat)
    assert code == 0 and len(teacher.requests) == 6 and read_progress(out)["cached"] == 2


def test_a_refused_connection_is_retried_then_named(flat):
    import socket

    from backend.distill.pipeline import DistillError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flat.update(teacher=f"http://127.0.0.1:{port}/v1", max_retries=1)
    with pytest.raises(DistillError, match=rf"cannot connect to http://127.0.0.1:{port}/v1.*\(after 2 attempts\)"):
        generate(flat)
    assert "retry 1/1" in (Path(flat["output_dir"]) / "running_log.txt").read_text()


def test_the_key_can_come_from_a_file(flat, teacher, tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_TEACHER_KEY")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "teacher.key").write_text(KEY + "\n")
    flat.update(teacher_api_key_file=str(tmp_path / "secrets" / "teacher.key"), eval_ratio=0.0)
    code, out = generate(flat)
    assert code == 0 and teacher.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"
    written = validate_distill(flat).to_yaml()  # what `tuneboard distill` writes as distill_spec.yaml
    assert "teacher.key" in written and KEY not in written  # the path, never the key
    no_key_under(out, tmp_path / "data")


# ------------------------------------------------------------------- issue #25 part 4: bounded replies
@pytest.mark.parametrize("mode", ["huge_stream", "huge"])
def test_a_huge_reply_is_cut_rejected_as_too_long_and_stored_short(flat, teacher, mode):
    """10 MB answers (with and without a Content-Length) at answer_tokens 40: reading stops past the byte
    budget, each chunk is "too long" (not "not JSON"), rejected.jsonl keeps a 500-character excerpt once with
    the size beside it, progress.json stays small."""
    from backend.distill.pipeline import DistillError

    teacher.mode, teacher.huge_bytes = mode, 10_000_000
    budget = 40 * 16 + 32 * 1024  # answer_tokens x 16 bytes + 32 KiB (backend.distill.teacher.reply_budget)

    with pytest.raises(DistillError, match=r"no training pair accepted \(0 accepted, rejected: 1 duplicate, 6 too long"):
        generate(flat)
    out = Path(flat["output_dir"])
    rows = [r for r in lines(out / REJECTED_FILE) if r["reason"] != "duplicate"]
    assert len(rows) == 6 and {r["reason"] for r in rows} == {"too long"}
    for r in rows:
        assert len(r["answer"]) <= 500 and r["reply_bytes"] > budget
        assert "bytes" in r["detail"] and len(r["detail"]) < 300
    assert (out / REJECTED_FILE).stat().st_size < 6 * 2000
    assert (out / PROGRESS_FILE).stat().st_size < 30_000
    assert all(len(json.dumps(p)) < 1200 for p in read_progress(out)["latest"])
    assert sum(f.stat().st_size for f in (out / "cache").iterdir()) < 6 * 10_000  # the cache keeps only the head
    teacher.requests = []
    with pytest.raises(DistillError, match="6 too long"):  # a rerun: the same verdicts from the cache
        generate(flat)
    assert teacher.requests == []


def test_an_answer_over_answer_tokens_is_too_long_whatever_its_format(flat, teacher):
    """A reply under the byte budget whose prose runs past answer_tokens: "too long", not "not JSON"."""
    from backend.distill.pipeline import DistillError

    teacher.mode, teacher.huge_bytes = "huge", 1200  # ~250 tokens of prose, well under the byte budget

    with pytest.raises(DistillError, match=r"rejected: 1 duplicate, 6 too long"):
        generate(flat)
    rows = [r for r in lines(Path(flat["output_dir"]) / REJECTED_FILE) if r["reason"] == "too long"]
    assert all(re.match(r"\d+ tokens > answer_tokens 40", r["detail"]) and r["answer_chars"] >= 1200 for r in rows)


# --------------------------------------------------------- kill -9 mid-generate, then the same spec again
def test_kill_9_during_generate_then_a_rerun_resumes_from_the_cache(flat, teacher, tmp_path):
    """`tuneboard distill` killed with SIGKILL while its third request waits at the teacher (two chunks
    answered and cached): the rerun asks only the four others and writes the dataset of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys

    from waiting import wait_for

    from backend.core.spec import parse_overrides

    teacher.mode, teacher.gate_after = "gate", 2
    teacher.gate.clear()
    args = [f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"
            for k, v in {**flat, "concurrency": 1}.items()]
    argv = [sys.executable, "-m", "backend.cli", "distill", *args]
    proc = subprocess.Popen(argv, cwd="/tmp", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for(lambda: len(teacher.requests) == 3 or proc.poll() is not None, timeout=300,
                 what="the third request to reach the teacher")
        assert proc.poll() is None, "tuneboard distill ended before the kill"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        teacher.gate.set()
    out = Path(flat["output_dir"])
    assert len(list((out / "cache").glob("*.json"))) == 2
    assert not (Path(flat["dataset_dir"]) / "facts.json").exists()

    teacher.requests = []
    rerun = subprocess.run(argv, cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "2 chunks answered from the cache (an earlier run); 4 to ask" in rerun.stdout
    assert len(teacher.requests) == 4

    whole = {**parse_overrides(args), "output_dir": str(tmp_path / "whole" / "run"),
             "dataset_dir": str(tmp_path / "whole" / "data")}
    assert generate(whole)[0] == 0  # the uninterrupted run (in-process)
    for name in ("facts.json", "facts_eval.json"):
        assert (Path(flat["dataset_dir"]) / name).read_bytes() == (tmp_path / "whole" / "data" / name).read_bytes()
    assert lines(out / PAIRS_FILE) == lines(tmp_path / "whole" / "run" / PAIRS_FILE)
    no_key_under(out, tmp_path / "whole")


def test_an_answer_a_teacher_ended_at_its_time_limit_is_too_long(flat):
    """A `tuneboard api` teacher ends a generation past --max-request-seconds with finish_reason time_limit
    (issue 25): its partial answer is "too long" and says why, not "not JSON"."""
    from transformers import AutoTokenizer

    from backend.distill.pipeline import Validator

    spec = validate_distill(flat)
    judge = Validator(spec, AutoTokenizer.from_pretrained(flat["model_name_or_path"]))
    answer, reason, detail = judge('{"first_word": "Ocea', "time_limit")
    assert (answer, reason) == (None, "too long") and "time limit" in detail
    assert judge('{"first_word": "Ocea', "stop")[1] == "not JSON"


# ------------------------------------------------------------------ bug hunt: documents, stop, cache, budget
def test_same_file_names_in_two_folders_stay_two_documents_and_a_file_listed_twice_is_read_once(tmp_path):
    from backend.distill.documents import load_documents

    for folder, text in (("dA", "Alpha notes about red widgets."), ("dB", "Beta notes about blue gadgets.")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "notes.txt").write_text(text, encoding="utf-8")
    docs = load_documents(f"{tmp_path / 'dA' / 'notes.txt'},{tmp_path / 'dB' / 'notes.txt'}")
    assert {d.id: d.text for d in docs} == {"dA/notes.txt": "Alpha notes about red widgets.",
                                            "dB/notes.txt": "Beta notes about blue gadgets."}
    assert [d.id for d in load_documents(f"{tmp_path / 'dA'},{tmp_path / 'dB'}")] == ["dA/notes.txt", "dB/notes.txt"]
    twice = load_documents(f"{tmp_path / 'dA' / 'notes.txt'},{tmp_path / 'dA' / 'notes.txt'},{tmp_path / 'dA'}")
    assert [d.id for d in twice] == ["notes.txt"]  # one folder's ids stay relative to it
    assert [d.id for d in load_documents(str(tmp_path / "dA"))] == ["notes.txt"]


def test_binary_files_and_undecodable_jsonl_lines_are_named_and_a_bom_is_read(tmp_path):
    from backend.distill.documents import DocumentError, load_documents

    (tmp_path / "blob.txt").write_bytes(b"PK\x03\x04\x00\x00binary\x00stuff")
    with pytest.raises(DocumentError, match=r"blob.txt: not a text file \(it holds NUL bytes\)"):
        load_documents(str(tmp_path / "blob.txt"))
    (tmp_path / "latin.md").write_bytes(bytes(range(0x80, 0x100)) * 4)
    with pytest.raises(DocumentError, match=r"latin.md: not UTF-8 text \(\d+ of \d+ characters undecodable\)"):
        load_documents(str(tmp_path / "latin.md"))
    (tmp_path / "fine.txt").write_bytes("Café notes, one stray byte: ".encode() + b"\xff.")  # kept (replaced)
    assert "Café notes" in load_documents(str(tmp_path / "fine.txt"))[0].text
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DocumentError, match=r"bad.jsonl line 2: not UTF-8 text \(byte 0xff at column 11\)"):
        load_documents(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert [(d.id, d.text) for d in load_documents(str(tmp_path / "bom.jsonl"))] == [("bom.jsonl:1", "first"),
                                                                                     ("bom.jsonl:2", "second")]


def test_near_duplicates_equal_the_pairwise_comparison_and_honour_the_stop(tmp_path):
    """The prefix-filtered search finds exactly what comparing every chunk with every earlier kept one finds;
    a stop switch set ends reading, chunking and comparing (Stopped), as SIGINT or a STOP file would."""
    import random

    from backend.distill.documents import (Chunk, Document, Stopped, chunk_documents, load_documents,
                                           near_duplicates, shingles)

    rng = random.Random(0)
    words = [f"w{i}" for i in range(25)]
    for _ in range(30):
        base = [rng.choice(words) for _ in range(rng.randint(3, 40))]
        chunks = []
        for i in range(15):
            text = list(base)
            for _ in range(rng.randint(0, 4)):
                text[rng.randrange(len(text))] = rng.choice(words)
            chunks.append(Chunk(f"c{i}#0", f"c{i}", 0, " ".join(text), 0))
        for threshold in (0.5, 0.8, 0.9, 1.0):
            kept, expected = [], {}
            for c in chunks:
                sh = shingles(c.text)
                hit = next((k for k, o in kept if len(sh & o) / len(sh | o) >= threshold), None)
                (expected.__setitem__(c.id, hit) if hit else kept.append((c.id, sh)))
            assert near_duplicates(chunks, threshold) == expected

    with pytest.raises(Stopped):
        near_duplicates(chunks, 0.9, stop=lambda: True)
    with pytest.raises(Stopped):
        chunk_documents([Document("a", "some words " * 50)], lambda *a, **k: None, 40, 8, stop=lambda: True)
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    with pytest.raises(Stopped):
        load_documents(str(tmp_path), stop=lambda: True)


def test_a_stop_while_the_documents_are_prepared_ends_the_step_before_any_request(flat, teacher):
    from backend.distill.pipeline import generate as gen
    from backend.core.rundir import RunDir

    spec = validate_distill(flat)
    run_dir = RunDir(spec.resolved_output_dir())
    run_dir.start()
    try:
        assert gen(spec, run_dir, stop=lambda: True) == 130
    finally:
        run_dir.close()
    progress = read_progress(spec.resolved_output_dir())
    assert progress["state"] == "aborted" and progress["message"].startswith("stopped while reading, chunking")
    assert teacher.requests == [] and not (spec.resolved_output_dir() / "cache").exists()


def test_the_local_teachers_cache_key_changes_with_its_weights(flat, tmp_path, tiny_qwen2):
    import os

    from backend.distill.pipeline import teacher_id

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\0" * 64)
    spec = validate_distill({**flat, "teacher": "local", "teacher_model": None, "teacher_local_adapter": str(adapter)})
    first = teacher_id(spec)
    assert first == teacher_id(spec) and str(adapter) in first
    weights.write_bytes(b"\1" * 64)  # retrained at the same path, same size: another mtime
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    second = teacher_id(spec)
    assert second != first
    # the teacher model's weights count too (the student's folder, when no teacher_local_model)
    model_file = next(f for f in Path(tiny_qwen2).iterdir() if f.suffix == ".safetensors")
    stat = model_file.stat()
    try:
        os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        assert teacher_id(spec) != second
    finally:
        os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_budget_spent_in_retries_says_the_chunk_was_asked(flat, teacher):
    from backend.distill.pipeline import DistillError

    teacher.mode, teacher.fail_times = "429_then_ok", 5
    flat.update(max_requests=2, max_retries=2, concurrency=1)
    with pytest.raises(DistillError, match="no training pair accepted"):
        generate(flat)
    warnings = json.loads((Path(flat["output_dir"]) / "status.json").read_text())["warnings"]
    said = next(w for w in warnings if "max_requests 2 spent" in w)
    assert "5 chunks were not asked" in said
    assert "1 chunks were asked but the budget ran out during their retries (last error: HTTP 429" in said


def test_spec_refuses_what_would_be_ignored_or_changed(tmp_path):
    def errors(**data):
        with pytest.raises(DistillSpecError) as exc:
            validate_distill({"documents": str(tmp_path), "task": "t", **data})
        return dict(exc.value.errors)

    said = errors(cutoff_len=512, answer_tokens=64, chunk_overlap=300)["chunk_overlap"]
    assert "chunk_overlap may be 224 at most" in said
    validate_distill({"documents": str(tmp_path), "task": "t", "cutoff_len": 512, "answer_tokens": 64,
                      "chunk_overlap": 224})
    # the default (64) is not refused where it does not fit: generate lowers it and warns
    validate_distill({"documents": str(tmp_path), "task": "t", "cutoff_len": 160, "answer_tokens": 64})
    assert "the train step's folder is <output_dir>/train" in errors(
        steps="generate,train", train_args={"output_dir": str(tmp_path / "elsewhere")})["train_args.output_dir"]
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    good = {"input": "x", "output": {"a": 1}}
    assert "item 1: its output is not JSON" in errors(examples=[good, {"input": "y", "output": "prose"}])["examples"]
    assert "item 1: its output fails json_schema at a: 'no' is not of type 'integer'" in errors(
        json_schema=schema, examples=[good, {"input": "y", "output": '{"a": "no"}'}])["examples"]
    validate_distill({"documents": str(tmp_path), "task": "t", "json_schema": schema, "examples": [good]})
    validate_distill({"documents": str(tmp_path), "task": "t", "answer_format": "text",
                      "examples": [{"input": "y", "output": "prose"}]})
    assert validate_distill({"documents": str(tmp_path), "task": "t", "steps": "train,generate"}).steps == [
        "generate", "train"]  # always run in the pipeline's order
