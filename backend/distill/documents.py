"""Documents -> text -> token-aware chunks, and near-duplicate chunks found.

Formats: .txt / .md as they are; .html / .htm through trafilatura (the main text, boilerplate such as
scripts and styles dropped; its plain html2txt when extraction finds nothing); .pdf through pypdf (the
text of every page); .jsonl one document per line from `text_column`. Why these libraries: both are well
kept, pure Python (trafilatura pulls lxml wheels) and Apache/BSD licensed.

Chunks are cut in the student's tokenizer so every chunk, with the instruction and the answer, fits the
student's cutoff_len: windows of `chunk_tokens` tokens, `overlap` tokens shared by neighbours, cut at the
tokenizer's character offsets so a chunk's text is exactly a slice of the document.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf", ".jsonl")


NOT_TEXT_SHARE = 0.05  # a text file with more than this share of undecodable UTF-8 bytes is no text
MAX_CANDIDATES = 200   # near_duplicates: earlier chunks compared with one chunk at most (see there)
PROGRESS_EVERY_S = 0.5


class DocumentError(ValueError):
    """A document that cannot be read: one line naming the file (and row)."""


class Stopped(Exception):
    """The stop switch was set while documents were read, chunked or compared (SIGINT, SIGTERM, a STOP file)."""


def _never() -> bool:
    return False


class _Every:
    """Calls on_progress(done, total) at most every PROGRESS_EVERY_S seconds (and at the end)."""

    def __init__(self, on_progress, total: int):
        self.on_progress, self.total, self.last = on_progress, total, 0.0

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if self.on_progress and (done == self.total or now - self.last >= PROGRESS_EVERY_S):
            self.last = now
            self.on_progress(done, self.total)


@dataclass
class Document:
    id: str      # the file path relative to the inputs' common folder (plus ':<line>' for a JSONL row)
    text: str


@dataclass
class Chunk:
    id: str      # <document id>#<index>
    doc_id: str
    index: int
    text: str
    tokens: int


def html_to_text(raw: str) -> str:
    import trafilatura  # heavy: loaded on use, so importing this module stays light

    text = trafilatura.extract(raw, favor_recall=True, include_tables=True, include_comments=False)
    return text if text and text.strip() else trafilatura.html2txt(raw)


def pdf_to_text(path: Path) -> str:
    from pypdf import PdfReader  # heavy: loaded on use, so importing this module stays light
    from pypdf.errors import PdfReadError  # heavy: loaded on use, so importing this module stays light

    try:
        reader = PdfReader(str(path))
        return "\n\n".join((page.extract_text() or "").strip() for page in reader.pages).strip()
    except (PdfReadError, OSError, ValueError) as exc:
        raise DocumentError(f"{path}: not a readable PDF ({exc})") from None


def _files(spec_documents: str) -> list[tuple[Path, Path]]:
    """(file, the folder its id is relative to) for each document file, in a stable order, each file once. Ids
    are relative to the common folder of every input (a folder given, or a file's parent), so dA/notes.txt and
    dB/notes.txt listed together stay two documents; one folder alone keeps ids relative to itself."""
    found: list[Path] = []
    tops: list[Path] = []
    for item in [p.strip() for p in spec_documents.split(",") if p.strip()]:
        path = Path(item).expanduser().resolve()
        if path.is_dir():
            tops.append(path)
            found += [f for f in sorted(path.rglob("*"))
                      if f.is_file() and f.suffix.lower() in SUFFIXES and not f.name.startswith(".")]
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise DocumentError(f"documents: {path.name}: unsupported file type (use {', '.join(SUFFIXES)})")
            tops.append(path.parent)
            found.append(path)
        else:
            raise DocumentError(f"documents: {item} does not exist")
    root = Path(os.path.commonpath([str(t) for t in tops])) if tops else Path("/")
    return [(f, root) for f in dict.fromkeys(found)]  # a file listed twice (or inside a folder listed) is read once


def _text_of(path: Path, raw: bytes) -> str:
    """A text document's bytes as text; DocumentError when they are not text (a NUL byte, or more than
    NOT_TEXT_SHARE of them undecodable as UTF-8): binary data would go to the teacher and into the dataset."""
    if b"\0" in raw:
        raise DocumentError(f"{path}: not a text file (it holds NUL bytes): remove it from documents or convert it")
    text = raw.decode("utf-8-sig", errors="replace")
    bad = text.count("\ufffd") - raw.count("\ufffd".encode())
    if bad > max(4, NOT_TEXT_SHARE * len(text)):
        raise DocumentError(f"{path}: not UTF-8 text ({bad} of {len(text)} characters undecodable): convert it "
                            "to UTF-8 or remove it from documents")
    return text


def _jsonl_documents(path: Path, rel: str, text_column: str, docs: list, empty: list, stop) -> None:
    """One document per line of a JSONL file (a UTF-8 BOM allowed, as the data loader allows it); a line that is
    not UTF-8, not JSON or lacks the text column is an error naming the file and line."""
    with open(path, "rb") as fh:
        for n, data in enumerate(fh, 1):
            if stop():
                raise Stopped()
            if n == 1:
                data = data.removeprefix(b"\xef\xbb\xbf")
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DocumentError(f"{path} line {n}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
                                    f"{exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DocumentError(f"{path} line {n}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or text_column not in row:
                raise DocumentError(f"{path} line {n}: no '{text_column}' field (text_column)")
            text = str(row[text_column] or "").strip()
            (docs.append(Document(f"{rel}:{n}", text)) if text else empty.append(f"{rel}:{n}"))


def load_documents(spec_documents: str, text_column: str = "text", warn=print, stop=_never,
                   on_progress=None) -> list[Document]:
    """Every document of the `documents` key, in a stable order. Empty documents are skipped with a warning;
    a file that is not text, a JSONL line that is not UTF-8, not JSON or lacks the text column is an error
    naming the file (and line). `stop()` is asked between files (Stopped); on_progress(done, total) said."""
    docs: list[Document] = []
    empty = []
    files = _files(spec_documents)
    tick = _Every(on_progress, len(files))
    for i, (path, root) in enumerate(files):
        if stop():
            raise Stopped()
        tick(i)
        rel = path.relative_to(root).as_posix()
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            try:
                _jsonl_documents(path, rel, text_column, docs, empty, stop)
            except OSError as exc:
                raise DocumentError(f"{path}: cannot read ({exc.strerror or exc})") from None
            continue
        try:
            raw = path.read_bytes() if suffix != ".pdf" else b""
        except OSError as exc:
            raise DocumentError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if suffix == ".pdf":
            text = pdf_to_text(path)
        elif suffix in (".html", ".htm"):
            text = html_to_text(_text_of(path, raw))
        else:
            text = _text_of(path, raw)
        text = (text or "").strip()
        (docs.append(Document(rel, text)) if text else empty.append(rel))
    tick(len(files))
    if empty:
        warn(f"{len(empty)} empty document(s) skipped: {', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}")
    if not docs:
        raise DocumentError(f"documents: no document with text in {spec_documents} (supported: {', '.join(SUFFIXES)})")
    return docs


def chunk_text(text: str, tokenizer, chunk_tokens: int, overlap: int, stop=_never) -> list[tuple[str, int]]:
    """(chunk text, tokens) windows of a document: `chunk_tokens` tokens each, `overlap` shared (less than
    chunk_tokens: the pipeline keeps it at most half)."""
    if not 0 <= overlap < chunk_tokens:
        raise ValueError(f"overlap {overlap} must be below chunk_tokens {chunk_tokens}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc.get("offset_mapping")
    if len(ids) <= chunk_tokens:
        return [(text, len(ids))]
    step, out = chunk_tokens - overlap, []
    for start in range(0, len(ids), step):
        if stop():
            raise Stopped()
        end = min(start + chunk_tokens, len(ids))
        if offsets:
            piece = text[offsets[start][0]:offsets[end - 1][1]]
        else:  # a slow tokenizer: decode the window
            piece = tokenizer.decode(ids[start:end])
        if piece.strip():
            out.append((piece.strip(), end - start))
        if end == len(ids):
            break
    return out


def chunk_documents(docs: list[Document], tokenizer, chunk_tokens: int, overlap: int, stop=_never,
                    on_progress=None) -> list[Chunk]:
    """Every document's chunks, in order. `stop()` is asked between documents and windows (Stopped);
    on_progress(documents done, documents) is said at most every PROGRESS_EVERY_S seconds."""
    chunks = []
    tick = _Every(on_progress, len(docs))
    for d, doc in enumerate(docs):
        if stop():
            raise Stopped()
        tick(d)
        for i, (text, n) in enumerate(chunk_text(doc.text, tokenizer, chunk_tokens, overlap, stop)):
            chunks.append(Chunk(f"{doc.id}#{i}", doc.id, i, text, n))
    tick(len(docs))
    return chunks


# -------------------------------------------------------------------------------- near duplicates
_WORD = re.compile(r"\w+", re.U)


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def shingles(text: str, n: int = 3) -> set[int]:
    """Hashed word n-grams (stable across processes, unlike hash())."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {_h(" ".join(words))}
    return {_h(" ".join(words[i:i + n])) for i in range(len(words) - n + 1)}


