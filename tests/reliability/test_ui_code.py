"""A UI login does not mean running code on the server (issue 25, item 1; SECURITY.md; backend/core/allowed.py).

The probe's attack, through the real Gradio API of an app launched in-process: upload a Python file through
Gradio's own upload route, then Start a GRPO run whose reward_funcs names `<uploaded path>:f` (or `os:system`,
or trust_remote_code). Without --allow-code every one is refused next to its field before anything is
launched; with it, only a .py file under the allowed folders passes. A process the UI starts refuses the same
values again at validate ($TUNEBOARD_UI_CODE), so a launch path that forgot the UI's check still runs nothing;
a command line of the machine's own user (variable unset) is not restricted. No training, no model loaded."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from gradio_client import Client

from backend.core import allowed, paths
from ui_roots import ui_roots

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n\ndef f(prompts, completions, **kw):\n" \
       "    return [0.0] * len(completions)\n"


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    with ui_roots(tmp_path_factory.mktemp("ui-code")) as dirs:
        yield dirs


@pytest.fixture(scope="module")
def client(where):
    from webui.app import create_app, launch_kwargs

    demo = create_app()
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True,
                            **launch_kwargs({}))
    yield Client(url, analytics_enabled=False, verbose=False)
    demo.close()


def _param(name: str, offset: int) -> str:
    from webui import fields as F

    order = list(F.TOPBAR_FIELDS) + ["booster", "extra_args"] + [r.name for r in F.form_rows()]
    return f"param_{offset + order.index(name)}"


def _upload(client, name: str, text: str) -> str:
    """Gradio's upload route, as the probe used it: any file is stored and its server path returned."""
    with httpx.Client(base_url=client.src.rstrip("/"), timeout=60) as http:
        answer = http.post("/gradio_api/upload", files={"files": (name, text.encode())})
    answer.raise_for_status()
    return answer.json()[0]


def _start(client, where, run: str, **fields) -> str:
    """/do_start with stage grpo and `fields`; its first output is the errors box."""
    out = where["saves"] / run
    args = {_param("stage", 4): "grpo", _param("output_dir", 4): str(out), _param("dataset", 4): "identity",
            _param("num_generations", 4): 2, _param("max_steps", 4): 1}
    args.update({_param(k, 4): v for k, v in fields.items()})
    errors = client.predict(**args, api_name="/do_start")[0]
    return errors["value"] if isinstance(errors, dict) else str(errors)


def test_an_uploaded_reward_file_does_not_run_without_allow_code(client, where, tmp_path):
    marker = tmp_path / "ran.txt"
    uploaded = _upload(client, "evil_reward.py", EVIL.format(marker=str(marker)))
    errors = _start(client, where, "evil", reward_funcs=f"{uploaded}:f")
    assert "reward_funcs" in errors and "--allow-code" in errors, errors
    errors = _start(client, where, "evil2", reward_funcs="json_valid,os:system")
    assert "os:system" in errors and "--allow-code" in errors, errors
    errors = _start(client, where, "evil3", reward_funcs="json_valid", trust_remote_code=True)
    assert "trust_remote_code" in errors and "--allow-code" in errors, errors
    assert not marker.exists() and not any(where["saves"].glob("evil*"))  # nothing ran, nothing launched


def test_with_allow_code_only_a_file_under_the_allowed_folders(client, where, tmp_path, monkeypatch):
    monkeypatch.setenv(allowed.CODE_ENV, allowed.CODE_IN_ROOTS)  # what `tuneboard webui --allow-code` sets
    marker = tmp_path / "ran.txt"
    uploaded = _upload(client, "evil_reward.py", EVIL.format(marker=str(marker)))
    errors = _start(client, where, "up", reward_funcs=f"{uploaded}:f")
    assert "outside the allowed folders" in errors and uploaded in errors, errors
    errors = _start(client, where, "mod", reward_funcs="os:system")
    assert "names a module" in errors, errors
    assert not marker.exists() and not any(where["saves"].glob("up*")) and not any(where["saves"].glob("mod*"))
    mine = where["extra"] / "mine.py"
    mine.write_text(EVIL.format(marker=str(marker)))
    assert allowed.code_refusals({"reward_funcs": f"json_valid,{mine}:f", "trust_remote_code": True}) == []
    assert not marker.exists()  # deciding imports nothing


def test_the_form_says_why_own_code_is_off(monkeypatch):
    from webui.i18n import field_help

    monkeypatch.delenv(allowed.CODE_ENV, raising=False)
    assert "--allow-code" in field_help("en", "reward_funcs", "GRPO reward functions") \
        and "--allow-code" in field_help("de", "trust_remote_code", "Allow model code")
    monkeypatch.setenv(allowed.CODE_ENV, allowed.CODE_IN_ROOTS)
    assert "--allow-code" not in field_help("en", "reward_funcs", "GRPO reward functions")


def _train(spec, tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", "train", str(spec)], capture_output=True, text=True,
                          cwd=paths.REPO_ROOT, timeout=600, env={**__import__("os").environ, **env})


def test_a_process_the_ui_starts_refuses_the_code_again(tmp_path, monkeypatch):
    """The second line of defence: `tuneboard train` with the UI's policy in its environment stops at
    validate with one line naming the field, the file never imported; the CLI user's own run (no policy)
    gets past that check."""
    monkeypatch.delenv(allowed.CODE_ENV, raising=False)
    marker = tmp_path / "ran.txt"
    reward = tmp_path / "evil_reward.py"
    reward.write_text(EVIL.format(marker=str(marker)))
    spec = tmp_path / "grpo.yaml"
    spec.write_text(f"stage: grpo\ndataset: identity\nreward_funcs: json_valid,{reward}:f\n"
                    f"output_dir: {tmp_path / 'run'}\nmax_steps: 1\n")
    for policy in (allowed.CODE_OFF, allowed.CODE_IN_ROOTS):
        done = _train(spec, tmp_path, **{allowed.CODE_ENV: policy})
        assert done.returncode != 0 and "reward_funcs" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert str(reward) in done.stderr and not marker.exists()
    check = subprocess.run([sys.executable, "-m", "backend.cli", "validate", str(spec)], capture_output=True,
                           text=True, cwd=paths.REPO_ROOT, timeout=300)
    assert "--allow-code" not in check.stdout + check.stderr, check.stdout + check.stderr
