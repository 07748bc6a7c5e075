"""Calling the UI's event handlers directly, as Gradio would: find one by its function's name in a built app and
fill its inputs (the form's widgets at their defaults, some set by elem_id)."""
from __future__ import annotations


def handler(demo, name):
    return next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == name)


def form_args(fn, **values) -> list:
    """The handler's inputs at their defaults, with `values` by elem_id suffix (top-... or train-...)."""
    args = [getattr(c, "value", None) for c in fn.inputs]
    for i, comp in enumerate(fn.inputs):
        key = (getattr(comp, "elem_id", None) or "").split("-", 1)[-1]
        if key in values:
            args[i] = values[key]
    return args


def stand_in_launches(monkeypatch) -> list:
    """webui.jobs.launch made to start a harmless process instead of `tuneboard train`; returns the list that each
    launch's run folder is appended to (what Start launched, in order)."""
    import sys

    from webui import jobs

    launched, real_launch = [], jobs.launch

    def launch(run_dir, argv, env=None):
        launched.append(run_dir)
        return real_launch(run_dir, [sys.executable, "-c", "pass"], env=env)

    monkeypatch.setattr(jobs, "launch", launch)
    return launched
