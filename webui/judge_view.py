"""The Evaluate tab's judge mode (issue 20 item 5): the judge_* spec keys from the tab's inputs, the UI's checks
of the judge endpoint (backend.core.teacher_access: an offered key for its own base URL, no internal address unless
the operator allowed it), and what the eval's judge_results.json shows: win / tie / loss with the interval, and
one line per row with both answers and the judge's reasons in both orders. Light: no torch."""
from __future__ import annotations

import gradio as gr
import pandas as pd

from backend.core import teacher_access
from backend.core.atomic import read_json_dict
from backend.core.rundir import JUDGE_FILE
from webui.i18n import refusal, tr

ROW_COLUMNS = ["#", "question", "tuned", "other", "verdict", "reason (tuned first)", "reason (tuned second)"]
REASON_CHARS = 300


def judge_flat(enabled, url, model, key_env, key_file, max_requests, reference) -> dict:
    """The spec keys of a judge eval ({} when the mode is off): the predict part (the tuned answers, scored
    against the references: the tab's rows and metrics) and the judge, which compares those answers with the
    base model's or the rows' reference answers; no loss pass."""
    if not enabled:
        return {}
    return {"do_judge": True, "do_eval": False, "do_predict": True,
            "judge_url": (url or "").strip() or None, "judge_model": (model or "").strip() or None,
            "judge_api_key_env": (key_env or "").strip() or None,
            "judge_api_key_file": (key_file or "").strip() or None,
            "judge_max_requests": int(max_requests) if max_requests not in (None, "") else 0,
            "judge_against": "reference" if reference else "base"}


def refusals(flat: dict, lang: str = "en") -> str:
    """'' when the UI may let the eval ask this judge; else one ✖ line per refusal, naming the field."""
    url = flat.get("judge_url")
    if not url:
        return ""
    refused = teacher_access.endpoint_refusals(url, flat.get("judge_api_key_env"), flat.get("judge_api_key_file"),
                                               "judge", url_field="judge_url")
    return "  \n".join(refusal(lang, exc) for exc in refused)


def read_report(part_dir: str | None) -> dict:
    return read_json_dict(f"{part_dir}/{JUDGE_FILE}") if part_dir else {}


def summary_md(report: dict, lang: str = "en") -> str:
    """Who judged what, W / T / L of the rows judged, the win rate with its 95% interval, the requests, and
    why the report is incomplete when it is."""
    if not report:
        return ""
    other = tr(lang, "eval.judge_other_reference" if report.get("against") == "reference" else "eval.judge_other_base")
    text = tr(lang, "eval.judge_head", model=report.get("judge_model"), url=report.get("judge_url"), other=other)
    if report.get("judged") and report.get("win_rate") is None:  # too few verdicts to score (judge.summarize)
        text += "  \n✖ " + str(report.get("no_score") or "")
    elif report.get("judged"):
        low, high = report.get("interval") or (None, None)
        text += "  \n" + tr(lang, "eval.judge_counts", wins=report.get("wins"), ties=report.get("ties"),
                            losses=report.get("losses"), n=report.get("judged"), rate=f"{report['win_rate']:.3f}",
                            low=f"{low:.3f}", high=f"{high:.3f}")
    text += "  \n" + tr(lang, "eval.judge_requests", requests=report.get("requests", 0), cached=report.get("cached", 0),
                        unparsed=report.get("unparsed", 0))
    if not report.get("complete"):
        text += "  \n" + tr(lang, "eval.judge_incomplete", judged=report.get("judged", 0), rows=report.get("rows", 0),
                            why=report.get("stopped") or "")
    return text


def _reason(row: dict, order: str) -> str:
    for o in row.get("orders") or []:
        if o.get("order") == order:
            text = str(o.get("reason") or "")
            text = text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"
            return text + ("" if o.get("parsed", True) else " [no verdict: tie]")
    return ""


def rows_frame(report: dict) -> pd.DataFrame:
    """One line per row: the last user turn, both answers, the row's verdict, and the judge's reason with the
    tuned answer shown first (AB) and second (BA)."""
    out = []
    for r in report.get("per_row") or []:
        prompt = r.get("prompt") or []
        question = next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")
        out.append([r.get("index"), str(question)[:REASON_CHARS], r.get("a"), r.get("b"), r.get("verdict"),
                    _reason(r, "AB"), _reason(r, "BA")])
    return pd.DataFrame(out, columns=ROW_COLUMNS)


def refresh(st: dict, lang: str = "en"):
    """Timer tick (and a page's first poll): the judge's report of the tab's eval once the file exists.
    Outputs: summary, rows table."""
    parts = (st or {}).get("parts") or []
    if not parts or not (st.get("spec") or {}).get("do_judge"):
        return gr.skip(), gr.skip()
    report = read_report(parts[0].get("dir"))
    if not report:
        return gr.skip(), gr.skip()
    return summary_md(report, lang), rows_frame(report)
