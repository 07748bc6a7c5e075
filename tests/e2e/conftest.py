"""Real-browser fixtures (see shared/BROWSER-TESTS.md): Debian's Chromium driven by Playwright, the app
served in-process on 127.0.0.1 with a free port and its own saves folder."""
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import pytest  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = pytest.mark.e2e

from playwright.sync_api import expect  # noqa: E402

expect.set_options(timeout=20_000)


def pytest_collection_modifyitems(config, items):
    if not Path(CHROMIUM).exists():
        skip = pytest.mark.skip(reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
        for item in items:
            if "e2e" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost , EXCLUDE 127.0.0.1"]}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1280, "height": 900}}


@pytest.fixture(scope="session")
def saves_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("saves")
    os.environ["TUNEBOARD_SAVES"] = str(root)
    return root


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A copy of the bundled data folder, so registering a dataset never touches the repo's."""
    from backend.core.paths import DATA_DIR

    d = tmp_path_factory.mktemp("data") / "data"
    shutil.copytree(DATA_DIR, d)
    return d


@pytest.fixture(scope="session")
def app_url(saves_root, tmp_path_factory):
    from backend.core import allowed
    from webui import jobs
    from webui.app import create_app, launch_kwargs

    # the tests' own folders (a copy of data/, export targets under tmp_path), as `--allow-path` would add them
    allowed.add_roots([str(tmp_path_factory.getbasetemp())])

    worker = jobs.QueueWorker(saves_root, interval_s=1.0).start()
    demo = create_app()
    for _ in range(5):
        try:
            _, url, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True,
                                    quiet=True, **launch_kwargs())
            break
        except OSError:
            continue
    else:
        raise RuntimeError("could not start the app")
    yield url.rstrip("/")
    demo.close()
    worker.stop()
    for d in jobs.iter_run_dirs(saves_root):  # no orphans even when a test failed midway
        jobs.abort(d, term_after_s=0.5, kill_after_s=2, wait=True)


@pytest.fixture(scope="session")
def base_url(app_url):
    return app_url


# On a page error, which element had the focus and which dropdowns had their option list open (a stack from
# Gradio's bundle names neither).
WHERE_ON_ERROR = """window.addEventListener('error', () => {
  const id = el => el && el.closest('[id]') ? el.closest('[id]').id : null;
  (window.__tbWhere = window.__tbWhere || []).push({
    focus: id(document.activeElement),
    open_lists: [...document.querySelectorAll('ul.options')].map(u => id(u.parentElement))});
});"""


@pytest.fixture
def app_page(page, app_url):
    """The page with the app open; fails the test on a page error or a request to another host."""
    errors, foreign = [], []
    page.on("pageerror", lambda exc: errors.append(f"{exc}\n{getattr(exc, 'stack', '') or ''}"))
    host = urlparse(app_url).netloc

    def check(request):
        netloc = urlparse(request.url).netloc
        if request.url.startswith("http") and netloc != host:
            foreign.append(request.url)

    page.on("request", check)
    page.set_default_timeout(20_000)
    page.add_init_script(WHERE_ON_ERROR)
    page.goto(app_url)
    page.locator("#tb-header").wait_for()
    yield page
    if errors:
        errors.append(f"where: {page.evaluate('() => window.__tbWhere || []')}")
    assert not errors, f"page errors: {errors}"
    assert not foreign, f"requests to other hosts: {foreign}"


@pytest.fixture
def shot(app_page):
    ARTIFACTS.mkdir(exist_ok=True)

    def take(name):
        app_page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    return take


@pytest.fixture(scope="session")
def finished_runs(saves_root, tiny_llama):
    """Two finished LoRA runs of the tiny Llama (2 and 3 steps, a checkpoint each step), made by the real
    `tuneboard train` CLI into the app's saves folder, both at once (about half a minute)."""
    import subprocess
    import sys

    from webui import jobs

    cli = jobs.tuneboard_argv()
    env = {**os.environ, "TUNEBOARD_SAVES": str(saves_root)}
    dirs = [saves_root / "tiny_llama" / "lora" / name for name in ("run-a", "run-b")]
    procs = [subprocess.Popen(
        cli + ["train", f"model_name_or_path={tiny_llama}", "dataset=identity", f"max_steps={steps}",
               f"output_dir={d}", "logging_steps=1", "save_steps=1", "per_device_train_batch_size=2",
               "cutoff_len=128", "template=default"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for d, steps in zip(dirs, (2, 3))]
    for p, d in zip(procs, dirs):
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"tuneboard train into {d} failed:\n{out[-3000:]}"
    return dirs
