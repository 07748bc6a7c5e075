"""webui.page_jobs: a tick holding a job the page no longer shows changes nothing, also when the Start that
replaced it is handled while the tick runs (Gradio runs two events' handlers side by side)."""
from __future__ import annotations

import gradio as gr

from webui import page_jobs


def test_a_start_handled_during_the_tick_makes_it_stale():
    page, other = gr.Request(session_hash="during-a"), gr.Request(session_hash="during-b")
    page_jobs.show("export", page, "/jobs/old")
    page_jobs.show("export", other, "/jobs/old")

    def poll(st):  # the tick's own work; a Start on the page is handled meanwhile
        page_jobs.show("export", page, "/jobs/new")
        return st, "ended"

    tick = page_jobs.ticking("export", poll, 2)
    assert all(isinstance(v, type(gr.skip())) for v in tick(page, {"job": "/jobs/old"}))
    assert tick(other, {"job": "/jobs/old"}) == ({"job": "/jobs/old"}, "ended")  # another page: its own job
    assert tick(page, {"job": "/jobs/new"}) == ({"job": "/jobs/new"}, "ended")
    # no session (not a browser): never stale
    assert tick(None, {"job": "/jobs/old"}) == ({"job": "/jobs/old"}, "ended")
    # an eval's state names its job by its parts' folder
    assert page_jobs.job_of({"parts": [{"dir": "/jobs/eval-1/tuned"}]}) == "/jobs/eval-1"
