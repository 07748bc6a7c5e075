"""TuneBoard web UI: `create_app()` builds the page; `main(argv)` is `tuneboard webui`.

The UI process only builds specs, launches `tuneboard train` processes and tails their run directories:
it never imports torch/transformers/peft/trl/accelerate/datasets (tests/webui/test_import_boundary.py).
"""
from __future__ import annotations

import argparse
import html
import os
import socket
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import gradio as gr  # noqa: E402

from backend.core import allowed, model_files, paths, teacher_access  # noqa: E402
from webui import chat_servers, choices, jobs, page_jobs, tools  # noqa: E402
from webui.form import inputs_of  # noqa: E402
from webui import fields as F  # noqa: E402
from webui.i18n import LANG_NAMES, LANGS, tr  # noqa: E402
from webui.tabs import chat as chat_tab  # noqa: E402
from webui.tabs import data as data_tab  # noqa: E402
from webui.tabs import distill as distill_tab  # noqa: E402
from webui.tabs import evaluate as eval_tab  # noqa: E402
from webui.tabs import export as export_tab  # noqa: E402
from webui.tabs import runs as runs_tab  # noqa: E402
from webui.tabs import train as train_tab  # noqa: E402
from webui.tab_context import TabContext  # noqa: E402
from webui.tailer import run_state  # noqa: E402
from webui.ui import Registry  # noqa: E402
from webui.login import LoginGuard

# The tabs, in page order: (tab id, module). Each module keeps the tab contract (webui/tab_context.py:
# build(ctx) -> dict, wire(ctx, c)); its label is the locale key tab-<id>. A new tab: its module + one line here.
TABS = (
    ("train", train_tab),
    ("runs", runs_tab),
    ("data", data_tab),
    ("distill", distill_tab),
    ("eval", eval_tab),
    ("export", export_tab),
    ("chat", chat_tab),
)

LOGO = paths.ASSETS_DIR / "logo.svg"
CSS_FILE = paths.ASSETS_DIR / "style.css"


def _header_html(tagline: str) -> str:
    """The header; `tagline`: the subtitle in the page's language (locale key tb-header-block)."""
    return (
        '<div id="tb-header">'
        f'<img src="/gradio_api/file={LOGO}" alt="TuneBoard logo">'
        '<div><div class="tb-title">TuneBoard</div>'
        f'<div class="tb-tagline">{html.escape(tagline)}</div></div>'
        "</div>"
    )


# the localStorage key of the page's language (and the BrowserState's secret: its value reaches the page in the
# app's config either way, and a fixed one keeps the choice readable after the UI restarts)
LANG_STORAGE_KEY = "tuneboard-lang"


def restore_lang(saved):
    """A page opens: the top bar's language becomes the one its browser picked last (a gr.BrowserState); no change
    for one it never picked (English) or a value that names no language. Inputs: the stored language. Outputs:
    language."""
    return saved if saved in LANGS and saved != "en" else gr.skip()


# The model box shows its whole value: the bundled model's label ("HuggingFaceTB/SmolLM2-135M-Instruct · bundled
# Q4_1 GGUF") is about 460 px wide; on a narrower page the bar wraps rather than cut it.
MODEL_BOX_MIN_WIDTH = 500


