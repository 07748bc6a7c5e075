"""PROCESS FIXTURE for tests/reliability -- the real `tuneboard train`, with one test hook on the step
callback, so a test acts at an exact step instead of racing the trainer with sleeps:

    TUNEBOARD_TEST_STOP_AT=N    write the run's STOP file at the end of step N (the real stop switch then
                                stops the run at that step, with its checkpoint, as an Abort from the UI does)
    TUNEBOARD_TEST_PAUSE_AT=N   at the end of step N (status.json says step N), write <output_dir>/paused-at-N
                                and wait there, so the test can kill the process mid-training
    TUNEBOARD_TEST_PAUSE_IN_SAVE=N  inside the save of checkpoint-N, after the weights and optimizer are
                                written and before the RNG and trainer state, write <output_dir>/paused-saving-N
                                and wait there (a kill during a checkpoint save)

usage: python train_with_hooks.py [SPEC.yaml] [key=value ...]    (the arguments of `tuneboard train`; it runs
supervised, as the real `tuneboard train` does: the hooks act in the training child)
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, wherever this is started from

from backend.core import supervise  # noqa: E402
from backend.cli import main  # noqa: E402

# `tuneboard train` trains in a child of a supervising parent that re-runs this script (backend/core/supervise.py): the
# hooks go into the child, never into the parent, which only waits
if supervise.available():
    sys.argv[1:1] = ["train"]
    sys.exit(main())

from backend.training import callbacks  # noqa: E402
from backend.core.rundir import STOP_FILE  # noqa: E402

_original = callbacks.RunDirCallback.on_step_end


def on_step_end(self, args, state, control, **kwargs):
    step = str(state.global_step)
    if step == os.environ.get("TUNEBOARD_TEST_STOP_AT"):
        (self.run_dir.path / STOP_FILE).write_text("stop requested by the test\n")
    result = _original(self, args, state, control, **kwargs)
    if step == os.environ.get("TUNEBOARD_TEST_PAUSE_AT"):
        (self.run_dir.path / f"paused-at-{step}").write_text("")
        time.sleep(3600)
    return result


callbacks.RunDirCallback.on_step_end = on_step_end


def pause_in_save(original):
    def _save_rng_state(self, output_dir):
        step = str(self.state.global_step)
        if step == os.environ.get("TUNEBOARD_TEST_PAUSE_IN_SAVE"):
            (Path(self.args.output_dir) / f"paused-saving-{step}").write_text("")
            time.sleep(3600)
        return original(self, output_dir)
    return _save_rng_state


if os.environ.get("TUNEBOARD_TEST_PAUSE_IN_SAVE"):
    from transformers import Trainer

    Trainer._save_rng_state = pause_in_save(Trainer._save_rng_state)
sys.exit(main(["train", *sys.argv[1:]]))
