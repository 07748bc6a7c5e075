"""The allowed roots of a web UI under test (backend/core/allowed.py): its own saves and cache folders, and folders
added the way `tuneboard webui --allow-path` adds them; the UI's code policy back to its default (off)."""
from __future__ import annotations

import contextlib

import pytest

from backend.core import allowed


@contextlib.contextmanager
def ui_roots(base, names=("saves", "extra", "cache"), added=("extra",)):
    """Makes base/<name> for each name; yields {name: folder}. `added`: the ones given as --allow-path."""
    dirs = {name: base / name for name in names}
    for d in dirs.values():
        d.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TUNEBOARD_SAVES", str(dirs["saves"]))
        mp.setenv("TUNEBOARD_CACHE", str(dirs["cache"]))
        mp.delenv(allowed.ENV, raising=False)
        mp.delenv(allowed.CODE_ENV, raising=False)
        allowed.add_roots([str(dirs[name]) for name in added])
        yield dirs