def build_topbar(reg: Registry) -> dict:
    """The bar shared by all tabs: language, model, method, adapter, quantization, template, booster."""
    top: dict = {}
    table = F.rows_by_name()
    with gr.Row(elem_id="tb-topbar", equal_height=True):
        top["lang"] = reg.dropdown("top-lang", list(LANGS), value="en", fixed_labels=LANG_NAMES, scale=1,
                                   min_width=130)
        top["model_name_or_path"] = reg.dropdown(
            "top-model_name_or_path", choices.model_ids(), value=paths.DEFAULT_MODEL_ID,
            fixed_labels={paths.DEFAULT_MODEL_ID: paths.DEFAULT_MODEL_LABEL}, allow_custom_value=True, scale=5,
            min_width=MODEL_BOX_MIN_WIDTH)
        ft = table["finetuning_type"]
        top["finetuning_type"] = reg.dropdown("top-finetuning_type", F.dropdown_ids(ft),
                                              value=F.PRESET["finetuning_type"], scale=1, min_width=115)
        pairs = choices.adapter_pairs()  # run names as labels, the folder as the value
        top["adapter_name_or_path"] = reg.dropdown(
            "top-adapter_name_or_path", [v for _, v in pairs], value="", allow_custom_value=True,
            fixed_labels={v: k for k, v in pairs}, scale=3, min_width=220)
        top["adapter_refresh"] = reg.button("top-adapter_refresh", size="sm", scale=0, min_width=44,
                                            elem_classes=["tb-icon-btn"])
        q = table["quantization_bit"]
        top["quantization_bit"] = reg.dropdown("top-quantization_bit", F.dropdown_ids(q), value=F.NONE_ID,
                                               scale=1, min_width=120)
        top["template"] = reg.dropdown("top-template", choices.template_names(), value="auto",
                                       allow_custom_value=True, scale=1, min_width=130)
        top["booster"] = reg.dropdown("top-booster", list(F.BOOSTERS), value="auto", scale=1, min_width=110)
    top["note"] = gr.Markdown("", elem_id="top-note", elem_classes=["tb-section-note"])
    return top


def wire_topbar(top: dict) -> None:
    def top_note(model, template, lang="en") -> str:
        """The top bar's note for a model and template: the model is not on this machine (validate refuses it at
        Start), a base model's template was set to default, a chat template on a base model."""
        info = choices.model_info(model)
        missing = model_files.model_problem(model or "")  # a registry id not in this machine's cache, a typo
        notes = [tr(lang, "top.model_missing", why=missing)] if missing else []
        if info and not info["instruct"] and template == "default":
            notes.append(tr(lang, "top.base_model", model=model))
        elif info and not info["instruct"] and template not in (None, "empty", "auto"):
            notes.append(tr(lang, "top.chat_on_base", template=template, model=model))
        return " ".join(notes)

    def on_model(model, lang="en"):
        """Picking a known model sets its template (default for a base model); the note says what top_note says.
        Inputs: model, language. Outputs: template, note."""
        info = choices.model_info(model)
        if info is None:
            return gr.skip(), top_note(model, None, lang)
        template = "auto" if info["instruct"] else "default"
        return template, top_note(model, template, lang)

    # .input, not .change: a spec loaded into the form (clone, reload) keeps its own template
    top["model_name_or_path"].input(on_model, [top["model_name_or_path"], top["lang"]],
                                    [top["template"], top["note"]])

    def on_template(model, template, lang="en"):
        """The note again when the template changes (also when on_model set it: the same note, not an empty one).
        Inputs: model, template, language. Outputs: note."""
        return top_note(model, template, lang)

    top["template"].change(on_template, [top["model_name_or_path"], top["template"], top["lang"]], [top["note"]])
    # The adapter list changes as runs finish: re-list on the button (and on every tab switch, in create_app).
    top["adapter_refresh"].click(train_tab.adapter_picker_update, [top["lang"]], [top["adapter_name_or_path"]],
                                 show_progress="hidden")


