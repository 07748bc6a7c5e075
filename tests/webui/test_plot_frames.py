"""The live view's plot frames: integer steps, values at a readable precision, series named in the page's
language, typed columns even when empty; the plots' axis titles come from the locale."""
import pytest

from webui import live
from webui.tabs import train as T


def test_loss_frame_has_integer_steps_and_four_significant_digits():
    recs = [{"step": 1.0, "loss": 2.779534123}, {"step": 2, "loss": 0.000123456789, "eval_loss": 1.23456}]
    df = live.loss_frame(recs)
    assert str(df["step"].dtype) == "int64" and str(df["value"].dtype) == "float64"
    assert list(df[df.series == "loss"].value) == [2.78, 0.0001235]
    assert list(df[df.series == "eval_loss"].value) == [1.235]
    lr = live.lr_frame([{"step": 3.0, "lr": 0.000199987}, {"step": 4}])
    assert str(lr["step"].dtype) == "int64" and list(lr["lr"]) == [0.0002] and list(lr["step"]) == [3]
    empty = live.lr_frame([])
    assert str(empty["step"].dtype) == "int64" and str(empty["lr"].dtype) == "float64"
    metric = live.metric_frame([{"step": 1, "rewards/margins": 0.123456}], ("rewards/margins",))
    assert list(metric.value) == [0.1235] and str(metric["step"].dtype) == "int64"


def test_loss_series_are_named_in_the_page_language():
    recs = [{"step": 1, "loss": 2.0, "eval_loss": 2.5}, {"step": 2, "loss": 1.0}]
    assert T.series_of(live.loss_frame(recs)) == ["loss", "smoothed", "eval_loss"]
    assert T.series_of(live.loss_frame(recs, lang="de")) == ["Verlust", "geglättet", "Eval-Verlust"]


@pytest.mark.parametrize("lang,step,loss", [("en", "step", "loss"), ("de", "Schritt", "Verlust")])
def test_plot_axis_titles_come_from_the_locale(lang, step, loss):
    loss_plot, lr_plot, *stage_plots = T.plot_axes_updates(lang)
    assert loss_plot["x_title"] == step and loss_plot["y_title"] == loss
    assert loss_plot["color_title"] == T.tr(lang, "plot.series_title") != T.tr("en" if lang != "en" else "de", "plot.series_title")
    assert lr_plot["x_title"] == step and lr_plot["y_title"] == T.tr(lang, "plot.lr")
    assert len(stage_plots) == len(live.plot_names())
    assert all(p["x_title"] == step and p["y_axis_format"] == ".4~g" and p["x_axis_format"] == "~r" for p in stage_plots)


def test_the_runs_overlay_names_its_series_in_the_page_language(tmp_path):
    from backend.core.rundir import LOG_FILE
    from webui.tabs import runs

    dirs = []
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        (run / LOG_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5, "eval_loss": 1.7}\n')
        dirs.append(str(run))
    german = T.series_of(runs.overlay_frame(dirs, root=tmp_path, lang="de"))
    english = T.series_of(runs.overlay_frame(dirs, root=tmp_path))
    assert len(german) == len(english) == 4  # loss and eval_loss of each run
    assert all(s.endswith(("Verlust", "Eval-Verlust")) for s in german), german
    assert not any("loss" in s for s in german) and all("loss" in s for s in english)
