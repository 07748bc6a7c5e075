"""The web UI reads and writes only under its allowed roots (issue 9, items 1, 2 and 10; backend/core/allowed.py).

Every escape attempt goes through the real Gradio API (gradio_client) of an app launched in-process, as an
attacker on the loopback would: spec Save / Load, the Data tab's folder, preview and register, the Export
folder, the Train form's output_dir and passthrough paths, model / adapter paths, the Chat tab's load. The
allowed roots here: a saves folder, the repo's data/ and examples/, a cache folder, and an `extra` folder
added the way `--allow-path` adds one. `elsewhere` is outside all of them. Login: a second app with --auth.
No training, no model is loaded; no assertion on a duration."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from gradio_client import Client

from backend.core import allowed
from ui_roots import ui_roots
from webui import fields as F

SECRET = "hunter2-SECRET-token"


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    with ui_roots(tmp_path_factory.mktemp("ui-paths"), ("saves", "extra", "elsewhere", "cache")) as dirs:
        yield dirs  # `extra` added as `tuneboard webui --allow-path extra` adds it


def _launch(**login):
    from webui.app import create_app, launch_kwargs

    demo = create_app()
    auth = login.pop("auth", None)
    for _ in range(5):
        try:
            _, url, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True,
                                    quiet=True, auth=auth, **launch_kwargs(login))
            return demo, url.rstrip("/")
        except OSError:
            continue
    raise RuntimeError("could not start the app")


@pytest.fixture(scope="module")
def client(where):
    demo, url = _launch()
    yield Client(url, analytics_enabled=False, verbose=False)
    demo.close()


def _form_param(name: str, offset: int) -> str:
    """gradio_client's name of the Train form's input `name` in a handler whose form values start at
    parameter `offset` (the form's inputs: top bar, booster, extra args, fields)."""
    order = list(F.TOPBAR_FIELDS) + ["booster", "extra_args"] + [r.name for r in F.form_rows()]
    return f"param_{offset + order.index(name)}"


def _refused(text: str, path, where) -> None:
    """A refusal names the path and the allowed roots."""
    assert "not allowed" in text or "outside the allowed folders" in text, text
    assert str(path) in text, text
    assert str(where["saves"]) in text and str(where["extra"]) in text, text


# ------------------------------------------------------------------ Train tab: spec Save / Load

def test_save_outside_the_roots_is_refused_and_the_file_untouched(client, where):
    victim = where["elsewhere"] / "victim.txt"
    victim.write_text("precious")
    message, _ = client.predict(path=str(victim), api_name="/do_save")
    _refused(message, victim, where)
    assert victim.read_text() == "precious"
    tree = where["elsewhere"] / "new" / "tree" / "spec.yaml"
    message, _ = client.predict(path=str(tree), overwrite=True, api_name="/do_save")
    _refused(message, tree, where)
    assert not (where["elsewhere"] / "new").exists()  # no folder tree made outside the roots


def test_dotdot_and_symlink_escapes_are_refused(client, where):
    dotdot = f"{where['saves']}/specs/../../elsewhere/escape.yaml"
    message, _ = client.predict(path=dotdot, overwrite=True, api_name="/do_save")
    _refused(message, where["elsewhere"] / "escape.yaml", where)  # the resolved path is named
    link = where["saves"] / "link"
    link.symlink_to(where["elsewhere"], target_is_directory=True)
    message, _ = client.predict(path=str(link / "through.yaml"), overwrite=True, api_name="/do_save")
    _refused(message, where["elsewhere"] / "through.yaml", where)
    assert not (where["elsewhere"] / "escape.yaml").exists() and not (where["elsewhere"] / "through.yaml").exists()
    relative = "../" * 12 + str(where["elsewhere"]).lstrip("/") + "/rel.yaml"  # from the repo, up to /
    message, _ = client.predict(path=relative, overwrite=True, api_name="/do_save")
    _refused(message, where["elsewhere"] / "rel.yaml", where)


def test_save_overwrites_only_with_the_box_ticked(client, where):
    spec = where["saves"] / "specs" / "mine.yaml"
    message, box = client.predict(path=str(spec), api_name="/do_save")
    assert message == f"Saved `{spec}`" and spec.read_text().strip(), message
    spec.write_text("# hand edits\nstage: sft\n")
    message, _ = client.predict(path=str(spec), api_name="/do_save")
    assert "already exists" in message and "Overwrite" in message, message
    assert spec.read_text() == "# hand edits\nstage: sft\n"
    message, box = client.predict(path=str(spec), overwrite=True, api_name="/do_save")
    assert message == f"Saved `{spec}`" and "hand edits" not in spec.read_text()
    assert box is False  # unticked again: the next overwrite needs its own confirmation
    message, _ = client.predict(path=str(where["saves"] / "notes.txt"), api_name="/do_save")
    assert ".yaml or .yml" in message and not (where["saves"] / "notes.txt").exists()


def test_load_refuses_outside_files_and_never_echoes_a_non_spec(client, where):
    outside = where["elsewhere"] / "secret.yaml"
    outside.write_text(f"password: {SECRET}\nstage: sft\n")
    message = client.predict(path=str(outside), api_name="/do_load")[0]
    _refused(message, outside, where)
    assert SECRET not in message
    inside = where["extra"] / "config.yaml"  # inside a root, but not a spec: its keys and values stay unsaid
    inside.write_text(f"password: {SECRET}\nuser: admin\n{SECRET}_key: 1\n")
    message = client.predict(path=str(inside), api_name="/do_load")[0]
    assert "is not a TuneBoard spec" in message and SECRET not in message and "admin" not in message, message
    broken = where["extra"] / "broken.yaml"
    broken.write_text(f"a: [{SECRET}\n")
    message = client.predict(path=str(broken), api_name="/do_load")[0]
    assert "is not a TuneBoard spec" in message and SECRET not in message, message
    recipe = next((allowed.paths.EXAMPLES_DIR).rglob("*.yaml"))  # examples/ is readable
    message = client.predict(path=str(recipe), api_name="/do_load")[0]
    assert "not allowed" not in message, message


# ------------------------------------------------------------------ Data tab

def test_preview_of_a_file_elsewhere_is_refused_without_its_contents(client, where):
    secret = where["elsewhere"] / "secret.json"
    secret.write_text(json.dumps([{"instruction": SECRET, "output": SECRET}]))
    message, rows = client.predict(upload=None, path=str(secret), name="peek", api_name="/reg_preview")
    _refused(message, secret, where)
    assert SECRET not in message + rows and rows == ""


def test_an_upload_that_is_not_an_upload_is_refused(client, where):
    """A raw API call (not gradio_client, which would upload the file) naming a file elsewhere as the
    "uploaded" file: Gradio itself refuses a path outside its upload folder."""
    secret = where["elsewhere"] / "forged.json"
    secret.write_text(json.dumps([{"instruction": SECRET, "output": SECRET}]))
    forged = {"path": str(secret), "meta": {"_type": "gradio.FileData"}}
    data = ["en", "", forged, "", "peek", "alpaca", *[""] * 7]
    with httpx.Client(base_url=client.src.rstrip("/"), timeout=60) as http:
        event = http.post("/gradio_api/call/reg_preview", json={"data": data}).json()["event_id"]
        answer = http.get(f"/gradio_api/call/reg_preview/{event}").text
    assert "event: error" in answer and SECRET not in answer and "rows read" not in answer, answer


def test_a_dataset_folder_elsewhere_is_neither_listed_nor_previewed(client, where):
    folder = where["elsewhere"] / "data"
    folder.mkdir()
    (folder / "dataset_info.json").write_text(json.dumps({f"{SECRET}_set": {"file_name": "x.json"}}))
    (folder / "x.json").write_text(json.dumps([{"instruction": SECRET, "output": "o"}]))
    picker, summary = client.predict(dataset_dir=str(folder), api_name="/list_datasets")
    _refused(summary, folder, where)
    assert SECRET not in json.dumps(picker) + summary
    summary, rendered = client.predict(dataset_dir=str(folder), dataset=f"{SECRET}_set", api_name="/show_row")
    _refused(summary, folder, where)
    assert rendered == ""
    stats_md, _ = client.predict(dataset_dir=str(folder), dataset=f"{SECRET}_set", api_name="/stats")
    _refused(stats_md, folder, where)


def test_register_into_or_from_elsewhere_is_refused(client, where):
    rows = where["extra"] / "rows.jsonl"
    rows.write_text('{"instruction": "q", "output": "a"}\n')
    target = where["elsewhere"] / "datasets"
    target.mkdir()
    message, _ = client.predict(data_dir=str(target), upload=None, path=str(rows), name="mine", api_name="/reg_save")
    _refused(message, target, where)
    assert list(target.iterdir()) == []  # neither dataset_info.json nor a data file
    outside_rows = where["elsewhere"] / "rows.jsonl"
    outside_rows.write_text('{"instruction": "q", "output": "a"}\n')
    message, _ = client.predict(data_dir=str(where["extra"]), upload=None, path=str(outside_rows),
                                name="mine", api_name="/reg_save")
    _refused(message, outside_rows, where)
    assert not (where["extra"] / "dataset_info.json").exists()


def test_an_allowed_path_works(client, where):
    """The folder added with --allow-path is usable: register a dataset there, save a spec there."""
    rows = where["extra"] / "ok_rows.jsonl"
    rows.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(3)))
    message, _ = client.predict(data_dir=str(where["extra"]), upload=None, path=str(rows), name="ok_rows",
                                api_name="/reg_save")
    assert message.startswith("✓ Registered `ok_rows`"), message
    info = json.loads((where["extra"] / "dataset_info.json").read_text())
    assert info["ok_rows"]["file_name"] == str(rows)
    picker, summary = client.predict(dataset_dir=str(where["extra"]), api_name="/list_datasets")
    assert "ok_rows" in json.dumps(picker) and "not allowed" not in json.dumps(summary)
    message, _ = client.predict(path=str(where["extra"] / "spec.yaml"), api_name="/do_save")
    assert message == f"Saved `{where['extra'] / 'spec.yaml'}`"