def create_app() -> gr.Blocks:
    """The whole page. Per-browser state lives in gr.State; durable state in run directories."""
    reg = Registry("en")
    with gr.Blocks(title="TuneBoard") as demo:
        reg.html("tb-header-block", _header_html)
        top = build_topbar(reg)
        state = gr.State(run_state(None))
        ctx = TabContext(reg=reg, top=top, state=state)
        with gr.Tabs(elem_id="tb-tabs") as tabs:
            ctx.tabs = tabs
            for tab_id, module in TABS:
                with reg.tab(f"tab-{tab_id}", id=tab_id) as item:
                    ctx.items[tab_id] = item
                    ctx.comps[tab_id] = module.build(ctx)
        wire_topbar(top)
        for tab_id, module in TABS:
            module.wire(ctx, ctx.comps[tab_id])
        train, distill, evaluate, export = (ctx.tab(t) for t in ("train", "distill", "eval", "export"))

        comps = reg.components()
        top["lang"].change(lambda lang: reg.relabel(lang), [top["lang"]], comps, show_progress="hidden")

        tabs.select(train_tab.adapter_picker_update, [top["lang"]], [top["adapter_name_or_path"]],
                    show_progress="hidden")
        # after the relabel (which leaves the picker's run names alone): its "none" choice in the new language
        top["lang"].change(train_tab.adapter_picker_update, [top["lang"]], [top["adapter_name_or_path"]],
                           show_progress="hidden")

        def on_load(request: gr.Request, st, export_st, eval_st, lang="en"):
            """Re-attach to the newest live run (page reload or UI restart), and the Export and Evaluate tabs
            to their newest job (tools.find_job: running, or ended within the last hour), their messages in the
            browser's language. Inputs: train state, export state, eval state, the stored language. Outputs: train
            state, train timer, then for Export and for Evaluate: state, message, timer. Touches nothing of a
            tab when there is nothing to attach or its state already holds a job: a Start clicked while this
            handler was still on its way must keep its state and running timer (answering "nothing attached,
            timer off" here once raced with Start and left the live view frozen)."""
            train_out = (gr.skip(), gr.skip())
            form = [gr.skip()] * (1 + len(form_inputs))
            if not (st or {}).get("run_dir"):
                run_dir = jobs.find_active_run()
                if run_dir is not None:
                    train_out = (train_tab.attach(run_dir), gr.Timer(active=True))
                    message, values = train_tab.attached_form(run_dir, lang)
                    form = [message, *(values or [gr.skip()] * len(form_inputs))]
            return (*train_out, *form,
                    *reattach_tool(export_tab, "export", (export_st or {}).get("job"), request, lang),
                    *reattach_tool(eval_tab, "eval", (eval_st or {}).get("parts"), request, lang))

        # the page's language, kept in the browser's localStorage (outside the tabs, as the Chat tab's browser id
        # below): a pick is stored; a page that opens sets the top bar's dropdown to it, and that change relabels
        # the page as a switch by hand does (the top["lang"].change handlers). The re-attach handlers below read it
        # too: they run beside that change, before the dropdown holds it. A first visit stores nothing: English.
        saved_lang = gr.BrowserState("en", storage_key=LANG_STORAGE_KEY, secret=LANG_STORAGE_KEY)
        top["lang"].input(lambda lang: lang, [top["lang"]], [saved_lang], show_progress="hidden")
        demo.load(restore_lang, [saved_lang], [top["lang"]], show_progress="hidden")
        # the form's inputs, in train_tab.spec_to_inputs order: top bar, booster, extra args, form fields
        form_inputs = inputs_of(top, train)
        demo.load(distill_tab.on_load, [distill["state"], saved_lang],
                  [distill["state"], distill["message"], distill["timer"]])
        demo.load(on_load, [state, export["state"], evaluate["state"], saved_lang],
                  [state, train["timer"], train["message"], *form_inputs, export["state"], export["message"],
                   export["timer"], evaluate["state"], evaluate["message"], evaluate["timer"]])
        # the Chat tab's server outlives a page reload (webui/chat_servers.py): the browser's id, kept in its
        # localStorage, lives outside the tabs (a tab renders when first opened; until then, none of its
        # components reads or writes the browser's storage); no concurrency limit: a page waiting for its
        # browser's server to load holds up no other page
        chat, browser = ctx.tab("chat"), gr.BrowserState("", storage_key=chat_servers.STORAGE_KEY)
        demo.load(chat_tab.reattach, [browser, chat["state"], saved_lang],
                  [browser, chat["state"], chat["status"], chat["compare"], chat["compare_with"], chat["llamacpp"],
                   chat["chat_a"], chat["chat_b"]], concurrency_limit=None)
        demo.unload(chat_tab.page_closed)
    demo.tb_registry = reg  # for tests: the locale keys this page uses
    return demo


def reattach_tool(tab, kind: str, busy, request=None, lang: str = "en") -> tuple:
    """(state, message, timer) that re-attach an Export/Evaluate tab (`tab`: its module) to the job
    tools.find_job(kind) picks, the message in `lang`; three skips when `busy` (the tab's state already holds
    a job), when there is no job to attach, or when a Start on the page got there first (webui.page_jobs)."""
    skip = (gr.skip(), gr.skip(), gr.skip())
    if busy:
        return skip
    job = tools.find_job(kind)
    if job is None:
        return skip
    st = tab.attach(job)
    if not (st.get("job") or st.get("parts")):
        return skip
    if not page_jobs.show(kind, request, page_jobs.job_of(st), first=True):
        return skip
    return st, tab.attached_message(st, lang), gr.Timer(active=True)


