"""Issue 24 (items 1, 2, 4), a new user on the Train tab: Abort of a queued run gives the view back to the run
that still trains (not "unknown" and an empty plot); "Measure memory" beside a training run says so and waits for
it instead of competing with it for the cores; the progress card shows the phase the trainer process writes
(loading, step N of M in progress, saving) instead of "running step 1" from the moment the model is loaded.

The *other* run here is tests/webui/process_fixture_trainer.py (a real process that writes status.json like a
trainer); what is under test is the Train tab's handlers and webui.live."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ui_handlers import form_args, handler
from waiting import wait_for
from webui import jobs, live, preflight, tools
from webui.tabs import train as train_tab

FIXTURE = str(Path(__file__).with_name("process_fixture_trainer.py"))


@pytest.fixture(scope="module")
def demo():
    from webui.app import create_app

    return create_app()


@pytest.fixture
def busy_run(root):
    """A run that trains (the process fixture, running until stopped) in the UI's saves folder."""
    run_dir = root / "tiny" / "lora" / "busy"
    spec = jobs.write_spec_yaml(run_dir, f"output_dir: {run_dir}\nmax_steps: 3000\n")
    jobs.launch(run_dir, [sys.executable, FIXTURE, str(spec), "steps=3000", "step_s=0.1"])
    wait_for(lambda: jobs.run_state(run_dir).state == "running" and (run_dir / "trainer_log.jsonl").exists()
             and (run_dir / "trainer_log.jsonl").stat().st_size > 0, timeout=30, what="the fixture run's first step")
    yield run_dir
    jobs.abort(run_dir, term_after_s=1, kill_after_s=2, wait=True)


# ------------------------------------------------------------------ item 1: Abort of a queued run

def test_abort_of_a_queued_run_shows_the_run_that_still_trains(demo, root, busy_run):
    queued = root / "tiny" / "lora" / "queued"
    jobs.JobQueue().enqueue(f"output_dir: {queued}\nmax_steps: 5\n", queued)
    st = train_tab.attach(str(queued))  # what Start attached: the queued run
    out = handler(demo, "do_abort").fn(st, False, "en")
    assert [e for e in jobs.JobQueue().entries() if e.run_dir == str(queued)] == []  # taken off the queue
    view_state, card, message = out[0], out[1], out[-2]
    assert view_state["run_dir"] == str(busy_run)
    assert 'data-state="running"' in card and "tiny/lora/busy" in card and "unknown" not in card
    assert "Removed `tiny/lora/queued`" in message and "Showing `tiny/lora/busy`" in message
    assert out[-1].active  # the timer keeps following the running run
    assert list(out[2]["step"]), "the loss plot is drawn from the running run's log"


def test_a_tick_attached_to_a_run_removed_elsewhere_follows_the_run_that_trains(root, busy_run):
    st = train_tab.attach(str(root / "tiny" / "lora" / "removed-in-another-tab"))
    view = train_tab.view_updates(st, False)
    assert st["run_dir"] == str(busy_run)  # changed in place: a tick never writes the state back
    assert "tiny/lora/busy" in view[1] and 'data-state="running"' in view[1]
    idle = train_tab.attach(str(root / "gone"))
    jobs.abort(busy_run, term_after_s=1, kill_after_s=2, wait=True)
    wait_for(lambda: not jobs.run_state(busy_run).active, timeout=30, what="the fixture run to end")
    view = train_tab.view_updates(idle, False)
    assert idle["run_dir"] is None and 'data-state="idle"' in view[1]  # nothing trains: the idle card


def test_a_queued_run_being_launched_is_not_taken_for_a_removed_one(root):
    """The launch claims the queue entry (a rename) before it makes the run's folder: in between the run is
    neither queued nor on disk, and must not be dropped by a tick."""
    target = root / "tiny" / "lora" / "launching"
    entry = jobs.JobQueue().enqueue(f"output_dir: {target}\n", target)
    assert not train_tab.gone(str(target))
    Path(entry.path).rename(Path(entry.path).with_suffix(".claimed"))
    assert not target.exists() and not train_tab.gone(str(target))
    Path(entry.path).with_suffix(".claimed").unlink()
    assert train_tab.gone(str(target))


# ------------------------------------------------------------------ item 2: Measure memory beside a training run

def _probe_jobs(root: Path) -> list[Path]:
    return sorted((root / ".tools").glob("probe-*")) if (root / ".tools").is_dir() else []


