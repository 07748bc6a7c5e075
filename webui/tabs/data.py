"""Data tab: page through a registered dataset's rows rendered by the chosen template, trained spans in
colour (a ranking row as its prompt + chosen + rejected answers, a KTO row with its tag); dataset
statistics; register a new dataset (upload or path, format, column mapping, preview, save)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gradio as gr
import pandas as pd

from backend.core import allowed, paths
from webui import choices, jobs
from webui.data_check import finding_words
from webui import datasets as D, row_editor
from webui.datasets import dir_refusal, preview_args as _preview_args
from webui.i18n import refusal, tr
import html

def legend_html(text: str) -> str:
    """The colour legend above a row; `text`: the locale's "trained ...|masked ..." (key data-legend)."""

    trained, _, masked = text.partition("|")
    return (f'<div class="tb-legend"><span class="tb-trained">{html.escape(trained.strip())}</span>'
            f'<span class="tb-masked">{html.escape(masked.strip())}</span></div>')


# Row previews run one at a time, in the order they were asked for: the first look on opening the tab
# (a preview subprocess) finishing after a dataset pick used to put the old dataset's row back on screen.
ONE_ROW_AT_A_TIME = {"concurrency_limit": 1, "concurrency_id": "data-row"}

def build(ctx) -> dict:
    reg = ctx.reg
    c: dict = {}
    with gr.Row():
        c["dir"] = reg.comp(gr.Textbox, "data-dir", value=str(paths.DATA_DIR), scale=3)
        c["dataset"] = reg.dropdown("data-dataset", choices.dataset_names(), value="identity",
                                    allow_custom_value=True, scale=2)
        c["index"] = reg.comp(gr.Number, "data-index", value=0, precision=0, minimum=0, scale=1)
    with gr.Row():
        c["prev"] = reg.button("data-prev", size="sm")
        c["show"] = reg.button("data-show", size="sm", variant="primary")
        c["next"] = reg.button("data-next", size="sm")
        c["stats"] = reg.button("data-stats", size="sm")
        c["check"] = reg.button("data-check", size="sm")
        c["fix"] = reg.button("data-fix", size="sm")
    c["info_warning"] = gr.Markdown("", elem_id="data-info_warning")
    c["summary"] = gr.Markdown("", elem_id="data-summary")
    c["legend"] = reg.html("data-legend", legend_html)
    c["rendered"] = gr.HTML("", elem_id="data-preview")
    c["stats_md"] = gr.Markdown("", elem_id="data-stats_md")
    c["lint_md"] = gr.Markdown("", elem_id="data-lint_md")
    c["lint_rows"] = reg.comp(gr.Dropdown, "data-lint_rows", choices=[], value=None, visible=False)
    c["fix_md"] = gr.Markdown("", elem_id="data-fix_md")
    row_editor.build(reg, c)  # the shown row's JSON, edited and saved as a new version (webui/row_editor.py)
    c["hist"] = reg.comp(gr.BarPlot, "data-hist", value=pd.DataFrame({"tokens": [], "rows": []}), x="tokens",
                         y="rows", height=220, visible=False)
    with reg.accordion("data-group-register", open=False):
        with gr.Row():
            c["reg_file"] = reg.comp(gr.File, "data-reg_file", file_types=list(D.SUFFIXES), type="filepath",
                                     scale=2)
            with gr.Column(scale=2):
                c["reg_path"] = reg.comp(gr.Textbox, "data-reg_path", value="")
                c["reg_name"] = reg.comp(gr.Textbox, "data-reg_name", value="")
                c["reg_format"] = reg.dropdown("data-reg_format", list(D.FORMATS), value="alpaca")
        with gr.Row():
            c["reg_cols"] = {k: reg.comp(gr.Textbox, f"data-reg_col_{k}", value="", min_width=120)
                             for k in D.COLUMN_KEYS}
        with gr.Row():
            c["reg_preview"] = reg.button("data-reg_preview", size="sm")
            c["reg_save"] = reg.button("data-reg_save", size="sm", variant="primary")
        c["reg_message"] = gr.Markdown("", elem_id="data-reg_message")
        c["reg_rows"] = gr.HTML("", elem_id="data-reg_rows")
    return c