# The log boxes (class tb-log) follow their end as lines arrive, unless the user scrolled up to read: the
# Textbox's own autoscroll left them at the top when the whole value is replaced on each tick.
FOLLOW_LOGS_JS = """<script>
setInterval(() => {
  for (const t of document.querySelectorAll('.tb-log textarea')) {
    if (!t.dataset.tbFollow) {
      t.dataset.tbFollow = '1';
      t.addEventListener('scroll', () => {
        if (!t._tbScrolling) t._tbAtEnd = t.scrollHeight - t.scrollTop - t.clientHeight < 30;
        t._tbScrolling = false;
      });
    }
    if (t.value.length !== t._tbLength) {
      t._tbLength = t.value.length;
      if (t._tbAtEnd !== false) { t._tbScrolling = true; t.scrollTop = t.scrollHeight; }
    }
  }
}, 400);
</script>"""


LOGIN_NOTE = ("After {n} wrong logins from one address, that address has to wait {minutes} minutes "
              "before it can try again.")


DEFAULT_MAX_UPLOAD = "2gb"


def launch_kwargs(login: dict | None = None, max_upload: str | int = DEFAULT_MAX_UPLOAD) -> dict:
    """What `launch()` needs besides host/port (Gradio 6 takes theme/css/head at launch time). The login
    guard (webui/login.py: back-off, lockout, API names kept behind the login) acts only when `auth` is set;
    `login`: its settings (LoginGuard's keyword arguments). `max_upload`: the largest file an upload may be
    (Gradio's max_file_size: "2gb", "500mb", or bytes); a bigger one is refused with HTTP 413 naming the
    limit, before it fills the disk, and the page shows Gradio's "exceeded the maximum file size" note."""
    from starlette.middleware import Middleware  # heavy: loaded on use, so importing this module stays light


    login = dict(login or {})
    note = LOGIN_NOTE.format(n=login.get("max_failures", 5), minutes=round(login.get("lockout_s", 300) / 60, 1))
    return {"css_paths": [CSS_FILE], "allowed_paths": [str(paths.ASSETS_DIR)], "favicon_path": str(LOGO),
            "theme": gr.themes.Soft(primary_hue="indigo", secondary_hue="sky"),
            "footer_links": [], "head": FOLLOW_LOGS_JS, "auth_message": note, "max_file_size": max_upload,
            "app_kwargs": {"middleware": [Middleware(LoginGuard, **login)]}}


# ------------------------------------------------------------------ command line

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tuneboard webui", description="Serve the TuneBoard web UI.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port; the next free one is used if it is taken")
    p.add_argument("--auth", help="USER:PASS required to open the page")
    p.add_argument("--auth-file", help="file with one USER:PASS per line")
    p.add_argument("--root-path", default=None, help="URL prefix when served behind a reverse proxy")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without a login (anyone on the network can train)")
    p.add_argument("--max-concurrent", type=int, default=None, help="runs allowed at once (queue setting)")
    p.add_argument("--allow-path", action="append", default=[], metavar="DIR",
                   help="a folder the UI may read and write besides data/, saves/, the cache and examples/ "
                        "(repeatable; also $TUNEBOARD_ALLOW_PATHS, folders separated by ':')")
    p.add_argument("--teacher-key-env", action="append", default=[], metavar="NAME=BASE_URL",
                   help="offer the API key in $NAME to the Distill tab, for the teacher at BASE_URL only (repeatable; "
                        "the page may name no other environment variable)")
    p.add_argument("--allow-teacher-url", action="append", default=[], metavar="URL",
                   help="let the Distill tab use this teacher base URL even on a loopback, link-local or private "
                        "address (repeatable; refused by default)")
    p.add_argument("--login-max-failures", type=int, default=5,
                   help="with --auth: wrong logins from one address before it is locked out (default 5)")
    p.add_argument("--login-lockout", type=float, default=300.0, metavar="SECONDS",
                   help="with --auth: how long a locked-out address waits (default 300 s)")
    p.add_argument("--allow-code", action="store_true",
                   help="let the page run code it names: reward functions from .py files under the allowed folders "
                        "and trust_remote_code (off by default: whoever can log in could run anything as this "
                        "user; SECURITY.md)")
    p.add_argument("--max-upload", type=upload_size, default=DEFAULT_MAX_UPLOAD, metavar="SIZE",
                   help="largest file the page accepts as an upload, e.g. 500mb, 2gb (default 2gb)")
    return p.parse_args(argv)