def test_measure_beside_a_training_run_says_so_and_waits_for_it(demo, root, busy_run, tiny_llama, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("TUNEBOARD_CACHE", str(tmp_path / "cache"))
    measure, tick, stop = (handler(demo, n) for n in ("do_measure", "probe_tick", "do_measure_abort"))
    args = form_args(measure, model_name_or_path=str(tiny_llama), template="llama3", dataset="identity",
                     cutoff_len=128, per_device_train_batch_size=2, max_steps=5)
    args[0] = {}
    pst, view, timer = measure.fn(*args)
    assert "job" not in pst and pst.get("waiting"), view  # nothing started beside the run
    assert "<b>tiny/lora/busy</b> is training now" in view and "CPU cores" in view and "Measure memory" in view
    assert timer.active and _probe_jobs(root) == []
    view, timer = tick.fn(pst, "en")  # still training: still waiting, still saying why
    assert "is training now" in view and timer.active and "job" not in pst
    pst, view, timer = stop.fn(pst, "en")  # cancelled while it waits
    assert pst == {} and view == "Measurement stopped." and not timer.active and _probe_jobs(root) == []

    # pressed twice: started now anyway (the user chose to)
    args[0] = measure.fn(*args)[0]
    pst, view, timer = measure.fn(*args)
    assert pst.get("job") and len(_probe_jobs(root)) == 1, view
    assert "Measuring" in view
    stop.fn(pst, "en")
    wait_for(lambda: not tools.alive(pst["job"]), timeout=30, what="the probe to stop")

    # waiting, then the run ends: the next tick starts the measurement
    args[0] = {}
    pst, view, timer = measure.fn(*args)
    assert pst.get("waiting")
    jobs.abort(busy_run, term_after_s=1, kill_after_s=2, wait=True)
    wait_for(lambda: not jobs.run_state(busy_run).active, timeout=30, what="the fixture run to end")
    view, timer = tick.fn(pst, "en")
    assert pst.get("job") and "waiting" not in pst and timer.active, view  # started by the tick, in place
    assert len(_probe_jobs(root)) == 2 and "Measuring" in view
    _, view, _ = stop.fn(pst, "en")
    assert view == "Measurement stopped."
    wait_for(lambda: not tools.alive(pst["job"]), timeout=30, what="the probe to stop")


def test_measure_with_no_training_run_starts_at_once(demo, root, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_CACHE", str(tmp_path / "cache"))
    measure, stop = handler(demo, "do_measure"), handler(demo, "do_measure_abort")
    args = form_args(measure, model_name_or_path=str(tiny_llama), template="llama3", dataset="identity",
                     cutoff_len=128, per_device_train_batch_size=2, max_steps=5)
    args[0] = {}
    pst, view, timer = measure.fn(*args)
    assert pst.get("job") and "waiting" not in pst and timer.active, view
    stop.fn(pst, "en")
    wait_for(lambda: not tools.alive(pst["job"]), timeout=30, what="the probe to stop")


# ------------------------------------------------------------------ item 4: the phase the trainer is in

LOG = ["[15:00:01] stage sft, lora, model /models/tiny, output /s/run",
       "[15:00:01] memory allocator: jemalloc",
       "[15:00:30] template: llama3",
       "[15:00:31] dataset identity (alpaca, identity.json): 91 rows, 80 kept",
       "[15:00:32] train rows: 80 rows",
       "[15:00:33] model: LlamaForCausalLM",
       "[15:00:40] trainable parameters: 1,000 of 135,000 (0.7%)"]


def test_the_card_shows_the_phase_the_trainer_wrote_not_step_1_once_the_model_is_loaded():
    loading = {"state": "running", "phase": "loading", "step": 0}
    assert live.phase(LOG[:1], 20, "/models/tiny", status=loading) == "loading the tokenizer"
    assert live.phase(LOG[:4], 20, "/models/tiny", status=loading) == "tokenizing 80 rows"
    assert live.phase(LOG[:6], 20, "/models/tiny", status=loading) == "adding the adapter"
    # the model is ready, the Trainer is being built: no step runs yet, and the card does not say one does
    shown = live.phase(LOG, 20, "/models/tiny", status=loading)
    assert shown.startswith("preparing the trainer") and "step" not in shown
    # the trainer began its first step (on_train_begin wrote the phase), then step 3 is done
    assert live.phase(LOG, 20, "", status={"phase": "training", "step": 0}) == "step 1 of 20 in progress"
    assert live.phase(LOG, 20, "", status={"phase": "training", "step": 3}) == "step 4 of 20 in progress"
    assert live.phase(LOG, None, "", status={"phase": "training", "step": 0}) == "step 1 in progress"
    assert live.phase(LOG, 20, "", status={"phase": "saving", "step": 20}).startswith("saving the model")
    assert live.phase(LOG, 20, "", "de", status={"phase": "training", "step": 0}) == "Schritt 1 von 20 läuft"
    # a status from before phases (or a distill step name): the log lines decide, as before
    assert live.phase(LOG[:4], 20, "", status={"phase": "generate"}) == "tokenizing 80 rows"


def test_a_probe_in_progress_shows_its_phase_and_the_time_left(tmp_path):
    """While measuring: elapsed (as before), what the probe's training child is doing and, after its first step,
    about how long its remaining steps take."""
    import json

    job, child = tmp_path / "probe-job", tmp_path / "cache" / "probe" / "1-x" / "run"
    job.mkdir()
    assert preflight.probe_progress_md(job) == ""  # the probe has not said where its child runs
    (job / jobs.PROCESS_LOG).write_text(f"probe: 2 steps of the spec, longest rows first, in {child}\n")
    assert preflight.probe_progress_md(job) == ""  # nor made its folder yet
    child.mkdir(parents=True)
    assert preflight.probe_progress_md(job) == " — now: starting: loading the training libraries"
    (child / "status.json").write_text(json.dumps({"state": "running", "phase": "loading", "step": 0}))
    (child / "running_log.txt").write_text("\n".join(LOG[:4]) + "\n")
    assert preflight.probe_progress_md(job) == " — now: tokenizing 80 rows"
    (child / "status.json").write_text(json.dumps({"state": "running", "phase": "training", "step": 1,
                                                   "total_steps": 2}))
    (child / "trainer_log.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "elapsed_s": 40.0}) + "\n")
    assert preflight.probe_progress_md(job) == " — now: step 2 of 2 in progress; about 40 s to go"