def info_warning(dataset_dir, lang: str = "en") -> str:
    """The folder's dataset_info.json entries that cannot be used (a schema problem, a name registered
    twice), each with why; they are left out of the dataset lists, the good ones stay usable. "" when all
    entries are good or the folder is refused (the summary says so). Inputs: folder, language. Outputs:
    warning."""
    if dir_refusal(dataset_dir, lang):
        return ""
    problems, error = choices.dataset_problems((dataset_dir or "").strip() or None)
    if error:
        return tr(lang, "data.info_unreadable") + f"\n\n- {error}"
    if not problems:
        return ""
    lines = [f"- **{name}**: " + "; ".join(w.removeprefix(f"dataset '{name}': ") for w in why)
             for name, why in problems.items()]
    return "\n".join([tr(lang, "data.bad_entries", n=len(problems)), "", *lines])


def show_row(dataset_dir, dataset, index, model, template, cutoff, lang="en"):
    """Inputs: dataset folder, dataset, row, model, template, cutoff_len, language. Outputs: summary,
    rendered row."""
    if not dataset:
        return tr(lang, "data.pick"), ""
    refused = dir_refusal(dataset_dir, lang, model=model)
    if refused:
        return refused, ""
    res = D.run_preview(_preview_args(dataset, index, (model, template), cutoff, dataset_dir))
    if "error" in res:
        return f"✖ {res['error']}", ""
    warn = "".join(f"\n\n⚠ {w}" for w in res.get("warnings") or [])
    system = D.template_system_prompt(res)
    if system:
        warn += "\n\nℹ " + tr(lang, "data.system_prompt", system=system)
    return D.row_summary(res, lang) + tr(lang, "data.template", template=res.get("template", template)) + warn, \
        D.render_row(res, lang)


def stats(dataset_dir, dataset, model, template, cutoff, lang="en"):
    """Inputs: as show_row. Outputs: stats markdown, histogram."""
    refused = dir_refusal(dataset_dir, lang, model=model)
    if refused:
        return refused, gr.update(visible=False)
    args = _preview_args(dataset, 0, (model, template), cutoff, dataset_dir) + ["--stats"]
    res = D.run_preview(args, timeout=600)
    if "error" in res:
        return f"✖ {res['error']}", gr.update(visible=False)
    lengths = res.get("lengths") or []
    lines = [tr(lang, "data.stats", n=res.get("num_rows", 0), mean=res.get("mean_length"), max=res.get("max_length")),
             tr(lang, "data.truncated", n=len(res.get("truncated_rows") or [])),
             tr(lang, "data.untrained", n=len(res.get("rows_without_trained_tokens") or []))]
    lines += [f"- {line}" for line in res.get("report") or []]
    hist, order = histogram(lengths)
    return "\n\n".join(lines), gr.update(value=hist, visible=True, sort=order, x_title=tr(lang, "data.hist_tokens"),
                                         y_title=tr(lang, "data.hist_rows"))


def lint_stage(dataset_dir, dataset) -> str:
    """The stage a dataset is checked for, by its kind (as the preview picks it): ranking -> dpo, a kto_tag
    column -> kto, else sft."""
    entry = choices.dataset_info((dataset_dir or "").strip() or None).get(dataset) or {}
    if not isinstance(entry, dict):
        return "sft"
    return "dpo" if entry.get("ranking") else "kto" if "kto_tag" in (entry.get("columns") or {}) else "sft"


def check(dataset_dir, dataset, model, template, cutoff, lang="en", timeout: float = 600):
    """The Check button: `tuneboard lint --json` in a subprocess (the lint loads the tokenizer and the data
    stack, which the UI process never imports) for the dataset with the top bar's model and template and the
    Train form's cutoff_len. Inputs: as stats. Outputs: the findings as markdown, the picker of their rows
    (picking one shows that row in the preview)."""
    md, findings = _check(dataset_dir, dataset, model, template, cutoff, lang, timeout)
    rows = finding_rows(findings, dataset, lang)
    return md, gr.update(choices=rows, value=None, visible=bool(rows))


