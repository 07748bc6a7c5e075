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
import re
from dataclasses import dataclass
from pathlib import Path
import random

SUFFIXES = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf", ".jsonl")


class DocumentError(ValueError):
    """A document that cannot be read: one line naming the file (and row)."""


@dataclass
class Document:
    id: str      # the file path relative to the documents folder (plus ':<line>' for a JSONL row)
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
    """(file, the folder its id is relative to) for each document file, in a stable order."""
    out: list[tuple[Path, Path]] = []
    for item in [p.strip() for p in spec_documents.split(",") if p.strip()]:
        path = Path(item).expanduser().resolve()
        if path.is_dir():
            out += [(f, path) for f in sorted(path.rglob("*"))
                    if f.is_file() and f.suffix.lower() in SUFFIXES and not f.name.startswith(".")]
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise DocumentError(f"documents: {path.name}: unsupported file type (use {', '.join(SUFFIXES)})")
            out.append((path, path.parent))
        else:
            raise DocumentError(f"documents: {item} does not exist")
    return out


def load_documents(spec_documents: str, text_column: str = "text", warn=print) -> list[Document]:
    """Every document of the `documents` key, in a stable order. Empty documents are skipped with a warning;
    a JSONL line that is not JSON or lacks the text column is an error naming the file and line."""
    docs: list[Document] = []
    empty = []
    for path, root in _files(spec_documents):
        rel = str(path.relative_to(root))
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
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
            continue
        try:
            raw = path.read_text(encoding="utf-8", errors="replace") if suffix != ".pdf" else ""
        except OSError as exc:
            raise DocumentError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if suffix in (".html", ".htm"):
            text = html_to_text(raw)
        elif suffix == ".pdf":
            text = pdf_to_text(path)
        else:
            text = raw
        text = (text or "").strip()
        (docs.append(Document(rel, text)) if text else empty.append(rel))
    if empty:
        warn(f"{len(empty)} empty document(s) skipped: {', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}")
    if not docs:
        raise DocumentError(f"documents: no document with text in {spec_documents} (supported: {', '.join(SUFFIXES)})")
    return docs


def chunk_text(text: str, tokenizer, chunk_tokens: int, overlap: int) -> list[tuple[str, int]]:
    """(chunk text, tokens) windows of a document: `chunk_tokens` tokens each, `overlap` shared."""
    if overlap >= chunk_tokens:
        overlap = chunk_tokens // 4
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc.get("offset_mapping")
    if len(ids) <= chunk_tokens:
        return [(text, len(ids))]
    step, out = chunk_tokens - overlap, []
    for start in range(0, len(ids), step):
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


def chunk_documents(docs: list[Document], tokenizer, chunk_tokens: int, overlap: int) -> list[Chunk]:
    chunks = []
    for doc in docs:
        for i, (text, n) in enumerate(chunk_text(doc.text, tokenizer, chunk_tokens, overlap)):
            chunks.append(Chunk(f"{doc.id}#{i}", doc.id, i, text, n))
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


def near_duplicates(chunks: list[Chunk], threshold: float) -> dict[str, str]:
    """{chunk id: id of the earlier chunk it nearly repeats} (word 3-gram Jaccard >= threshold). Earlier
    chunks win, so the result does not depend on timing. Pairs are compared only when their sizes allow
    the threshold (|A|/|B| >= threshold) and they share a shingle (an inverted index), which keeps the
    usual corpus of mostly distinct chunks near linear."""
    kept: list[tuple[str, set[int]]] = []
    index: dict[int, list[int]] = {}
    dupes: dict[str, str] = {}
    for chunk in chunks:
        sh = shingles(chunk.text)
        candidates: set[int] = set()
        for s in sh:
            candidates.update(index.get(s, ()))
        hit = None
        for k in sorted(candidates):
            other_id, other = kept[k]
            small, big = sorted((len(sh), len(other)))
            if big and small / big < threshold:
                continue
            if len(sh & other) / len(sh | other) >= threshold:
                hit = other_id
                break
        if hit is not None:
            dupes[chunk.id] = hit
            continue
        for s in sh:
            index.setdefault(s, []).append(len(kept))
        kept.append((chunk.id, sh))
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
