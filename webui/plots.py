"""Plot helpers shared by the tabs that draw long-format line plots (Train, Runs)."""
from __future__ import annotations

import gradio as gr
import pandas as pd

from webui.i18n import tr


def empty_loss() -> pd.DataFrame:
    return pd.DataFrame({"step": pd.Series(dtype="int64"), "value": pd.Series(dtype="float64"),
                         "series": pd.Series(dtype="str")})


def empty_lr() -> pd.DataFrame:
    return pd.DataFrame({"step": pd.Series(dtype="int64"), "lr": pd.Series(dtype="float64")})


def series_of(frame) -> list[str]:
    """The series names of a long-format plot frame, in order of first appearance."""
    return list(dict.fromkeys(frame["series"])) if len(frame) else []


def legend_update(series: list[str]):
    """Re-colour a `color=` LinePlot for this set of series. Gradio 6's LinePlot fixes its colour domain
    (the series names) when it builds its chart and afterwards only swaps the data: a series that was
    not in the first frame (every series, when the plot starts empty) is drawn with no stroke, i.e. its
    line is invisible and only the invisible hover points exist. Changing `colors_in_legend` makes it
    rebuild the chart. It must come in a separate event after the data: the rebuild reads the data the
    plot held before the update that triggers it."""
    return gr.update(colors_in_legend=series)


# The y axis title of each plot of the live view: the loss and lr plots by their own key, a stage plot (its name in
# backend/stages) by the generic "value" (its label above it names what it draws)
Y_TITLES = {"loss_plot": "plot.loss", "lr_plot": "plot.lr"}


def plot_axes(plot: str, lang: str = "en") -> dict:
    """A live-view plot's axis and legend titles in `lang` and its tick formats: y ticks with 4 significant digits at most
    (2.78, 0.0002, 1.5e-5) and steps without trailing zeros (1, not 1.000000: Vega's own format when the
    plot holds a single step), not Vega's full precision."""
    return {"x_title": tr(lang, "plot.step"), "y_title": tr(lang, Y_TITLES.get(plot, "plot.value")),
            "color_title": tr(lang, "plot.series_title"), "y_axis_format": ".4~g", "x_axis_format": "~r"}
