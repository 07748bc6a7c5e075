"""Component registry of one app instance: every labelled component is created through it with a stable
elem_id, so the language switch can relabel the whole page in place from one list. One Registry per
create_app() call (never module-level), passed to each tab's build()."""
from __future__ import annotations

import gradio as gr

from webui.i18n import choice_pairs, field_help, has, t, tr


class Registry:
    def __init__(self, lang: str = "en"):
        self.lang = lang
        self.items: dict[str, tuple] = {}  # elem_id -> (component, kind, choice ids or None)
        self.helps: dict[str, tuple[str, str]] = {}  # elem_id -> (help key, English help): its `info` text
        self.placeholders: dict[str, dict] = {}  # elem_id -> the {fields} of its `<elem_id>.placeholder` text

    def _add(self, comp, kind: str, ids=None):
        if comp.elem_id in self.items:
            raise ValueError(f"duplicate elem_id {comp.elem_id}")
        self.items[comp.elem_id] = (comp, kind, ids)
        return comp

    def label(self, elem_id: str) -> str:
        return t(self.lang, elem_id)

    def _help(self, elem_id: str, help: tuple[str, str] | None, kw: dict) -> None:
        """`help`: (key in locales/fields/<lang>.yaml, English text): the component's info text, translated
        here and on every language switch."""
        if help:
            self.helps[elem_id] = help
            kw["info"] = field_help(self.lang, *help)

    # component factories -------------------------------------------------------------
    def dropdown(self, elem_id: str, ids: list[str], value=None, fixed_labels: dict | None = None,
                 help: tuple[str, str] | None = None, **kw):
        """`fixed_labels`: choice labels that are the same in every language (e.g. language names)."""
        self._help(elem_id, help, kw)
        pairs = ([(fixed_labels.get(i, i), i) for i in ids] if fixed_labels
                 else choice_pairs(self.lang, elem_id, ids))
        comp = gr.Dropdown(choices=pairs, value=value, label=self.label(elem_id), elem_id=elem_id, **kw)
        return self._add(comp, "dropdown", None if fixed_labels else list(ids))

    def button(self, elem_id: str, **kw):
        return self._add(gr.Button(self.label(elem_id), elem_id=elem_id, **kw), "button")

    def markdown(self, elem_id: str, **kw):
        return self._add(gr.Markdown(self.label(elem_id), elem_id=elem_id, **kw), "markdown")

    def html(self, elem_id: str, render, **kw):
        """gr.HTML whose value is render(the translated text of `elem_id`) (the header's tagline)."""
        comp = gr.HTML(render(self.label(elem_id)), elem_id=elem_id, **kw)
        return self._add(comp, "html", render)

    def tab(self, elem_id: str, **kw):
        return self._add(gr.Tab(self.label(elem_id), elem_id=elem_id, **kw), "tab")

    def accordion(self, elem_id: str, **kw):
        return self._add(gr.Accordion(self.label(elem_id), elem_id=elem_id, **kw), "accordion")

    def comp(self, cls, elem_id: str, help: tuple[str, str] | None = None, placeholder_fields: dict | None = None,
             **kw):
        """Any component whose `label` is translated (Textbox, Number, Checkbox, LinePlot, ...). A textbox
        whose locale has `<elem_id>.placeholder` gets that placeholder (its {fields} from
        `placeholder_fields`), translated here and on every language switch."""
        self._help(elem_id, help, kw)
        if has(f"{elem_id}.placeholder"):
            self.placeholders[elem_id] = dict(placeholder_fields or {})
            kw["placeholder"] = tr(self.lang, f"{elem_id}.placeholder", **self.placeholders[elem_id])
        return self._add(cls(label=self.label(elem_id), elem_id=elem_id, **kw), "label")

    # relabelling -----------------------------------------------------------------------
    def components(self) -> list:
        return [c for c, _, _ in self.items.values()]

    def relabel(self, lang: str) -> list:
        """One gr.update per registered component, in `components()` order."""
        out = []
        for elem_id, (comp, kind, ids) in self.items.items():
            text = t(lang, elem_id)
            info = {"info": field_help(lang, *self.helps[elem_id])} if elem_id in self.helps else {}
            if elem_id in self.placeholders:
                info["placeholder"] = tr(lang, f"{elem_id}.placeholder", **self.placeholders[elem_id])
            if kind == "dropdown" and ids is not None:
                out.append(gr.update(label=text, choices=choice_pairs(lang, elem_id, ids), **info))
            elif kind == "html":
                out.append(gr.update(value=ids(text)))
            elif kind in ("button", "markdown"):
                out.append(gr.update(value=text))
            else:
                out.append(gr.update(label=text, **info))
        return out

    def keys(self) -> set[str]:
        """Every locale key this page uses (component ids and dropdown choice keys)."""
        keys = set(self.items)
        return keys
