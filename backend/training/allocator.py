"""The memory allocator of a training process (torch-free; `tuneboard train` calls relaunch() first thing).

A training step allocates and frees thousands of MB-sized activation tensors. glibc malloc either keeps the
freed blocks in its heap, where their holes are reused badly and never returned (fast, ~1 GB more RSS on the
bench recipe), or, with a fixed mmap threshold (backend.training.train.return_freed_memory), maps and unmaps each one
(lean, but every allocation page-faults: ~35% slower). jemalloc and tcmalloc keep size-class caches and give
idle pages back, so they get both. Measured on bench/recipe.yaml, 5 steps, one quiet run (bench/README.md):
glibc heap 161 tokens/s, 2,313 MiB; glibc 1 MiB threshold 106, 1,461; jemalloc 160, 1,386; tcmalloc 163,
1,410; the same losses in all four.

jemalloc's own default then gives idle pages back after ~10 s (its dirty/muzzy decay), and a step re-faults
them: with large micro-batches that costs most of the gain. The guide's packed recipe at 1 x 4096 tokens a
micro-batch: 94 useful tokens/s and 1,800 MiB peak with the default decay (glibc: 90, 1,823; a 30 s decay: 97),
179 tokens/s and 2,083 MiB with decay off; the bench recipe: 153-171 -> 175-185 tokens/s, 1,782 -> 1,885 MiB
(same losses). So jemalloc runs with freed pages kept for reuse (KEEP_FREED_PAGES) unless MALLOC_CONF is set.

So `tuneboard train` starts its training process (the same command line, as a child of a small supervising
parent: backend/core/supervise.py) with jemalloc (else tcmalloc) in LD_PRELOAD when the library is installed (Debian:
libjemalloc2 / libtcmalloc-minimal4; `make setup` installs libjemalloc2); the parent itself runs without it. A
library has to be preloaded before the process starts, so this cannot be a call inside the running process. Its
children (torchrun workers, tokenizer pools) inherit it. relaunch() re-executes the calling process instead.
TUNEBOARD_ALLOCATOR picks: auto (default), jemalloc, tcmalloc, or glibc (no preload: glibc with the fixed mmap
threshold).
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
import ctypes

ENV = "TUNEBOARD_ALLOCATOR"
LIBRARIES = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
CHOICES = ("auto", *LIBRARIES, "glibc")
KEEP_FREED_PAGES = "dirty_decay_ms:-1,muzzy_decay_ms:-1"  # jemalloc's MALLOC_CONF: never purge freed pages
_TRIED = "TUNEBOARD_ALLOCATOR_PRELOADED"  # set on the re-executed process: never re-execute twice


def _search_dirs() -> list[Path]:
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [f"/usr/lib/{arch}", f"/lib/{arch}", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    return [Path(d) for d in dirs if d and Path(d).is_dir()]


def find(name: str) -> Path | None:
    """The installed shared library of allocator `name` (jemalloc/tcmalloc), or None."""
    for folder in _search_dirs():
        path = folder / LIBRARIES[name]
        if path.is_file():
            return path
    return None


def choice() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def loaded() -> str | None:
    """The preloaded allocator this process runs with ('jemalloc'/'tcmalloc'), from its own memory map."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((name for name, lib in LIBRARIES.items() if lib in maps), None)


def preload_env() -> dict[str, str] | None:
    """The environment of a process started with the chosen allocator preloaded, or None when there is nothing
    to preload (already loaded, glibc asked, not Linux, library missing). An explicitly asked allocator that is
    missing is said on stderr; an unknown TUNEBOARD_ALLOCATOR raises ValueError."""
    if not sys.platform.startswith("linux") or loaded() or os.environ.get(_TRIED):
        return None
    wanted = choice()
    if wanted == "glibc":
        return None
    names = list(LIBRARIES) if wanted == "auto" else [wanted]
    found = next(((name, path) for name in names if (path := find(name))), None)
    if found is None:
        if wanted != "auto":
            print(f"warning: {ENV}={wanted}: {LIBRARIES[wanted]} is not installed (Debian: apt install "
                  f"{PACKAGES[wanted]}); training with glibc malloc", file=sys.stderr, flush=True)
        return None
    name, path = found
    preload = " ".join(x for x in (str(path), os.environ.get("LD_PRELOAD", "")) if x)
    env = dict(os.environ, LD_PRELOAD=preload, **{_TRIED: name})
    if name == "jemalloc" and "MALLOC_CONF" not in env:
        env["MALLOC_CONF"] = KEEP_FREED_PAGES
    return env


def relaunch() -> None:
    """Re-execute this process (the same interpreter and command line) with the chosen allocator preloaded;
    returns when there is nothing to do (see preload_env) or when the re-executed process runs without it.
    (`tuneboard train` starts its training process as a child with preload_env() instead: backend/core/supervise.py.)"""
    env = preload_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str:
    """For the run log: which allocator this process uses."""
    name = loaded()
    if name:
        decay = jemalloc_decay_ms() if name == "jemalloc" else None
        kept = ("" if decay is None else "; freed pages kept" if decay == -1
                else f"; freed pages returned after {decay} ms")
        return f"{name} (preloaded: {find(name) or LIBRARIES[name]}{kept})"
    tried = os.environ.get(_TRIED)
    note = f"; {tried} was preloaded but is not in this process" if tried else ""
    return f"glibc malloc{note}"


def jemalloc_decay_ms() -> int | None:
    """The running jemalloc's opt.dirty_decay_ms (-1: freed pages are never purged), read with its mallctl."""

    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    value, size = ctypes.c_ssize_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
    if mallctl(b"opt.dirty_decay_ms", ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return None
    return value.value
