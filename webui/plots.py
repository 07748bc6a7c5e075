"""Plot helpers shared by the tabs that draw long-format line plots (Train, Runs)."""
from __future__ import annotations

import gradio as gr
import pandas as pd


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

