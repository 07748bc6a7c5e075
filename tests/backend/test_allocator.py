"""backend/training/allocator.py: `tuneboard train` re-executes itself once with jemalloc (else tcmalloc) preloaded when
installed, logs which allocator it runs with, and TUNEBOARD_ALLOCATOR picks or refuses. Real processes: the
allocator is read from the process's own memory map."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backend.training import allocator

REPO = Path(__file__).resolve().parents[2]
INSTALLED = [name for name in allocator.LIBRARIES if allocator.find(name)]
needs_one = pytest.mark.skipif(not INSTALLED, reason="neither libjemalloc2 nor libtcmalloc-minimal4 is installed")

# relaunch() re-executes `python -c SCRIPT`: the second process prints what it runs with
SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    from backend.training import allocator
    print("pid", os.getpid(), flush=True)
    allocator.relaunch()
    print("loaded", allocator.loaded(), "|", allocator.describe(), flush=True)
""").format(repo=str(REPO))


def _run(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", allocator.ENV, "TUNEBOARD_ALLOCATOR_PRELOADED", "MALLOC_CONF")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


@needs_one
def test_auto_preloads_the_first_installed_allocator_once():
    out = _run()
    assert f"loaded {INSTALLED[0]} |" in out, out
    pids = {line.split()[1] for line in out.splitlines() if line.startswith("pid")}
    assert len(pids) == 1 and out.count("pid") == 2, out  # execve: the same process, started once more


@needs_one
@pytest.mark.parametrize("name", list(allocator.LIBRARIES))
def test_a_named_allocator_is_used_or_its_absence_said(name):
    out = _run(**{allocator.ENV: name})
    if allocator.find(name):
        assert f"loaded {name} |" in out, out
    else:
        assert "loaded None" in out and allocator.PACKAGES[name] in out, out


@pytest.mark.skipif(not allocator.find("jemalloc"), reason="libjemalloc2 is not installed")
def test_jemalloc_keeps_freed_pages_unless_malloc_conf_says_otherwise():
    """Freed pages stay for reuse (jemalloc's decay would give them back and a step would re-fault them: 1.9x
    slower at 4096-token micro-batches); the value is read back from the running jemalloc. A MALLOC_CONF of the
    user's own wins."""
    assert "loaded jemalloc |" in (out := _run(**{allocator.ENV: "jemalloc"})) and "freed pages kept" in out, out
    out = _run(**{allocator.ENV: "jemalloc", "MALLOC_CONF": "dirty_decay_ms:4321"})
    assert "freed pages returned after 4321 ms" in out, out


def test_glibc_means_no_preload():
    out = _run(**{allocator.ENV: "glibc"})
    assert "loaded None | glibc malloc" in out and out.count("pid") == 1, out


def test_an_unknown_allocator_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "train", "examples/sft_lora_identity.yaml",
                           f"output_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, allocator.ENV: "mimalloc"})
    assert proc.returncode == 2 and "TUNEBOARD_ALLOCATOR='mimalloc'" in proc.stderr and "jemalloc" in proc.stderr
    assert not (tmp_path / "run").exists()
