"""PROCESS FIXTURE for tests/reliability/test_abort_phases.py -- the real `tuneboard train|export|eval`, with
one hook that holds the process INSIDE a named phase until the user's abort reaches it, so a test aborts
during that phase without racing it with sleeps:

    TUNEBOARD_TEST_HOLD_IN=<phase>   on entering the phase, write <TUNEBOARD_TEST_MARKERS>/in-<phase> and wait
                                     there until the abort arrives (the StopSwitch says so: the STOP file or
                                     SIGTERM; for export, SIGTERM raises), then go on with the phase as it was

phases: preprocess (tokenizing the training rows, or loading them from the tokenized cache), load (loading the model), train (the end of step 2),
save (inside the save of checkpoint-N, after the weights are written), export (writing the exported files),
predict (eval: the second row's generation).

usage: python phase_hooks.py train|export|eval SPEC.yaml [key=value ...]   (train runs supervised, as the real
`tuneboard train` does: a SIGTERM to this process reaches the training child through its parent)
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, wherever this is started from

from backend.core import supervise  # noqa: E402
from backend.cli import main  # noqa: E402

# `tuneboard train` trains in a child of a supervising parent that re-runs this script (backend/core/supervise.py): the
# hooks go into the child (and into export / eval), never into the parent, which only waits
PHASE = os.environ.get("TUNEBOARD_TEST_HOLD_IN", "") if sys.argv[1:2] != ["train"] or not supervise.available() else ""
MARKERS = Path(os.environ.get("TUNEBOARD_TEST_MARKERS", "."))
_switches = []  # the StopSwitch instances of this process (train and eval install one)


def hold(phase: str) -> None:
    if phase != PHASE:
        return
    (MARKERS / f"in-{phase}").write_text(f"{os.getpid()}\n")
    while not any(s.reason for s in _switches):  # an export's SIGTERM raises ExportAborted out of this sleep
        time.sleep(0.05)
    (MARKERS / f"abort-seen-in-{phase}").write_text("")


def wrap(module, name: str, phase: str, when=lambda *a, **k: True) -> None:
    original = getattr(module, name)

    def hooked(*args, **kwargs):
        if when(*args, **kwargs):
            hold(phase)
        return original(*args, **kwargs)

    setattr(module, name, hooked)


if PHASE:
    from backend.dataprep import preprocess, token_cache
    from backend.training import callbacks, models

    install = callbacks.StopSwitch.install

    def install_and_remember(self):
        _switches.append(self)
        return install(self)

    callbacks.StopSwitch.install = install_and_remember
    wrap(preprocess, "build_sft_dataset", "preprocess")
    wrap(token_cache, "load", "preprocess")  # the data step of a run whose tokens are cached: loading them
    wrap(models, "load_model", "load")
    wrap(callbacks.RunDirCallback, "on_step_end", "train", when=lambda self, a, state, c, **k: state.global_step == 2)
    if PHASE == "save":
        from transformers import Trainer

        wrap(Trainer, "_save_rng_state", "save")  # called after the weights and optimizer are written
    if PHASE == "export":
        from backend.exporting import export

        wrap(export, "_say", "export", when=lambda step, message: step == 5)  # the files are written to staging
    if PHASE == "predict":
        from backend.evaluation import predict as prediction  # eval and a stage's do_predict both call prediction.predict

        original_predict = prediction.predict

        def predict(model, tokenizer, template, examples, out_file, spec, progress=None, **kwargs):
            def progress_then_hold(n, total, row):
                if progress:
                    progress(n, total, row)
                if n == 1:  # the first row is written
                    hold("predict")
            return original_predict(model, tokenizer, template, examples, out_file, spec, progress_then_hold, **kwargs)

        prediction.predict = predict

sys.exit(main())  # this process's own command line: `train` is supervised, as the real `tuneboard train` is
