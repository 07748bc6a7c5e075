"""The Train tab's card while a run tokenizes: rows done of all, the time left, and a bar (status.json "tokenizing",
written by backend.core.rundir.RunDir.tokenizing_progress)."""
from webui import live

LOG = ["[15:00:01] stage sft, lora, model /models/tiny, output /s/run", "[15:00:30] template: chatml",
       "[15:00:31] dataset big (alpaca, big.jsonl): 1000000 rows, 1000000 kept"]


def _status(done, total=1_000_000, eta=120.0, phase="loading"):
    return {"state": "running", "phase": phase, "step": 0,
            "tokenizing": {"done": done, "total": total, "rows_per_s": 7000.0, "eta_s": eta}}


def test_the_card_shows_rows_tokenized_and_the_time_left():
    status = _status(120_000)
    assert live.phase(LOG, 20, "/models/tiny", status=status) == "tokenizing 120,000 / 1,000,000 rows, about 2:00 left"
    assert live.phase(LOG, 20, "", "de", status=status) == "120,000 / 1,000,000 Zeilen tokenisiert, noch etwa 2:00"
    assert live.phase(LOG, 20, "", status=_status(0, eta=None)) == "tokenizing 0 / 1,000,000 rows"
    share = live.tokenizing_share(status)
    assert share == 0.12
    card = live.progress_html(live.progress([], status), "running", "run", live.phase(LOG, 20, "", status=status),
                              phase_share=share)
    assert 'class="tb-bar tb-phase-bar" data-share="0.120"' in card and "width:12.0%" in card


def test_done_or_training_falls_back_to_what_the_run_does_next():
    done = _status(1_000_000, eta=0.0)
    assert live.tokenizing_share(done) is None
    assert live.phase(LOG, 20, "", status=done) == "tokenizing 1000000 rows"  # the log lines' phase, as before
    training = _status(500, phase="training")
    assert live.tokenizing_share(training) is None
    assert live.phase(LOG, 20, "", status=training) == "step 1 of 20 in progress"
    assert "tb-phase-bar" not in live.progress_html(live.progress([], done), "running", "run", "x", phase_share=None)
