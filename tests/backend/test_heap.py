"""The training process's memory: backend.training.train.return_freed_memory (with it, big freed blocks go back to
the OS (glibc), so a training step's peak RSS is its live tensors, not the heap's high-water mark) and
leave_out_bitsandbytes. Measured in fresh subprocesses (the settings are process-wide)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Allocate and free MiB-sized blocks the way a step does: the first (16 MiB) one freed raises glibc's dynamic
# mmap threshold to 16 MiB, so the later 8 MiB ones come from the heap; small live objects (> 512 bytes: malloc,
# not Python's small-object arenas) above them pin the top of the heap, and freeing the blocks below gives
# nothing back unless each was mapped on its own.
SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from backend.training.train import return_freed_memory
    if sys.argv[1] == "on":
        print("threshold", return_freed_memory())
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    block = 8 << 20
    first = b"x" * (2 * block)
    del first
    before = rss()
    blocks = [b"y" * block for _ in range(16)]  # 128 MiB live
    pin = [b"z" * 1000 + bytes([i % 256]) for i in range(1000)]
    del blocks
    print("kept", rss() - before)
""")


def _kept_mib(mode: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=str(REPO)), mode], capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    kept = int(out.split("kept")[1].split()[0])
    return kept, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_freed_blocks_go_back_to_the_os():
    kept_on, out_on = _kept_mib("on")
    if "threshold None" in out_on:
        pytest.skip("not glibc: return_freed_memory does not apply")
    assert "threshold 1048576" in out_on
    assert kept_on < 32, out_on  # the 128 MiB freed went back
    kept_off, out_off = _kept_mib("off")
    # the control shows what the setting is for: glibc's default keeps the freed heap blocks mapped
    assert kept_off > 96, out_off


def test_threshold_can_be_turned_off(monkeypatch):
    from backend.training.train import return_freed_memory

    monkeypatch.setenv("TUNEBOARD_MMAP_THRESHOLD", "0")
    assert return_freed_memory() is None


LEAVE_OUT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from backend.core.spec import load_spec
    from backend.training.train import leave_out_bitsandbytes
    left_out = leave_out_bitsandbytes(load_spec(None, sys.argv[1:]))
    import peft  # imports bitsandbytes at its own import when it can
    from peft.import_utils import is_bnb_available
    from transformers.utils import is_bitsandbytes_available
    print(json.dumps([left_out, "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is not None,
                      is_bnb_available(), is_bitsandbytes_available()]))
""")


@pytest.mark.parametrize("overrides, kept", [
    ([], False),
    (["finetuning_type=full", "optim=adamw_torch_fused"], False),
    (["quantization_bit=4"], True),
    (["optim=paged_adamw_8bit"], True),
    (["finetuning_type=full", "use_galore=true", "optim=adamw_torch"], True),
    (["model_name_or_path=someorg/some-model-bnb-4bit"], True),  # a hub id may be saved quantized: not read here
])
def test_bitsandbytes_is_loaded_only_by_runs_that_use_it(overrides, kept, hub_cache):
    """peft (before 0.22) imports bitsandbytes whenever it is installed (~50 MiB of a run's peak RSS); a training process leaves
    it out unless the spec uses it (QLoRA, its optimizers, GaLore) or names a model it cannot tell loads without it,
    and then transformers and peft see it absent."""
    pytest.importorskip("bitsandbytes")
    for model in [o.partition("=")[2] for o in overrides if o.startswith("model_name_or_path=")]:
        hub_cache(model)  # a hub id validates when it is in the (test's own) Hugging Face cache
    out = subprocess.run([sys.executable, "-c", LEAVE_OUT.format(repo=str(REPO)), *overrides],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    left_out, loaded, peft_sees, transformers_sees = json.loads(out.stdout.strip().splitlines()[-1])
    assert left_out is (not kept)
    assert peft_sees is kept and transformers_sees is kept
    assert not loaded if not kept else True  # peft 0.22 imports it only when used: "kept" means it still can