# ------------------------------------------------------------------ Train form, Export, Evaluate, Chat

def test_output_dir_and_passthrough_paths_outside_are_refused(client, where):
    out = where["elsewhere"] / "run"
    errors = client.predict(**{_form_param("output_dir", 1): str(out)}, api_name="/do_preview")[0]
    errors = errors["value"]
    assert "output_dir" in errors and str(out) in errors and "not allowed" in errors, errors
    errors = client.predict(**{_form_param("extra_args", 1): "deepspeed: /etc/passwd\n"}, api_name="/do_preview")[0]
    errors = errors["value"]
    assert "deepspeed" in errors and "/etc/passwd" in errors and "root:" not in errors, errors
    # /do_start: state, log scale, language and the picked GPUs come before the form
    started = client.predict(**{_form_param("output_dir", 4): str(out)}, api_name="/do_start")
    assert "not allowed" in started[0]["value"] and not out.exists()


def test_a_model_path_outside_must_be_a_model(client, where):
    junk = where["elsewhere"] / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text(SECRET)
    errors = client.predict(**{_form_param("model_name_or_path", 1): str(junk)}, api_name="/do_preview")[0]["value"]
    assert "not a model folder" in errors and SECRET not in errors, errors
    model = where["elsewhere"] / "model"  # a model folder anywhere is fine to read
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert allowed.spec_refusals({"model_name_or_path": str(model), "adapter_name_or_path": f"{model},{junk}"}) \
        and [e.path for e in allowed.spec_refusals({"adapter_name_or_path": f"{model}, {junk}"})] == [str(junk)]
    assert allowed.spec_refusals({"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}) == []
    status = client.predict(model=str(junk), api_name="/load")[0]  # Chat: no server is started for it
    assert "not a model folder" in status and SECRET not in status, status
    summary, rendered = client.predict(model=str(junk), api_name="/show_row")  # Data: the preview's tokenizer
    assert "not a model folder" in summary and rendered == "", summary


def test_export_dir_outside_is_refused(client, where):
    out = where["elsewhere"] / "merged"
    message = client.predict(**_export_args(client, str(out)), api_name="/export_start")[0]
    _refused(message, out, where)
    assert not out.exists() and not (where["saves"] / ".tools").exists()  # no job launched


def _export_args(client, export_dir: str) -> dict:
    """/export_start's arguments by name: the export folder and the method `full` (no adapter needed)."""
    params = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/export_start"]["parameters"]
    names = [p["parameter_name"] for p in params]
    # on_start(st, lang, model, adapter, method, template, export_dir, ...): state is not a parameter
    return {names[3]: "full", names[5]: export_dir}


def test_eval_with_a_model_that_is_not_one_is_refused(client, where):
    junk = where["elsewhere"] / "junk-eval"
    junk.mkdir()
    (junk / "secret.txt").write_text(SECRET)
    params = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/eval_start"]["parameters"]
    names = [p["parameter_name"] for p in params]  # compare, lang, model, adapter, ...
    message = client.predict(**{names[2]: str(junk)}, api_name="/eval_start")[1]
    assert "not a model folder" in message and str(junk) in message and SECRET not in message, message


def test_run_pickers_take_only_listed_runs(client, where):
    """The Runs tab's actions take a run from its pickers (dropdowns without custom values): Gradio refuses
    any other value, so no path reaches them."""
    with pytest.raises(Exception) as info:
        client.predict(str(where["elsewhere"]), None, api_name="/diff_md")
    assert "not in the list of choices" in str(info.value) or "error" in str(info.value).lower()


# ------------------------------------------------------------------ --allow-path on the command line

def test_allow_path_option(tmp_path, monkeypatch, capsys):
    from webui.app import main, parse_args

    opts = parse_args(["--allow-path", str(tmp_path), "--allow-path", "/srv/other"])
    assert opts.allow_path == [str(tmp_path), "/srv/other"]
    assert main(["--allow-path", str(tmp_path / "missing")]) == 2  # refused before anything is served
    assert "missing: no such folder" in capsys.readouterr().err
    monkeypatch.delenv(allowed.ENV, raising=False)
    allowed.add_roots([str(tmp_path)])
    assert allowed.check_write(tmp_path / "a" / "b.yaml") == (tmp_path / "a" / "b.yaml").resolve()


# ------------------------------------------------------------------ login: lockout, API names behind it

def test_login_backs_off_locks_out_and_hides_the_api(where):
    demo, url = _launch(auth=[("alice", "right-pass")], max_failures=3, base_delay_s=0.01, max_delay_s=0.05)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            page = http.get("/").text  # the login page: no endpoint name before the login
            assert "window.gradio_api_info" in page and "do_save" not in page and "reg_save" not in page
            assert http.get("/config").status_code == 401 and http.get("/gradio_api/info").status_code == 401
            ok = http.post("/login", data={"username": "alice", "password": "right-pass"})
            assert ok.status_code == 200
            assert "do_save" in http.get("/").text  # logged in: the page has its API again
        with httpx.Client(base_url=url, timeout=60) as http:
            codes = [http.post("/login", data={"username": "alice", "password": f"wrong{i}"}).status_code
                     for i in range(3)]
            assert codes == [400, 400, 400]
            locked = http.post("/login", data={"username": "alice", "password": "right-pass"})
            assert locked.status_code == 429, locked.text  # even the right password waits out the lockout
            assert "Too many wrong logins" in locked.json()["detail"] and int(locked.headers["retry-after"]) > 0
            assert "access-token" not in "".join(locked.headers.get_list("set-cookie"))
    finally:
        demo.close()


def test_login_guard_counts_and_forgets():
    """The bookkeeping with a hand-moved clock: back-off grows, N failures lock, the lockout ends, a right
    login clears the count; a user name is locked after its own (higher) limit from any address."""
    from webui.login import LoginGuard

    now = [1000.0]
    guard = LoginGuard(None, max_failures=3, max_user_failures=5, lockout_s=60, base_delay_s=1, max_delay_s=3,
                       clock=lambda: now[0])
    ip = [("ip", "10.0.0.1"), ("user", "bob")]
    assert guard.delay_for(ip) == 0
    guard.record(ip, ok=False)
    guard.record(ip, ok=False)
    assert guard.delay_for(ip) == 2 and guard.locked_for(ip) == 0
    guard.record(ip, ok=False)
    assert guard.locked_for(ip) == 60 and guard.delay_for(ip) == 3
    now[0] += 61
    assert guard.locked_for(ip) == 0 and guard.failures.get(("ip", "10.0.0.1")) is None
    for n in range(2):  # bob: 3 + 2 failures from other addresses -> his name is locked everywhere
        guard.record([("ip", f"10.0.1.{n}"), ("user", "bob")], ok=False)
    assert guard.locked_for([("ip", "10.9.9.9"), ("user", "bob")]) == 60
    guard.record([("ip", "10.0.0.2"), ("user", "carol")], ok=False)
    guard.record([("ip", "10.0.0.2"), ("user", "carol")], ok=True)
    assert guard.delay_for([("ip", "10.0.0.2"), ("user", "carol")]) == 0
