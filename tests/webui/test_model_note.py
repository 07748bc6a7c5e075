"""The top bar says when a picked model is not on this machine (a registry id not in the Hugging Face cache, a path
that is not there): validate refuses it at Start; the note says it at the pick. A model that is here gets none."""
from __future__ import annotations

from backend.core.paths import DEFAULT_MODEL_ID
from webui.app import create_app


def _on_model():
    demo = create_app()
    return next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_model")


def test_a_model_not_on_this_machine_is_named_at_the_pick(tiny_llama, hub_cache, tmp_path):
    on_model = _on_model()
    template, note = on_model("Qwen/Qwen2.5-7B-Instruct", "en")  # in the registry, not in this test's cache
    assert template == "auto" and note.startswith("Start will refuse this model: model 'Qwen/Qwen2.5-7B-Instruct' "
                                                  "is not in this machine's Hugging Face cache")
    template, note = on_model("Qwen/Qwen2.5-7B", "de")  # a base model: both notes, in the page's language
    assert template == "default" and note.startswith("Start wird dieses Modell ablehnen:") and "Basismodell" in note
    assert "does not exist" in on_model(str(tmp_path / "gone"), "en")[1]
    hub_cache("Qwen/Qwen2.5-7B-Instruct")
    assert on_model("Qwen/Qwen2.5-7B-Instruct", "en") == ("auto", "")
    assert on_model(DEFAULT_MODEL_ID, "en") == ("auto", "")
    assert on_model(str(tiny_llama), "en")[1] == ""


def test_the_template_change_that_follows_a_pick_keeps_the_note():
    """Picking a base model sets its template to default; that change runs on_template, whose note is the same
    (it cleared the pick's note before)."""
    demo = create_app()
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    template, note = fns["on_model"]("Qwen/Qwen2.5-7B", "en")
    assert template == "default" and fns["on_template"]("Qwen/Qwen2.5-7B", template, "en") == note
    assert "its template is set to `default`" in note
    chat = fns["on_template"]("Qwen/Qwen2.5-7B", "qwen", "en")
    assert "`qwen` is a chat template" in chat and "its template is set to" not in chat
