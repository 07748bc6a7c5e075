"""Writing a file so that a reader never sees half of it, and reading a JSON file that may be missing or
half-written. The one home of both (issue 19 step 4): every atomic write in backend/ and webui/ goes through
write_text_atomic, every "JSON dict or {}" read through read_json_dict. Light (standard library only).

The fsync rule: always. The temp file (same folder) is flushed and fsynced before os.replace, so after a
crash the file holds either the old or the new whole content, never an empty one. A new file gets mode 0644,
a replaced one keeps its mode. On any failure (disk full, say) the temp file is removed and the old file
stays as it was."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str, *, mkdir: bool = True) -> None:
    """Write `text` (utf-8) to `path` atomically (temp file, fsync, os.replace), creating its folder unless
    mkdir=False (a run's status write must not bring back a run folder the user deleted)."""
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2, *, newline: bool = False,
                      mkdir: bool = True) -> None:
    """`data` as JSON (utf-8, not ASCII-escaped) through write_text_atomic."""
    write_text_atomic(path, json.dumps(data, indent=indent, ensure_ascii=False) + ("\n" if newline else ""),
                      mkdir=mkdir)


def read_json_dict(path: str | Path | None) -> dict:
    """The JSON object in `path`; {} when there is no path, the file is missing, unreadable, not JSON or not
    an object (a reader of a file written by write_text_atomic sees a whole file or none)."""
    if not path:
        return {}
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError covers JSONDecodeError and UnicodeDecodeError
        return {}
    return value if isinstance(value, dict) else {}


def fsync_dir(folder: str | Path) -> None:
    """Make the renames in `folder` durable (fsync of the folder itself; a no-op where that is refused)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_path(src: str | Path, dst: str | Path) -> None:
    """Move a whole file or folder over `dst` in one step (os.replace: same file system), the folder synced:
    a reader sees the old or the new one, never a mix (tuneboard promote moves weight files so)."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)
