"""`tuneboard distill`: reads top to bottom.

generate: documents -> chunks (student tokenizer, sized to cutoff_len) -> near-duplicate chunks dropped ->
documents split train/eval -> each chunk asked to the teacher (cached by hash of chunk + task + teacher) ->
each answer validated (empty, too long, not JSON, schema error) -> the dataset files written and registered
in dataset_info.json (atomically) -> progress.json / rejected.jsonl / pairs.jsonl.
train: `tuneboard train` (SFT LoRA) on the dataset, into <output_dir>/train.
score: backend.distill.scorecard on the held-out pairs -> distill_report.json.

A kill (even -9) loses at most the requests in flight: every answered chunk is in cache/ and the next run
with the same spec answers from there, so it ends with the same dataset as a run never interrupted. The
final files are built in chunk order from the cache, never in arrival order.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jsonschema import Draft202012Validator

from backend.core import allowed, paths, teacher_access
from backend.core.model_files import locate
from backend.core.atomic import write_text_atomic
from backend.distill import (CACHE_DIRNAME, PAIRS_FILE, PROGRESS_FILE, REASONS, REJECTED_FILE, SPEC_FILE,
                             TEACHER_LOG, TRAIN_DIRNAME, DistillError, read_progress)
from backend.distill.documents import (DocumentError, Stopped, chunk_documents, load_documents, near_duplicates,
                                       split_documents)
from backend.distill.scorecard import score
from backend.distill.spec import (DistillSpec, DistillSpecError, dataset_dir_problem, dataset_entry, distill_fields,
                                  load_distill, train_cli_args)
from backend.distill.spec import train_overrides  # noqa: F401 - the web UI's distill tab imports it from here
from backend.distill.teacher import (CUT, Budget, BudgetExhausted, LocalTeacher, Teacher, TeacherError, TeacherFatal,
                                     read_api_key, reply_budget, teacher_messages)
from backend.core.metrics import parse_json
from backend.dataprep.resolve import pick_template
from backend.core.rundir import RUNNING_LOG, STOP_FILE, RunDir, read_status

LATEST = 20          # pairs shown in the UI's table (progress.json keeps this many, each field clipped)
LATEST_CHARS = 300   # of a pair's prompt, answer and detail in progress.json (the table shows 300)
FIELD_CHARS = 2000   # any other text in progress.json (a message, the teacher's URL)
EXCERPT_CHARS = 500  # of a rejected answer in rejected.jsonl (with its full size beside it)
RAW_SLACK_TOKENS = 16  # a ```json fence and blanks around an answer that is no JSON, before "too long"
PROGRESS_EVERY_S = 0.5
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


# ------------------------------------------------------------------------------------- small helpers


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _clip(text, limit: int):
    """`text` cut to `limit` characters (with an ellipsis); anything else as it is."""
    return text[:limit - 1] + "…" if isinstance(text, str) and len(text) > limit else text


def cache_key(spec: DistillSpec, teacher_id: str, system_and_examples: list[dict], chunk: str) -> str:
    blob = json.dumps({"chunk": chunk, "prompt": system_and_examples, "teacher": teacher_id,
                       "model": spec.teacher_model, "temperature": spec.temperature,
                       "max_tokens": spec.answer_tokens, "format": spec.answer_format}, sort_keys=True,
                      ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def weights_stamp(folder: Path, only: str | None = None) -> str:
    """The identity of the weight files in `folder` (or of its file `only`): a hash of each one's name, size and
    mtime_ns, so new weights at the same path are another teacher, without reading gigabytes. '' when none."""
    try:
        files = [folder / only] if only else sorted(f for f in folder.iterdir()
                                                      if f.is_file() and f.suffix.lower() in WEIGHT_SUFFIXES)
        stats = [(f.name, st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    except OSError:
        return ""
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16] if stats else ""


def teacher_id(spec: DistillSpec) -> str:
    """What identifies the teacher in the cache key (the local teacher's port changes every run): the local
    teacher's model and adapter paths with their weights' stamp (a retrained adapter at the same path is a new
    teacher, so its answers are asked again instead of read from the cache)."""
    if spec.teacher == "local":
        model = spec.teacher_local_model or spec.model_name_or_path
        try:
            model_stamp = weights_stamp(*locate(model))
        except (ValueError, OSError):  # not found here: the local teacher says why when it starts
            model_stamp = ""
        adapter = spec.teacher_local_adapter or ""
        adapter_stamp = weights_stamp(Path(adapter).expanduser()) if adapter else ""
        return f"local:{model}@{model_stamp}:{adapter}" + (f"@{adapter_stamp}" if adapter else "")
    return spec.teacher


# --------------------------------------------------------------------------------------- validation
class Validator:
    """An answer -> (accepted answer text | None, reason, detail). JSON answers are kept re-serialized
    (a ```json fence and surrounding blanks dropped) so the student learns clean JSON."""

    def __init__(self, spec: DistillSpec, tokenizer):
        self.spec, self.tokenizer = spec, tokenizer
        schema = spec.schema_dict()
        if schema is not None:
            self.schema = Draft202012Validator(schema)
        else:
            self.schema = None

    def __call__(self, text: str, finish_reason: str, reply_bytes: int = 0) -> tuple[str | None, str | None, str]:
        """Length before format: a reply past its byte budget, a teacher that hit max_tokens, an answer that is
        no JSON and longer than answer_tokens are "too long", not "not JSON". The detail never repeats the
        answer (rejected.jsonl keeps an excerpt of it beside)."""
        n = self.spec.answer_tokens
        if finish_reason == CUT:
            return None, "too long", (f"the reply passed {reply_budget(n)} bytes (the budget for answer_tokens {n}: "
                                      f"{n} x 16 + 32768): reading stopped, {reply_bytes} bytes")
        text = (text or "").strip()
        if not text:
            return None, "empty", "the teacher's answer is empty"
        if finish_reason == "length":
            return None, "too long", f"cut at max_tokens {n} (answer_tokens)"
        if finish_reason == "time_limit":  # a `tuneboard api` teacher ended it (its --max-request-seconds)
            return None, "too long", "the teacher ended it at its time limit (finish_reason time_limit)"
        if self.spec.answer_format == "json":
            ok, value = parse_json(text)
            if not ok:
                # one that overran its room is "too long" (it may be JSON cut short); a JSON one is measured
                # once re-serialized (below), so a pretty-printed answer that fits is kept
                raw_tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                if raw_tokens > n + RAW_SLACK_TOKENS:
                    return None, "too long", f"{raw_tokens} tokens > answer_tokens {n}"
                try:
                    json.loads(text)
                    why = "not a JSON value"
                except ValueError as exc:
                    why = str(exc)
                return None, "not JSON", f"{why} ({len(text)} characters)"[:200]
            if self.schema is not None:
                errors = sorted(self.schema.iter_errors(value), key=lambda e: list(e.path))
                if errors:
                    where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
                    return None, "schema error", f"{where}: {errors[0].message}"[:300]
            text = json.dumps(value, ensure_ascii=False)
            if value in ("", [], {}, None):
                return None, "empty", "an empty JSON value"
        tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokens > self.spec.answer_tokens:
            return None, "too long", f"{tokens} tokens > answer_tokens {self.spec.answer_tokens}"
        return text, None, ""


# ---------------------------------------------------------------------------------------- progress
class Progress:
    """Counts shared by the worker threads, written to progress.json (atomically, at most every 0.5 s)."""

    def __init__(self, path: Path, **fields):
        self.path = path
        self.lock = threading.Lock()
        self.data = {"state": "running", "accepted": 0, "rejected": {}, "answered": 0, "cached": 0, "asked": 0,
                     "failed": 0, "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "elapsed_s": 0.0,
                     "eta_s": None, "latest": [], "message": "", **fields}
        self.started = time.time()
        self._written = 0.0

    def update(self, force: bool = False, **fields) -> None:
        with self.lock:
            self.data.update(fields)
            self._flush(force)

    def count(self, record: dict, *, new: bool, usage=None, requests: int = 0) -> None:
        with self.lock:
            d = self.data
            d["answered"] += record["reason"] != "teacher error"
            d["cached"] += not new and record["reason"] != "teacher error"
            d["asked"] += new
            if record["reason"] is None:
                d["accepted"] += 1
            else:
                d["rejected"][record["reason"]] = d["rejected"].get(record["reason"], 0) + 1
            if usage is not None:
                d["prompt_tokens"] += usage.prompt_tokens
                d["completion_tokens"] += usage.completion_tokens
            d["requests"] = requests
            d["latest"] = ([latest_entry(record)] + d["latest"])[:LATEST]
            elapsed = time.time() - self.started
            d["elapsed_s"] = round(elapsed, 1)
            left = d["to_ask"] - d["answered"] - d["failed"]
            rate = d["asked"] / elapsed if d["asked"] and elapsed > 0 else None
            d["eta_s"] = round(left / rate, 1) if rate and left > 0 else (0.0 if left <= 0 else None)
            self._flush(False)

    def _flush(self, force: bool) -> None:
        now = time.time()
        if force or now - self._written >= PROGRESS_EVERY_S:
            self.data["updated_at"] = now
            data = {k: _clip(v, FIELD_CHARS) for k, v in self.data.items()}  # the UI reads it every tick
            write_text_atomic(self.path, json.dumps(data, ensure_ascii=False, indent=1))
            self._written = now


def latest_entry(record: dict) -> dict:
    """A pair as progress.json's `latest` shows it: its texts clipped to LATEST_CHARS."""
    return {k: _clip(record[k], LATEST_CHARS) for k in ("chunk", "split", "reason", "detail", "prompt", "answer")}


def rejected_row(record: dict) -> dict:
    """A rejected pair as rejected.jsonl keeps it: the answer as an excerpt, with its full size."""
    row = {k: record[k] for k in ("chunk", "document", "split", "reason", "detail")}
    row["answer"] = _clip(record["answer"], EXCERPT_CHARS)
    row.update({k: record[k] for k in ("answer_chars", "reply_bytes") if k in record})
    return row


# ------------------------------------------------------------------------------- teacher access
def check_teacher_access(spec: DistillSpec) -> None:
    """For a run the web UI started (backend.core.teacher_access.restricted()), the UI's checks once more: the
    key's variable is one the operator offers for this base URL, a key file lies in the allowed folders,
    the URL is no internal address unless allowed. DistillError names every refusal; a CLI run passes."""
    if spec.teacher == "local" or not teacher_access.restricted():
        return
    refused = teacher_access.endpoint_refusals(spec.teacher, spec.teacher_api_key_env, spec.teacher_api_key_file)
    if refused:
        raise DistillError("; ".join(str(r) for r in refused))


def guarded(spec: DistillSpec) -> bool:
    """Whether the teacher client must refuse internal addresses at connect time (a UI run's URL the
    operator did not allow)."""
    if spec.teacher == "local" or not teacher_access.restricted():
        return False
    return teacher_access.normalize_url(spec.teacher) not in teacher_access.allowed_urls()


# ---------------------------------------------------------------------------------------- generate
def generate(spec: DistillSpec, run_dir, stop) -> int:
    """The generate step; returns the exit code (0 ok, 1 failed, 130 stopped). Never raises for a user's
    mistake: the status and the log say what went wrong."""
    check_teacher_access(spec)
    problem = dataset_dir_problem(spec)
    if problem:  # refused before any teacher request, not after them all
        raise DistillError(f"dataset_dir: {problem}")
    out = spec.resolved_output_dir()
    progress = Progress(out / PROGRESS_FILE, documents=0, chunks=0, to_ask=0, train_chunks=0, eval_chunks=0,
                        duplicates=0, dataset=None, teacher=teacher_id(spec), dataset_name=spec.dataset_name)

    try:
        return _generate(spec, run_dir, stop, progress)
    except Stopped:
        message = "stopped while reading, chunking and comparing the documents (no teacher request was made)"
        progress.update(force=True, state="aborted", message=message)
        run_dir.log(message)
        return 130


def _preparing(run_dir, progress: Progress, what: str):
    """on_progress(done, total) of one preparation phase: progress.json's message and status.json's step."""
    run_dir.log(f"{what}...")
    run_dir.update_status(preparing=what)

    def said(done: int, total: int) -> None:
        progress.update(force=True, message=f"{what}: {done} of {total}")
        run_dir.update_status(preparing=what, step=done, total_steps=total)

    return said


def _generate(spec: DistillSpec, run_dir, stop, progress: Progress) -> int:
    from backend.training.models import load_tokenizer, resolve_model  # heavy (torch): the UI imports this module

    out = spec.resolved_output_dir()
    docs = load_documents(spec.documents, spec.text_column, warn=run_dir.warn, stop=stop,
                          on_progress=_preparing(run_dir, progress, "reading the documents"))
    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    template = pick_template(spec.template, resolved, tokenizer, warn=run_dir.warn)
    frame = template.render_text([{"role": "user", "content": spec.task.strip() + "\n"}], None,
                                 add_generation_prompt=True)
    overhead = len(tokenizer(frame, add_special_tokens=False)["input_ids"]) + 8
    chunk_tokens = spec.cutoff_len - spec.answer_tokens - overhead
    if chunk_tokens < 32:
        raise DistillError(f"cutoff_len {spec.cutoff_len} leaves {chunk_tokens} tokens per chunk after the answer "
                           f"(answer_tokens {spec.answer_tokens}) and the instruction ({overhead} tokens with the "
                           "template): raise cutoff_len or shorten task")
    overlap = min(spec.chunk_overlap, chunk_tokens // 2)
    if overlap < spec.chunk_overlap:
        run_dir.warn(f"chunk_overlap {spec.chunk_overlap} lowered to {overlap}: at most half of the {chunk_tokens} "
                     "tokens a chunk has here (cutoff_len - answer_tokens - the instruction with the template)")
    chunks = chunk_documents(docs, tokenizer, chunk_tokens, overlap, stop=stop,
                             on_progress=_preparing(run_dir, progress, "chunking the documents"))
    dupes = near_duplicates(chunks, spec.dedup_threshold, stop=stop,
                            on_progress=_preparing(run_dir, progress, "finding near-duplicate chunks"))
    # documents made only of near-duplicates have nothing to hold out: split the others
    held_out = split_documents([c.doc_id for c in chunks if c.id not in dupes], spec.eval_ratio, spec.seed)
    split_of = {c.id: "eval" if c.doc_id in held_out else "train" for c in chunks}
    to_ask = [c for c in chunks if c.id not in dupes]
    run_dir.log(f"{len(docs)} documents -> {len(chunks)} chunks of at most {chunk_tokens} tokens "
                f"(overlap {overlap}); {len(dupes)} near-duplicate chunks dropped; "
                f"{len(held_out)} of {len(docs)} documents held out for eval")
    progress.update(force=True, documents=len(docs), chunks=len(chunks), to_ask=len(to_ask), duplicates=len(dupes),
                    train_chunks=sum(split_of[c.id] == "train" for c in to_ask),
                    eval_chunks=sum(split_of[c.id] == "eval" for c in to_ask), chunk_tokens=chunk_tokens)
    run_dir.update_status(total_steps=len(to_ask), step=0, preparing=None)

    schema, examples = spec.schema_dict(), spec.example_list()
    validate = Validator(spec, tokenizer)
    cache_dir = out / CACHE_DIRNAME
    cache_dir.mkdir(parents=True, exist_ok=True)
    prefix = teacher_messages(spec.task, "", schema, examples, spec.answer_format)[:-1]
    keys = {c.id: cache_key(spec, teacher_id(spec), prefix, c.text) for c in to_ask}
    records: dict[str, dict] = {}
    by_id = {c.id: c for c in chunks}

    def record_of(chunk, text, finish, reason=None, detail="", reply_bytes=0):
        answer, why, detail2 = (None, reason, detail) if reason else validate(text, finish, reply_bytes)
        rec = {"chunk": chunk.id, "document": chunk.doc_id, "split": split_of[chunk.id], "reason": why,
               "detail": detail2, "prompt": chunk.text, "answer": answer if answer is not None else (text or "")}
        if answer is None:  # only an excerpt of a rejected answer is kept past this point: say its size
            rec["answer"] = _clip(rec["answer"], EXCERPT_CHARS)
            rec["reply_bytes" if finish == CUT else "answer_chars"] = reply_bytes if finish == CUT else len(text or "")
        return rec

    for chunk in chunks:
        if chunk.id in dupes:
            records[chunk.id] = {"chunk": chunk.id, "document": chunk.doc_id, "split": split_of[chunk.id],
                                 "reason": "duplicate", "detail": f"near-duplicate of {dupes[chunk.id]}",
                                 "prompt": chunk.text, "answer": ""}
    with progress.lock:
        if dupes:
            progress.data["rejected"]["duplicate"] = len(dupes)
            progress.data["latest"] = [latest_entry(records[i]) for i in dupes][:LATEST]
    pending = []
    for chunk in to_ask:
        cached = cache_dir / f"{keys[chunk.id]}.json"
        try:
            hit = json.loads(cached.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pending.append(chunk)
            continue
        rec = record_of(chunk, hit.get("answer", ""), hit.get("finish_reason", "stop"),
                        reply_bytes=hit.get("reply_bytes", 0))
        records[chunk.id] = rec
        progress.count(rec, new=False)
    if len(pending) < len(to_ask):
        run_dir.log(f"{len(to_ask) - len(pending)} chunks answered from the cache (an earlier run); "
                    f"{len(pending)} to ask")

    local = None
    fatal: list[str] = []
    budget = Budget(spec.max_requests)
    stopped = lambda: bool(stop() or fatal)  # noqa: E731
    state = {"ok": 0, "failed": 0, "not_asked": 0, "cut_short": 0, "cut_last": ""}
    if pending:
        workers = spec.concurrency
        if spec.teacher == "local":
            workers = 1  # one loaded model answers one request at a time: more would only queue (and time out)
            local = LocalTeacher(spec.teacher_local_model or spec.model_name_or_path, spec.teacher_local_adapter,
                                 spec.template, out / TEACHER_LOG, log=run_dir.log)
            base_url, api_key = local.start(), local.key
        else:
            base_url = spec.teacher
            api_key = read_api_key(spec.teacher_api_key_env, spec.teacher_api_key_file)
            if api_key is None and spec.teacher_api_key_env:
                run_dir.log(f"no API key: ${spec.teacher_api_key_env} is not set"
                            + (" (nor teacher_api_key_file)" if not spec.teacher_api_key_file else ""))
            elif api_key is None:
                run_dir.log("no API key (teacher_api_key_env is empty)")
        teacher = Teacher(base_url, spec.teacher_model or "", api_key, timeout=spec.request_timeout,
                          max_retries=spec.max_retries, backoff=spec.retry_backoff, temperature=spec.temperature,
                          max_tokens=spec.answer_tokens, budget=budget, stop=stopped, log=run_dir.log,
                          guard=guarded(spec))
        try:
            if not teacher.model:
                served = teacher.list_models()
                teacher.model = served[-1] if served else "default"
            run_dir.log(f"teacher {teacher.model} at {base_url if spec.teacher != 'local' else 'local'}: "
                        f"{len(pending)} chunks, {workers} at a time"
                        + (f", budget {spec.max_requests} requests" if spec.max_requests else ""))
            lock = threading.Lock()

            def work(chunk):
                if stopped():
                    return
                try:
                    answer = teacher.ask(teacher_messages(spec.task, chunk.text, schema, examples, spec.answer_format))
                except BudgetExhausted as exc:
                    with lock:
                        if exc.attempts:  # asked, then retried until the budget ran out
                            state["cut_short"] += 1
                            state["cut_last"] = exc.last
                        else:
                            state["not_asked"] += 1
                    return
                except TeacherFatal as exc:
                    with lock:
                        fatal.append(str(exc)) if not fatal else None
                    return
                except TeacherError as exc:
                    if stop():
                        return
                    rec = record_of(chunk, "", "", reason="teacher error", detail=str(exc))
                    with lock:
                        state["failed"] += 1
                        records[chunk.id] = rec
                        if not state["ok"] and state["failed"] >= max(3, workers) and not fatal:
                            fatal.append(f"the teacher answered none of the first {state['failed']} requests; "
                                         f"last error: {exc}")
                    with progress.lock:
                        progress.data["failed"] += 1
                    progress.count(rec, new=False, requests=budget.used)
                    return
                write_text_atomic(cache_dir / f"{keys[chunk.id]}.json",
                              json.dumps({"chunk": chunk.id, "answer": answer.text, "finish_reason": answer.finish_reason,
                                          "prompt_tokens": answer.prompt_tokens,
                                          "completion_tokens": answer.completion_tokens,
                                          "reply_bytes": answer.reply_bytes}, ensure_ascii=False))
                rec = record_of(chunk, answer.text, answer.finish_reason, reply_bytes=answer.reply_bytes)
                with lock:
                    state["ok"] += 1
                    records[chunk.id] = rec
                progress.count(rec, new=True, usage=answer, requests=budget.used)

            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teacher") as pool:
                futures = [pool.submit(work, c) for c in pending]
                step = -1
                while not all(f.done() for f in futures):
                    if stopped():
                        for f in futures:
                            f.cancel()
                    if progress.data["answered"] != step:  # status.json from this thread only (not thread-safe)
                        step = progress.data["answered"]
                        run_dir.update_status(step=step)
                    time.sleep(0.1)
                run_dir.update_status(step=progress.data["answered"])
                for f in futures:
                    if not f.cancelled() and f.exception() is not None:
                        raise f.exception()
        finally:
            teacher.close()
            if local:
                local.stop()
    progress.update(requests=budget.used)

    if fatal:
        progress.update(force=True, state="failed", message=fatal[0])
        raise DistillError(fatal[0])
    if stop():
        done = sum(1 for c in to_ask if c.id in records and records[c.id]["reason"] != "teacher error")
        message = (f"stopped: {done} of {len(to_ask)} chunks answered and cached; run the same spec again to "
                   "continue from there")
        progress.update(force=True, state="aborted", message=message)
        run_dir.log(message)
        return 130
    if state["not_asked"] or state["cut_short"]:
        said = []
        if state["not_asked"]:
            said.append(f"{state['not_asked']} chunks were not asked")
        if state["cut_short"]:
            said.append(f"{state['cut_short']} chunks were asked but the budget ran out during their retries "
                        f"(last error: {state['cut_last']})")
        run_dir.warn(f"max_requests {spec.max_requests} spent: {'; '.join(said)}; raise max_requests and run again "
                     "to ask them (the answered ones are cached)")
    if state["failed"]:
        run_dir.warn(f"{state['failed']} chunks failed at the teacher after their retries (see {REJECTED_FILE}); "
                     "run again to retry them")

    # -- the final files, in chunk order ---------------------------------------------------------------
    ordered = [records[c.id] for c in chunks if c.id in records]
    accepted = [r for r in ordered if r["reason"] is None]
    rejected = [r for r in ordered if r["reason"] is not None]
    write_text_atomic(out / REJECTED_FILE, _jsonl([rejected_row(r) for r in rejected]))
    write_text_atomic(out / PAIRS_FILE, _jsonl([{k: r[k] for k in ("chunk", "document", "split", "prompt", "answer")}
                                            for r in accepted]))
    reasons = {why: n for why in REASONS if (n := sum(r["reason"] == why for r in rejected))}
    summary = ", ".join(f"{n} {why}" for why, n in reasons.items()) or "none"
    run_dir.log(f"{len(accepted)} pairs accepted, {len(rejected)} rejected ({summary})")
    train = [r for r in accepted if r["split"] == "train"]
    held = [r for r in accepted if r["split"] == "eval"]
    if not train:
        message = (f"no training pair accepted ({len(accepted)} accepted, rejected: {summary}): nothing to register; "
                   f"see {out / REJECTED_FILE}")
        progress.update(force=True, state="failed", message=message, accepted=len(accepted), rejected=reasons)
        raise DistillError(message)
    dataset = write_dataset(spec, train, held, tokenizer, overhead, by_id)
    message = (f"dataset {dataset['name']} registered: {dataset['train_rows']} train rows"
               + (f", {dataset['eval_rows']} eval rows ({dataset['eval_name']})" if dataset["eval_rows"] else "")
               + f" in {dataset['dataset_dir']}")
    run_dir.log(message)
    progress.update(force=True, state="completed", message=message, dataset=dataset, accepted=len(accepted),
                    rejected=reasons, eta_s=0.0, elapsed_s=round(time.time() - progress.started, 1))
    return 0


def write_dataset(spec: DistillSpec, train: list[dict], held: list[dict], tokenizer, overhead: int, by_id) -> dict:
    """<dataset_dir>/<name>.json (+ <name>_eval.json) in LLaMA-Factory's alpaca format, registered in
    dataset_info.json through backend.dataprep.data.register_dataset (checked, written atomically). A name already
    registered for another file is refused (dataset_name)."""
    from backend.dataprep.data import DatasetError, load_dataset_info, register_dataset  # heavy (datasets): UI imports this

    ddir = spec.resolved_dataset_dir()
    problem = dataset_dir_problem(spec)
    if problem:
        raise DistillError(f"dataset_dir: {problem}")
    ddir.mkdir(parents=not spec.dataset_dir, exist_ok=True)  # a given one: the folder itself, never its parents
    names = [(spec.dataset_name, train), (f"{spec.dataset_name}_eval", held)]
    info = load_dataset_info(ddir) if (ddir / "dataset_info.json").exists() else {}
    for name, _ in names:
        entry = info.get(name)
        if isinstance(entry, dict) and entry.get("file_name") != f"{name}.json":
            raise DistillError(f"dataset_name: {name!r} is already registered in {ddir / 'dataset_info.json'} for "
                               f"{entry.get('file_name')}; choose another dataset_name")
    lengths = []
    for name, rows in names:
        if not rows:
            continue
        data = [{"instruction": spec.task.strip(), "input": r["prompt"], "output": r["answer"],
                 "document": r["document"], "chunk": r["chunk"]} for r in rows]
        write_text_atomic(ddir / f"{name}.json", json.dumps(data, ensure_ascii=False, indent=1) + "\n")
        entry = dataset_entry(name)
        try:
            register_dataset(ddir, name, entry, overwrite=name in info)
        except DatasetError as exc:
            raise DistillError(f"registering {name}: {exc}") from None
        lengths += [by_id[r["chunk"]].tokens + overhead + len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"]) + 2
                    for r in rows]
    longest = max(lengths)
    cutoff = min(spec.cutoff_len, max(64, -(-longest // 64) * 64))
    return {"name": spec.dataset_name, "eval_name": f"{spec.dataset_name}_eval" if held else None,
            "dataset_dir": str(ddir), "train_rows": len(train), "eval_rows": len(held), "max_tokens": longest,
            "cutoff_len": cutoff, "template": spec.template, "model_name_or_path": spec.model_name_or_path}


# ------------------------------------------------------------------------------------------- train
def train(spec: DistillSpec, run_dir, stop=lambda: False) -> int:
    """`tuneboard train` on the dataset (a child process: its own run folder, status and log); 130 when it was
    stopped. A stop of the distill run (SIGINT, SIGTERM, its STOP file) is passed on as the web UI stops a
    training run: a STOP file in the child's run folder, which it reads at its next step, saves and ends."""
    dataset = read_progress(spec.resolved_output_dir()).get("dataset")
    if not dataset:
        raise DistillError("step train: no registered dataset in this run folder yet (run step generate first)")
    out = spec.resolved_output_dir() / TRAIN_DIRNAME
    args = train_cli_args(spec, dataset, out)  # what validate_distill checked up front (train_spec_errors)
    argv = paths.tuneboard_argv("train", *args)
    run_dir.log("train: tuneboard train " + " ".join(args))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    pump = threading.Thread(target=lambda: [run_dir.log(f"  train | {line.rstrip()}") for line in proc.stdout],
                            daemon=True, name="train-log")
    pump.start()
    told = False
    while proc.poll() is None:
        # written again while missing: the child removes a STOP file it takes for an earlier run's as it starts
        if stop() and not (out / STOP_FILE).exists():
            out.mkdir(parents=True, exist_ok=True)
            (out / STOP_FILE).write_text("stop requested by the distill run\n", encoding="utf-8")
            if not told:
                run_dir.log(f"stop: asked tuneboard train to stop (wrote {out / STOP_FILE})")
            told = True
        time.sleep(0.2)
    code = proc.wait()
    pump.join(timeout=10)
    if code == 130 or (told and read_status(out).get("state") == "aborted"):
        run_dir.log(f"train: tuneboard train was stopped (exit code {code}; see {out / RUNNING_LOG})")
        return 130
    if code != 0:
        raise DistillError(f"step train: tuneboard train ended with exit code {code} (see {out / RUNNING_LOG})")
    return 0


# --------------------------------------------------------------------------------------------- run
def run(spec: DistillSpec) -> int:
    """Every step of spec.steps in order, in one run folder; returns the exit code."""
    from backend.training.callbacks import StopSwitch  # heavy (transformers): the UI imports this module

    out = spec.resolved_output_dir()
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / SPEC_FILE, spec.to_yaml())
    run_dir = RunDir(out)
    run_dir.start()
    switch = StopSwitch(run_dir)
    switch.install()
    stop = lambda: switch.reason is not None  # noqa: E731
    run_dir.log(f"distill: steps {', '.join(spec.steps)}; run folder {out}")
    try:
        for step in spec.steps:
            run_dir.update_status(phase=step)
            if step == "generate":
                code = generate(spec, run_dir, stop)
            elif step == "train":
                code = train(spec, run_dir, stop)
            else:
                code = score(spec, run_dir, stop)
            if code == 130 or stop():
                run_dir.finish("aborted", 130, stop_reason=switch.reason)
                return 130
            if code:
                run_dir.finish("failed", code)
                return code
    except Exception as exc:  # noqa: BLE001 - the status and the log say why
        known = (DistillError, DocumentError, TeacherFatal, FileNotFoundError, ValueError)
        message = str(exc) if isinstance(exc, known) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, known):
            run_dir.log_traceback()
        run_dir.log(f"FAILED: {message}")
        print(f"error: {message}", file=sys.stderr, flush=True)
        run_dir.finish("failed", 1, error=message)
        run_dir.close()
        return 1
    run_dir.finish("completed", 0)
    run_dir.close()
    return 0


USAGE = """usage: tuneboard distill [SPEC.yaml] [key=value ...]

Documents + a teacher -> validated pairs -> a registered dataset (step generate), a LoRA fine-tune on it
(step train), the student (base and tuned) against the teacher on held-out chunks (step score). The API key is
read from the environment variable named by teacher_api_key_env (or teacher_api_key_file), never from the spec.

keys:
"""


def main(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        lines = [f"  {f['name']:<24} {f['description']}" + ("" if f["required"] else f" (default: {f['default']!r})")
                 for f in distill_fields()]
        print(USAGE + "\n".join(lines))
        return 0 if args else 2
    try:
        spec = load_distill(args)
    except DistillSpecError as exc:
        for key, message in exc.errors:
            print(f"error: {key}: {message}", file=sys.stderr)
        return 1
    return run(spec)
