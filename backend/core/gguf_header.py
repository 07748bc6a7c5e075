"""Is a .gguf file whole? Its header read and its tensor data measured against the file size (issue 25, item 6).

`tuneboard validate` said ok for the first 2 MB of a 93 MB GGUF: only its magic was checked. Here the whole
header is walked (version, key/value pairs, tensor infos, alignment) and the end of the last tensor's data
computed from each tensor's shape and type; a file shorter than that is truncated, one whose header cannot be
read is not a GGUF file. The gguf package's own GGUFReader does the same walk, but it builds every value
(a tokenizer's 49,152 strings one by one: 13 s for the default model on a loaded 2-core machine), so this
reads the header with struct and skips the values, taking only the type sizes from the gguf package
(GGML_QUANT_SIZES: block size and bytes per block of each tensor type). Light: no torch, no numpy at import.
"""
from __future__ import annotations

import struct
from pathlib import Path

MAGIC = b"GGUF"
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
STRING, ARRAY = 8, 9
ALIGNMENT_KEY = "general.alignment"
MAX_COUNT = 1 << 24  # no real file has more tensors, keys or array items: a larger count is a broken header


class _Broken(ValueError):
    pass


class _Reader:
    def __init__(self, fh, size: int):
        self.fh, self.size = fh, size

    def take(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise _Broken(f"ends inside its header (at byte {self.fh.tell()} of {self.size})")
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def count(self, what: str) -> int:
        n = self.u64()
        if n > MAX_COUNT:
            raise _Broken(f"its header says {n} {what}")
        return n

    def string(self) -> str:
        n = self.u64()
        if n > self.size:
            raise _Broken(f"its header has a string of {n} bytes in a file of {self.size}")
        return self.take(n).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR:
            self.take(_SCALAR[kind])
        elif kind == STRING:
            self.string()
        elif kind == ARRAY:
            item, n = self.u32(), self.count("array items")
            if item in _SCALAR:
                self.take(_SCALAR[item] * n)
            else:
                for _ in range(n):
                    self.skip_value(item)
        else:
            raise _Broken(f"its header has a value of unknown type {kind}")


def data_end(path: Path) -> int:
    """The byte where the last tensor's data ends, read from the header (ValueError when it cannot be read)."""
    from gguf.constants import GGML_QUANT_SIZES  # the type table only (0.6 s import), only when a .gguf is checked

    size = path.stat().st_size
    with path.open("rb") as fh:
        r = _Reader(fh, size)
        if r.take(4) != MAGIC:
            raise _Broken("it does not start with 'GGUF'")
        version = r.u32()
        if version not in (2, 3):
            raise _Broken(f"GGUF version {version} is not one this reader knows (2, 3)")
        n_tensors, n_kv = r.count("tensors"), r.count("key/value pairs")
        alignment = 32
        for _ in range(n_kv):
            key, kind = r.string(), r.u32()
            if key == ALIGNMENT_KEY and kind == 4:
                alignment = r.u32() or 32
            else:
                r.skip_value(kind)
        end = 0
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.u64() for _ in range(r.u32())]
            kind, offset = r.u32(), r.u64()
            if kind not in GGML_QUANT_SIZES:
                raise _Broken(f"tensor {name} has unknown type {kind}")
            block, block_bytes = GGML_QUANT_SIZES[kind]
            elements = 1
            for d in dims:
                elements *= d
            end = max(end, offset + elements // block * block_bytes)
        start = -(-fh.tell() // alignment) * alignment
    return start + end


def problem(path: Path) -> str | None:
    """What is wrong with a .gguf file (not one, or cut short), or None when its tensor data fits the file."""
    try:
        end, size = data_end(path), path.stat().st_size
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    except (ValueError, struct.error) as exc:
        return f"{path} is not a whole GGUF file: {exc}"
    if end > size:
        return f"{path} is truncated: {size} bytes, its header describes {end}"
    return None