def finding_rows(findings: list[dict], dataset, lang: str = "en") -> list[tuple[str, str]]:
    """The row picker's (label, row) pairs: each finding's rows in `dataset` (50 at most), named by its check."""
    return [(f"{finding_words(f, lang)[0]} · {f['dataset']} · {r}", str(r)) for f in findings for r in f["rows"][:50]
            if f["dataset"] == dataset]


SAFE_FIXES = ("drop_duplicates", "drop_leaks", "drop_empty")  # backend/dataprep/lint.py FIXES


def fix(dataset_dir, dataset, model, template, cutoff, lang="en", timeout: float = 600):
    """The Fix button: the lint's safe fixes (drop exact and near duplicates, eval leaks, empty answers) through
    `tuneboard lint --fix`, which writes the dataset without those rows as a new registered version (the file and
    its entry are never edited); the picker then shows the new version. Inputs: as check. Outputs: the fix's
    message, dataset picker."""
    res = _lint(dataset_dir, dataset, model, template, cutoff, lang, timeout, ["--fix", ",".join(SAFE_FIXES)])
    if isinstance(res, str):
        return res, gr.skip()
    made = [line for line in res.get("fixed") or [] if not line.startswith("nothing to fix")]
    if not made:
        return tr(lang, "data.fix_none"), gr.skip()
    version = made[0].split(":", 1)[0]
    return (tr(lang, "data.fixed", line=html.escape(made[0])),
            gr.update(choices=choices.dataset_names((dataset_dir or "").strip() or None), value=version))