def upload_size(text: str) -> str:
    """`--max-upload`'s value: a positive number with a unit of b, kb, mb, gb or tb (case and spaces ignored)."""
    size = text.replace(" ", "").lower()
    digits = size.rstrip("bkmgt")
    if not digits.isdigit() or int(digits) <= 0 or size[len(digits):] not in ("b", "kb", "mb", "gb", "tb"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500mb or 2gb (units b, kb, mb, gb, tb)")
    return size


def read_auth(opts) -> list[tuple[str, str]]:
    pairs = []
    if opts.auth:
        pairs.append(_split_auth(opts.auth, "--auth"))
    if opts.auth_file:
        with open(opts.auth_file, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip() and not line.lstrip().startswith("#"):
                    pairs.append(_split_auth(line.strip(), f"{opts.auth_file} line {n}"))
    return pairs


def _split_auth(text: str, where: str) -> tuple[str, str]:
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise SystemExit(f"error: {where}: expected USER:PASS")
    return user, password


def free_port(host: str, start: int, tries: int = 100) -> int:
    for port in range(start, start + tries):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    raise SystemExit(f"error: no free port in {start}..{start + tries - 1} on {host}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    auth = read_auth(opts)
    if opts.host not in LOOPBACK and not auth and not opts.insecure_no_auth:
        print(f"error: refusing to serve on {opts.host} without a login: anyone who can reach this machine "
              "could run jobs on it. Add --auth USER:PASS (or --auth-file F), or pass --insecure-no-auth "
              "if you really mean it.", file=sys.stderr)
        return 2
    for d in opts.allow_path:
        if not os.path.isdir(os.path.expanduser(d)):
            print(f"error: --allow-path {d}: no such folder", file=sys.stderr)
            return 2
    allowed.add_roots([os.path.abspath(os.path.expanduser(d)) for d in opts.allow_path])  # from the shell's folder
    try:  # the operator's teacher keys and URLs, in env vars the UI's subprocesses inherit (backend.core.teacher_access)
        teacher_access.configure(opts.teacher_key_env, opts.allow_teacher_url)
    except ValueError as exc:
        print(f"error: --teacher-key-env / --allow-teacher-url: {exc}", file=sys.stderr)
        return 2
    allowed.set_code_policy(opts.allow_code)
    port = free_port(opts.host, opts.port)
    if port != opts.port:
        print(f"port {opts.port} is taken: using {port}", flush=True)
    if opts.max_concurrent:
        jobs.JobQueue().set_max_concurrent(opts.max_concurrent)
    worker = jobs.QueueWorker().start()
    demo = create_app()
    print(f"TuneBoard: http://{opts.host}:{port}{opts.root_path or ''}/", flush=True)
    print("Allowed folders: " + allowed.roots_text(allowed.roots()), flush=True)
    keys = teacher_access.offered_keys()
    print("Teacher keys offered to the page: " + (", ".join(f"${n} -> {u}" for n, u in keys.items()) or
                                                  "none (--teacher-key-env NAME=BASE_URL)"), flush=True)
    print("Code from the page: " + ("reward .py files under the allowed folders, trust_remote_code (--allow-code)"
                                    if opts.allow_code else "off (built-in rewards only; --allow-code turns it on)"),
          flush=True)
    try:
        demo.launch(server_name=opts.host, server_port=port, auth=auth or None, root_path=opts.root_path,
                    show_error=True, **launch_kwargs({"max_failures": opts.login_max_failures,
                                                      "lockout_s": opts.login_lockout}, opts.max_upload))
    finally:
        worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