def near_duplicates(chunks: list[Chunk], threshold: float, stop=_never, on_progress=None) -> dict[str, str]:
    """{chunk id: id of the earlier chunk it nearly repeats} (word 3-gram Jaccard >= threshold). Earlier
    chunks win, so the result does not depend on timing.

    Prefix filtering (Bayardo et al., "Scaling up all pairs similarity search"): each chunk's shingles are
    ordered rarest first over the whole corpus; two sets with Jaccard >= t share a shingle among the first
    |S| - ceil(t * |S|) + 1 of each, so only those are indexed and probed. The rare shingles have short
    lists, so text full of common phrases (a repetitive manual) stays near linear instead of comparing every
    chunk with every other. A chunk is compared with its MAX_CANDIDATES earliest candidates at most (a bound
    for the pathological case; a near-duplicate is almost always among them). `stop()` is asked for every
    chunk (Stopped); on_progress(chunks done, chunks) is said at most every PROGRESS_EVERY_S seconds."""
    sets = []
    frequency: Counter = Counter()
    for n, chunk in enumerate(chunks):
        if n % 256 == 0 and stop():
            raise Stopped()
        sh = shingles(chunk.text)
        sets.append(sh)
        frequency.update(sh)
    kept: dict[int, set[int]] = {}
    index: dict[int, list[int]] = {}
    dupes: dict[str, str] = {}
    tick = _Every(on_progress, len(chunks))
    for n, (chunk, sh) in enumerate(zip(chunks, sets)):
        if stop():
            raise Stopped()
        tick(n)
        ordered = sorted(sh, key=lambda s: (frequency[s], s))
        prefix = ordered[:len(ordered) - math.ceil(threshold * len(ordered) - 1e-9) + 1]
        candidates: set[int] = set()
        for s in prefix:
            candidates.update(index.get(s, ()))
        hit = None
        for k in sorted(candidates)[:MAX_CANDIDATES]:
            other = kept[k]
            small, big = sorted((len(sh), len(other)))
            if big and small / big < threshold:
                continue
            if len(sh & other) / len(sh | other) >= threshold:
                hit = chunks[k].id
                break
        if hit is not None:
            dupes[chunk.id] = hit
            continue
        for s in prefix:
            index.setdefault(s, []).append(n)
        kept[n] = sh
    tick(len(chunks))
    return dupes


def split_documents(doc_ids: list[str], eval_ratio: float, seed: int) -> set[str]:
    """The held-out documents: a seeded shuffle of the ids, the first round(n * eval_ratio) (at least one
    when eval_ratio > 0 and there are two documents or more). Chunks follow their document."""

    ids = sorted(set(doc_ids))
    if eval_ratio <= 0 or len(ids) < 2:
        return set()
    random.Random(seed).shuffle(ids)
    n = min(len(ids) - 1, max(1, round(len(ids) * eval_ratio)))
    return set(ids[:n])