def _lint(dataset_dir, dataset, model, template, cutoff, lang, timeout, extra=()) -> dict | str:
    """`tuneboard lint --json` of the dataset: its JSON, or the line to show instead."""
    if not dataset:
        return tr(lang, "data.pick")
    refused = dir_refusal(dataset_dir, lang, model=model, write=bool(extra))
    if refused:
        return refused
    args = [f"dataset={dataset}", f"model_name_or_path={model or paths.DEFAULT_MODEL_ID}",
            f"template={template or 'auto'}", f"cutoff_len={int(cutoff or 1024)}",
            f"stage={lint_stage(dataset_dir, dataset)}"]
    if (dataset_dir or "").strip():
        args.append(f"dataset_dir={dataset_dir.strip()}")
    try:
        proc = subprocess.run(jobs.tuneboard_argv() + ["lint", *args, "--json", *extra], capture_output=True,
                              text=True, timeout=timeout, cwd=str(paths.REPO_ROOT))
    except subprocess.TimeoutExpired:
        return tr(lang, "data.lint_timeout", s=f"{timeout:.0f}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    try:
        res = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        res = {"error": "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:]) or f"exit {proc.returncode}"}
    if "error" in res:
        return "✖ " + html.escape(res["error"])
    return res


def _check(dataset_dir, dataset, model, template, cutoff, lang, timeout) -> tuple[str, list[dict]]:
    res = _lint(dataset_dir, dataset, model, template, cutoff, lang, timeout)
    if isinstance(res, str):
        return res, []
    findings = res.get("findings") or []
    return findings_md(findings, lang), findings


def findings_md(findings: list[dict], lang: str = "en") -> str:
    """The lint's findings (its JSON's) as the Check's markdown in `lang`: the counts, then one line each with its
    check, what it found (webui.data_check.finding_words), its rows and its safe fix."""
    if not findings:
        return tr(lang, "data.lint_none")
    by = {s: sum(f["severity"] == s for f in findings) for s in ("error", "warning", "info")}
    out = [tr(lang, "data.lint", n=len(findings), errors=by["error"], warnings=by["warning"], infos=by["info"])]
    icon = {"error": "✖", "warning": "⚠", "info": "ℹ"}
    for f in findings:
        rows = f["rows"][:20]
        shown = ", ".join(map(str, rows)) + (", …" if len(f["rows"]) > 20 else "")
        where = tr(lang, "data.lint_at_rows", rows=shown) if rows else ""
        fix = f" · `--fix {f['fix']}`" if f.get("fix") else ""
        check, summary = finding_words(f, lang)
        out.append(f"- {icon.get(f['severity'], '')} **{html.escape(check)}** ({html.escape(f['dataset'])}): "
                   f"{html.escape(summary)}{where}{fix}")
    return "\n".join(out)


def histogram(lengths: list[int], max_bins: int = 20) -> tuple[pd.DataFrame, list[str]]:
    """Row lengths -> (frame of bins "lo-hi" tokens and their row counts, the bins in numeric order). The
    bar plot draws text categories in the order it is given (as text they sort 101, 105, 49, ...)."""
    if not lengths:
        return pd.DataFrame({"tokens": pd.Series(dtype="str"), "rows": pd.Series(dtype="int64")}), []
    lo, hi = min(lengths), max(lengths)
    n = min(max_bins, max(1, len(set(lengths))))
    width = max(1, -(-(hi - lo + 1) // n))  # ceil
    counts: dict[int, int] = {}
    for v in lengths:
        counts[(v - lo) // width] = counts.get((v - lo) // width, 0) + 1
    labels = [f"{lo + i * width}-{lo + (i + 1) * width - 1}" if width > 1 else str(lo + i)
              for i in range((hi - lo) // width + 1)]
    frame = pd.DataFrame({"tokens": labels, "rows": [counts.get(i, 0) for i in range(len(labels))]})
    return frame, labels


def cleared_stats():
    """The statistics of the previous dataset are not left on screen. Outputs: stats md, histogram."""
    return "", gr.update(value=histogram([])[0], visible=False)


def wire(ctx, c: dict) -> None:
    """`tab`: the Data tab itself: opening it shows the picked dataset's row when nothing is shown yet."""
    top, train, tab = ctx.top, ctx.tab("train"), ctx.items.get("data")
    cutoff = train["fields"]["cutoff_len"]
    ins = [c["dir"], c["dataset"], c["index"], top["model_name_or_path"], top["template"], cutoff, top["lang"]]
    if tab is not None:
        def first_look(rendered, *values):
            """Inputs: the rendered row, then as show_row. Outputs: summary, rendered row."""
            return (gr.skip(), gr.skip()) if rendered else show_row(*values)

        tab.select(first_look, [c["rendered"], *ins], [c["summary"], c["rendered"]], **ONE_ROW_AT_A_TIME)
        tab.select(info_warning, [c["dir"], top["lang"]], [c["info_warning"]], show_progress="hidden")
    top["lang"].change(info_warning, [c["dir"], top["lang"]], [c["info_warning"]], show_progress="hidden")
    c["show"].click(show_row, ins, [c["summary"], c["rendered"]], **ONE_ROW_AT_A_TIME)
    row_editor.wire(c, ins, [c["summary"], c["rendered"]])
    # a dataset picked: its statistics are not the last one's, and its row 0 is shown at once
    c["dataset"].change(lambda: (0, *cleared_stats()), None, [c["index"], c["stats_md"], c["hist"]],
                        show_progress="hidden").then(show_row, ins, [c["summary"], c["rendered"]], **ONE_ROW_AT_A_TIME)
    c["next"].click(lambda i: int(i or 0) + 1, [c["index"]], [c["index"]]).then(
        show_row, ins, [c["summary"], c["rendered"]], **ONE_ROW_AT_A_TIME)
    c["prev"].click(lambda i: max(0, int(i or 0) - 1), [c["index"]], [c["index"]]).then(
        show_row, ins, [c["summary"], c["rendered"]], **ONE_ROW_AT_A_TIME)
    c["stats"].click(stats, [c["dir"], c["dataset"], top["model_name_or_path"], top["template"], cutoff,
                             top["lang"]], [c["stats_md"], c["hist"]])
    c["dataset"].change(lambda: ("", gr.update(choices=[], value=None, visible=False)), None,
                        [c["lint_md"], c["lint_rows"]], show_progress="hidden")  # not the last dataset's findings
    c["check"].click(check, [c["dir"], c["dataset"], top["model_name_or_path"], top["template"], cutoff,
                             top["lang"]], [c["lint_md"], c["lint_rows"]])
    c["fix"].click(fix, [c["dir"], c["dataset"], top["model_name_or_path"], top["template"], cutoff, top["lang"]],
                   [c["fix_md"], c["dataset"]])
    # a finding's row picked: the preview shows it
    c["lint_rows"].input(lambda r: int(r) if r not in (None, "") else gr.skip(), [c["lint_rows"]], [c["index"]]).then(
        show_row, ins, [c["summary"], c["rendered"]], **ONE_ROW_AT_A_TIME)

    def list_datasets(dataset_dir, lang):
        """The datasets of a folder (under the allowed roots). Inputs: folder, language. Outputs: dataset
        picker, summary."""
        refused = dir_refusal(dataset_dir, lang)
        if refused:
            return gr.update(choices=[]), refused
        return gr.update(choices=choices.dataset_names(dataset_dir)), gr.skip()

    c["dir"].submit(list_datasets, [c["dir"], top["lang"]], [c["dataset"], c["summary"]]).then(
        info_warning, [c["dir"], top["lang"]], [c["info_warning"]], show_progress="hidden")

    col_keys = list(D.COLUMN_KEYS)
    reg_in = [top["lang"], c["dir"], c["reg_file"], c["reg_path"], c["reg_name"], c["reg_format"],
              *[c["reg_cols"][k] for k in col_keys]]

    def _entry(data_dir, upload, path, name, fmt, cols, stage: bool):
        """The folder, the entry and its first rows. A typed path and the folder must lie under the allowed
        roots (backend.core.allowed: PathRefused); an upload is Gradio's own copy of the user's file."""
        data_dir = (allowed.check_write(data_dir, "dataset_dir") if stage else allowed.check_read(data_dir, "dataset_dir")) \
            if (data_dir or "").strip() else Path(paths.DATA_DIR)
        src = Path(upload) if upload else allowed.check_read(path, "file") if (path or "").strip() else None
        if src is None:
            raise D.RegisterError("file: upload a file or give a path")
        existing = choices.dataset_info(data_dir)
        columns = dict(zip(col_keys, cols))
        rows = D.check_entry(name.strip(), src, fmt, columns, existing)
        if stage and upload:
            file_name = D.stage_file(src, name.strip(), data_dir)
        else:
            file_name = str(src.resolve())
        return data_dir, D.make_entry(file_name, fmt, columns), rows

    def reg_preview(lang, data_dir, upload, path, name, fmt, *cols):
        """Checks the mapping and renders the first rows through the backend. Outputs: message, rows."""
        try:
            _, entry, _ = _entry(data_dir, upload, path, name, fmt, cols, stage=False)
        except allowed.PathRefused as exc:
            return refusal(lang, exc), ""
        except (D.RegisterError, OSError, ValueError) as exc:
            return f"✖ {exc}", ""
        res = D.preview_entry(name.strip(), entry)
        if "error" in res:
            return f"✖ {res['error']}", ""
        rows = res.get("rows") or [res]
        body = "".join(f"<p>{D.row_summary(r, lang)}</p>{D.render_row(r, lang)}" for r in rows)
        return tr(lang, "data.reg_read", n=res.get("num_rows", len(rows)), shown=len(rows)), body

    c["reg_preview"].click(reg_preview, reg_in, [c["reg_message"], c["reg_rows"]])

    def reg_save(lang, data_dir, upload, path, name, fmt, *cols):
        """Validates, copies an uploaded file into the dataset folder, adds the entry to dataset_info.json
        atomically. Outputs: message, dataset picker, train dataset field."""
        try:
            data_dir, entry, _ = _entry(data_dir, upload, path, name, fmt, cols, stage=True)
            D.write_entry(name.strip(), entry, data_dir)
        except allowed.PathRefused as exc:
            return refusal(lang, exc), gr.skip()
        except (D.RegisterError, OSError, ValueError) as exc:
            return f"✖ {exc}", gr.skip()
        return (tr(lang, "data.registered", name=name.strip(), path=data_dir / "dataset_info.json"),
                gr.update(choices=choices.dataset_names(data_dir), value=name.strip()))

    c["reg_save"].click(reg_save, reg_in, [c["reg_message"], c["dataset"]])

