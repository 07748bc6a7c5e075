"""The Data tab's row editor: the shown row's raw JSON (as its file holds it) in an editor; as it is typed, the
preview above re-renders it with its trained spans (the real `tuneboard preview --row` subprocess: the same
conversion and template as training); "Save as a new version" writes the dataset with that row replaced as a new
registered version (backend.core.dataset_versions: the original file and entry are never changed) and shows it;
"Undo" removes the last version saved here and goes back to the dataset it came from."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import gradio as gr

from backend.core import dataset_versions
from backend.core.dataset_info import DatasetError
from webui import choices
from webui import datasets as D
from webui.i18n import tr

# the editor's re-render and the row previews take turns, in the order asked (see webui/tabs/data.py)
ONE_ROW_AT_A_TIME = {"concurrency_limit": 1, "concurrency_id": "data-row"}


def build(reg, c: dict) -> None:
    with reg.accordion("data-group-edit", open=False):
        c["edit_row"] = reg.comp(gr.Code, "data-edit_row", language="json", value="", interactive=True)
        with gr.Row():
            c["edit_load"] = reg.button("data-edit_load", size="sm")
            c["edit_save"] = reg.button("data-edit_save", size="sm", variant="primary")
            c["edit_undo"] = reg.button("data-edit_undo", size="sm")
        c["edit_message"] = gr.Markdown("", elem_id="data-edit_message")
    c["edit_state"] = gr.State({})


def _folder(dataset_dir) -> str | None:
    return (dataset_dir or "").strip() or None


def load_row(st, dataset_dir, dataset, index, model, template, cutoff, lang="en"):
    """The shown row (the preview's file row) as JSON into the editor; a row training skips loads too (the preview
    says why), so it can be mended. Inputs: state, then as show_row. Outputs: state, editor, message."""
    refused = D.dir_refusal(dataset_dir, lang, model=model)
    if refused or not dataset:
        return gr.skip(), gr.skip(), refused or tr(lang, "data.pick")
    res = D.run_preview(D.preview_args(dataset, index, (model, template), cutoff, dataset_dir))
    if "error" in res and not isinstance(res.get("row"), int):
        return gr.skip(), gr.skip(), f"✖ {res['error']}"
    try:
        _, path = dataset_versions.local_file(_folder(dataset_dir), dataset)
        raw = dataset_versions.read_rows(path, dataset)[res["row"]]
    except (DatasetError, IndexError, TypeError) as exc:
        return gr.skip(), gr.skip(), f"✖ {exc}"
    st = dict(st or {}, dataset_dir=dataset_dir or "", dataset=dataset, row=res["row"], file=path.name)
    loaded = "data.edit_loaded_skipped" if "error" in res else "data.edit_loaded"
    return st, json.dumps(raw, indent=2, ensure_ascii=False), tr(lang, loaded, row=res["row"], file=path.name)


def _row_file(text: str) -> Path:
    f = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="tuneboard-row-", delete=False, encoding="utf-8")
    with f:
        f.write(text)
    return Path(f.name)


def render_edit(st, text, model, template, cutoff, lang="en"):
    """As the row is typed: the preview re-renders it (or says in one line why training would skip it).
    Inputs: state, editor, model, template, cutoff_len, language. Outputs: summary, rendered row."""
    if not (st or {}).get("dataset") or not (text or "").strip():
        return gr.skip(), gr.skip()
    path = _row_file(text)
    try:
        res = D.run_preview(D.preview_args(st["dataset"], st["row"], (model, template), cutoff, st["dataset_dir"])
                            + ["--row", str(path)])
    finally:
        path.unlink(missing_ok=True)
    if "error" in res:
        return f"✖ {tr(lang, 'data.edit_invalid')}: {res['error']}", gr.skip()
    return D.row_summary(res, lang) + tr(lang, "data.edit_unsaved"), D.render_row(res, lang)


def save_version(st, text, model, template, cutoff, lang="en"):
    """The edited row into a new registered version of the dataset, which the page then shows.
    Inputs: state, editor, model, template, cutoff_len, language. Outputs: state, message, dataset picker."""
    if not (st or {}).get("dataset"):
        return gr.skip(), tr(lang, "data.edit_first"), gr.skip()
    refused = D.dir_refusal(st["dataset_dir"], lang, write=True)
    if refused:
        return gr.skip(), refused, gr.skip()
    summary, _ = render_edit(st, text, model, template, cutoff, lang)  # training must be able to use the row
    if isinstance(summary, str) and summary.startswith("✖"):
        return gr.skip(), summary, gr.skip()
    try:
        version = dataset_versions.replace_row(_folder(st["dataset_dir"]), st["dataset"], st["row"], json.loads(text))
    except (DatasetError, json.JSONDecodeError) as exc:
        return gr.skip(), f"✖ {exc}", gr.skip()
    st = dict(st, versions=[*st.get("versions", []), {"name": version.name, "from": st["dataset"]}])
    message = tr(lang, "data.edit_saved", version=version.name, file=version.path.name, row=st["row"],
                 dataset=st["dataset"])
    return st, message, gr.update(choices=choices.dataset_names(_folder(st["dataset_dir"])), value=version.name)


def undo_version(st, lang="en"):
    """Remove the last version saved here; the picker goes back to the dataset it came from.
    Inputs: state, language. Outputs: state, message, dataset picker."""
    versions = list((st or {}).get("versions") or [])
    if not versions:
        return gr.skip(), tr(lang, "data.edit_nothing"), gr.skip()
    last = versions.pop()
    try:
        dataset_versions.remove_version(_folder(st["dataset_dir"]), last["name"])
    except DatasetError as exc:
        return gr.skip(), f"✖ {exc}", gr.skip()
    return (dict(st, versions=versions), tr(lang, "data.edit_undone", version=last["name"], dataset=last["from"]),
            gr.update(choices=choices.dataset_names(_folder(st["dataset_dir"])), value=last["from"]))


def wire(c: dict, ins: list, view: list) -> None:
    """Handler names are the page's API names (Gradio names an endpoint after its function): unlike Chat's `load`.
    `ins`: show_row's inputs (folder, dataset, row, model, template, cutoff, language); `view`: summary and
    rendered row."""
    model, template, cutoff, lang = ins[3], ins[4], ins[5], ins[6]
    st = c["edit_state"]
    c["edit_load"].click(load_row, [st, *ins], [st, c["edit_row"], c["edit_message"]], **ONE_ROW_AT_A_TIME)
    c["edit_row"].input(render_edit, [st, c["edit_row"], model, template, cutoff, lang], view, trigger_mode="always_last",
                        **ONE_ROW_AT_A_TIME)
    c["edit_save"].click(save_version, [st, c["edit_row"], model, template, cutoff, lang],
                         [st, c["edit_message"], c["dataset"]], **ONE_ROW_AT_A_TIME)
    c["edit_undo"].click(undo_version, [st, lang], [st, c["edit_message"], c["dataset"]])
