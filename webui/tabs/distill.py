"""Distill tab: documents (a folder or uploaded files) + a task (instruction, JSON Schema, examples) + a
teacher (a `tuneboard api` started for the run, or any OpenAI-compatible endpoint) -> Generate: a
`tuneboard distill` subprocess (webui/tools.py jobs, like Export and Evaluate) whose progress.json this tab
polls: progress bar, accepted / rejected by reason, tokens, ETA, the latest pairs; Abort. The dataset is
registered when it ends; "Fine-tune on it" fills the Train form; "Score" runs step score (the student, base
and the top bar's adapter, against the teacher on the held-out chunks) and shows distill_report.json.
The third teacher, "from a local teacher model (logits)", generates no pairs: its button fills the Train form
with a stage kd run (backend/stages/kd.py) of the top bar's model from that teacher model / adapter.

The API key never passes through the page: the form names the environment variable (or the file) that holds
it, and the subprocess reads it. The variable must be one the server's operator offers for that very base URL
(`tuneboard webui --teacher-key-env NAME=BASE_URL`), a key file must lie in the allowed folders, and a URL on
an internal address needs `--allow-teacher-url` (backend.core.teacher_access; checked before launch, again in
the subprocess). The run folder is saves/distill/<dataset name>, so generating again with
the same name and settings resumes from its cache. Per-browser state (gr.State): {"job", "out", "kind",
"log", "lines"}. build() lays out; wire() binds.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import gradio as gr
import pandas as pd
import yaml

from backend.core import allowed, paths, teacher_access
from backend.distill import REASONS, SPEC_FILE, TRAIN_DIRNAME, read_progress, read_report, report_rows
from backend.distill.documents import SUFFIXES
from backend.core.methods import METHODS
from backend.core.rundir import DISTILL_REPORT_FILE, STATUS_FILE, stamp, unique_dir
from webui import jobs, page_jobs, tools
from webui.fields import TOPBAR_FIELDS
from webui.form import inputs_of, spec_to_inputs
from webui.i18n import has, headers, refusal, tr
from webui.tailer import job_log
from backend.distill.spec import DistillSpecError, validate_distill
from backend.distill.pipeline import train_overrides
from backend.core.spec import SpecError, validate_spec
from webui import choices

TICK_S = 1.0
LOG_LINES = 200
PAIR_COLUMNS = ["chunk", "split", "result", "prompt", "answer"]
SCORE_COLUMNS = ["metric", "base", "tuned"]
UPLOADS_DIRNAME = "distill-uploads"
NUMBERS = {  # spec key -> (default, step); the bounds are the distill spec's (it names the key it refuses)
    "cutoff_len": (1024, 64), "answer_tokens": (256, 16), "chunk_overlap": (64, 8),
    "eval_ratio": (0.2, 0.05), "concurrency": (4, 1), "request_timeout": (120, 10),
    "max_retries": (3, 1), "max_requests": (0, 10), "temperature": (0.0, 0.1),
}


def empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame([], columns=columns)


def new_state() -> dict:
    return {"job": None, "out": None, "kind": None, "log": None, "lines": []}


def build(ctx) -> dict:
    reg = ctx.reg
    c: dict = {}
    c["intro"] = reg.markdown("distill-intro", elem_classes=["tb-section-note"])
    with gr.Row():
        c["documents"] = reg.comp(gr.Textbox, "distill-documents", value="", scale=3,
                                  placeholder="a folder of .txt .md .html .pdf .jsonl files")
        c["upload"] = reg.comp(gr.File, "distill-upload", file_count="multiple", type="filepath",
                               file_types=list(SUFFIXES), scale=2)
        c["text_column"] = reg.comp(gr.Textbox, "distill-text_column", value="text", scale=1)
    with gr.Row():
        c["task"] = reg.comp(gr.Textbox, "distill-task", lines=3, scale=3,
                             value="Extract the product name, its price and its colors from the text as JSON.")
        c["schema"] = reg.comp(gr.Code, "distill-schema", language="json", scale=3, value="")
    with gr.Row():
        c["answer_format"] = reg.dropdown("distill-answer_format", ["json", "text"], value="json", scale=1)
        c["examples"] = reg.comp(gr.Textbox, "distill-examples", lines=2, scale=3, value="",
                                 placeholder='[{"input": "...", "output": {...}}]')
    with gr.Row(equal_height=True):
        c["teacher"] = reg.dropdown("distill-teacher", ["local", "endpoint", "logits"], value="local", scale=1)
        c["teacher_local_model"] = reg.comp(gr.Textbox, "distill-teacher_local_model", value="", scale=2,
                                            placeholder="empty = the student (the model in the top bar)")
        c["teacher_local_adapter"] = reg.comp(gr.Textbox, "distill-teacher_local_adapter", value="", scale=2,
                                              placeholder="optional: an adapter folder served on the teacher model")
        c["teacher_url"] = reg.comp(gr.Textbox, "distill-teacher_url", value="", scale=2, visible=False,
                                    placeholder="https://api.openai.com/v1")
        c["teacher_model"] = reg.comp(gr.Textbox, "distill-teacher_model", value="", scale=1, visible=False)
        offered = list(teacher_access.offered_keys())  # the operator's --teacher-key-env names
        c["key_env"] = reg.comp(gr.Textbox, "distill-key_env", value=offered[0] if offered else "", scale=1,
                                visible=False)
        c["key_file"] = reg.comp(gr.Textbox, "distill-key_file", value="", scale=1, visible=False)
    with gr.Row():
        c["dataset_name"] = reg.comp(gr.Textbox, "distill-dataset_name", value="distilled", scale=1)
        c["dataset_dir"] = reg.comp(gr.Textbox, "distill-dataset_dir", value=str(paths.DATA_DIR), scale=2)
    with reg.accordion("distill-group-settings", open=False):
        with gr.Row():
            # no bounds on gr.Number (its refusal is a toast that names no field): the distill spec refuses, naming the key
            c["numbers"] = {k: reg.comp(gr.Number, f"distill-{k}", value=d, step=s, min_width=110)
                            for k, (d, s) in NUMBERS.items()}
    with gr.Row():
        c["start"] = reg.button("distill-start", variant="primary")
        c["abort"] = reg.button("distill-abort", variant="stop")
        c["finetune"] = reg.button("distill-finetune")
        c["score"] = reg.button("distill-score")
        c["kd"] = reg.button("distill-kd", variant="primary", visible=False)
    c["message"] = gr.Markdown("", elem_id="distill-message")
    c["progress"] = gr.HTML(tools.progress_html("idle", 0, None), elem_id="distill-progress")
    c["counts"] = gr.Markdown("", elem_id="distill-counts")
    c["pairs"] = reg.comp(gr.Dataframe, "distill-pairs", value=empty(PAIR_COLUMNS), interactive=False, wrap=True,
                          max_chars=120, max_height=420)
    c["scorecard"] = reg.comp(gr.Dataframe, "distill-scorecard", value=empty(SCORE_COLUMNS), interactive=False)
    with reg.accordion("distill-group-log", open=False):
        c["log"] = reg.comp(gr.Textbox, "distill-log", lines=10, max_lines=10, autoscroll=True, interactive=False,
                            elem_classes=["tb-log"])
    c["state"] = gr.State(new_state())
    c["timer"] = gr.Timer(TICK_S, active=False)
    return c


# ------------------------------------------------------------------ handlers (plain functions)

def stage_uploads(files, root: Path | None = None) -> str | None:
    """Uploaded files (Gradio's temp copies) into a fresh folder saves/distill-uploads/<time>; its path."""
    files = [f for f in (files or []) if f]
    if not files:
        return None
    base = Path(root or paths.saves_dir()) / UPLOADS_DIRNAME
    folder = unique_dir(base / stamp())
    folder.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, folder / Path(f).name)
    return str(folder)


def distill_flat(model, template, documents, text_column, task, schema, answer_format, examples, teacher,
                 teacher_local_model, teacher_local_adapter, teacher_url, teacher_model, key_env, key_file,
                 dataset_name, dataset_dir, *numbers) -> dict:
    """The distill spec of the form (values of the top bar's model and template, this tab's fields; `numbers`
    in NUMBERS order). Empty fields are left out, so the spec's defaults apply."""
    flat: dict = {"documents": (documents or "").strip(), "text_column": (text_column or "").strip() or "text",
                  "task": (task or "").strip(), "answer_format": answer_format or "json",
                  "model_name_or_path": model, "template": template or "auto",
                  "dataset_name": (dataset_name or "").strip() or "distilled"}
    if (schema or "").strip():
        flat["json_schema"] = schema.strip()
    if (examples or "").strip():
        flat["examples"] = examples.strip()
    if (dataset_dir or "").strip():
        flat["dataset_dir"] = dataset_dir.strip()
    if teacher == "endpoint":
        # an empty key variable is no key (not the spec's default OPENAI_API_KEY, which the operator may not offer)
        flat.update(teacher=(teacher_url or "").strip(), teacher_model=(teacher_model or "").strip() or None,
                    teacher_api_key_env=(key_env or "").strip())
        if (key_file or "").strip():
            flat["teacher_api_key_file"] = key_file.strip()
    else:
        flat["teacher"] = "local"
        if (teacher_local_model or "").strip():
            flat["teacher_local_model"] = teacher_local_model.strip()
        if (teacher_local_adapter or "").strip():
            flat["teacher_local_adapter"] = teacher_local_adapter.strip()
    for key, value in zip(NUMBERS, numbers):
        if value not in (None, ""):
            default = NUMBERS[key][0]
            flat[key] = float(value) if isinstance(default, float) else int(value)
    return flat


def check_paths(flat: dict) -> list:
    """The paths the UI lets the job read or write (backend.core.allowed): PathRefused list."""
    refused = []
    checks = [(allowed.check_read, d.strip(), "documents") for d in flat.get("documents", "").split(",") if d.strip()]
    checks += [(allowed.check_write, flat.get("dataset_dir"), "dataset_dir")]
    if flat.get("teacher_api_key_file"):
        checks.append((allowed.check_read, flat["teacher_api_key_file"], "teacher_api_key_file"))
    for check, path, field in checks:
        if path:
            try:
                check(path, field)
            except allowed.PathRefused as exc:
                refused.append(exc)
    for key in ("model_name_or_path", "teacher_local_model", "teacher_local_adapter", "adapter_name_or_path"):
        if flat.get(key):
            try:
                allowed.check_model(flat[key], key)
            except allowed.PathRefused as exc:
                refused.append(exc)
    return refused


def check_teacher(spec) -> list:
    """The teacher the UI lets a validated distill spec's job ask (backend.core.teacher_access: an offered key for
    its own base URL, no internal address unless allowed; the run's own local teacher is fine):
    TeacherRefused list; none for step score alone (it asks no teacher)."""
    if "generate" not in spec.steps:
        return []
    return teacher_access.check_teacher(spec.teacher, spec.teacher_api_key_env, spec.teacher_api_key_file)


def launch(st: dict, flat: dict, kind: str, lang: str = "en") -> tuple[dict, str, bool]:
    """Validate the spec (backend.distill.spec, every error naming its key), the paths and the teacher, then
    start `tuneboard distill` in a job folder. Returns (state, message, started)."""

    if tools.alive((st or {}).get("job")):
        return st, tr(lang, "distill.busy"), False
    refused = check_paths(flat)
    if refused:
        return st, "  \n".join(refusal(lang, exc) for exc in refused), False
    try:
        spec = validate_distill(flat)
    except DistillSpecError as exc:
        return st, "✖ " + "  \n✖ ".join(f"`{k}`: {m}" for k, m in exc.errors), False
    refused = check_teacher(spec)
    if refused:
        return st, "  \n".join(refusal(lang, exc) for exc in refused), False
    out = spec.resolved_output_dir()
    job = tools.new_job_dir("distill")
    tools.start("distill", job, yaml.safe_dump(flat, sort_keys=False, allow_unicode=True))
    st = {"job": str(job), "out": str(out), "kind": kind, "log": None, "lines": [], "watched": True}
    return st, tr(lang, "distill.generating" if kind == "generate" else "distill.scoring", out=out), True


def start_generate(st: dict, flat: dict, uploads=None, lang: str = "en") -> tuple[dict, str, bool]:
    if uploads:
        flat = {**flat, "documents": stage_uploads(uploads)}
    if not flat.get("documents"):
        return st, tr(lang, "distill.no_documents"), False
    return launch(st, {**flat, "steps": "generate"}, "generate", lang)


def run_spec_of(out: str | None):
    """The distill spec a run folder was made with (its distill_spec.yaml), or None."""

    try:
        data = yaml.safe_load((Path(out) / SPEC_FILE).read_text(encoding="utf-8"))
        return validate_distill(data, check_files=False)
    except (OSError, yaml.YAMLError, DistillSpecError, TypeError):
        return None


def start_score(st: dict, adapter: str | None, lang: str = "en") -> tuple[dict, str, bool]:
    """Step score on the run folder of the last generation (the tuned model: the top bar's adapter, else the
    folder's own train/ run)."""
    out = (st or {}).get("out")
    spec = run_spec_of(out)
    if spec is None or not read_progress(out).get("dataset"):
        return st, tr(lang, "distill.score_first"), False
    flat = spec.model_dump(mode="json", exclude_defaults=True)
    flat.update(steps="score", output_dir=str(out))
    adapter = (adapter or "").strip() or None
    if adapter:
        flat["adapter_name_or_path"] = adapter
    return launch(st, flat, "score", lang)




def finetune_spec(st: dict, method: str | None = None, quant=None, lang: str = "en"):
    """(RunSpec for the Train form, message): SFT of the student (the distill run's model) on the distilled
    dataset, cutoff_len from the longest pair (backend.distill.pipeline.train_overrides); (None, why) when
    there is no dataset yet. `method` and `quant` are the top bar's finetuning_type and quantization_bit
    (widget values): LoRA when none is picked, QLoRA when a bit width is picked with LoRA; a bit width with
    freeze or full is left out (QLoRA needs LoRA), and the message says so. The distill spec's own
    train_args, when it has them, win over the top bar."""

    out = (st or {}).get("out")
    spec, dataset = run_spec_of(out), read_progress(out).get("dataset")
    if spec is None or not dataset:
        return None, tr(lang, "distill.finetune_first")
    flat = train_overrides(spec, dataset, Path(out) / TRAIN_DIRNAME)
    flat.pop("overwrite_output_dir", None)
    flat.pop("output_dir", None)
    if "finetuning_type" not in spec.train_args:
        flat["finetuning_type"] = method if method in METHODS else "lora"
    bits = None if quant in (None, "", "none") else int(quant)
    note = ""
    if "quantization_bit" not in spec.train_args and bits is not None:
        if METHODS[flat["finetuning_type"]].quantized_base:
            flat["quantization_bit"] = bits
        else:
            note = tr(lang, "distill.quant_dropped", bits=bits)
    try:
        run_spec = validate_spec(flat, check_files=False)
    except SpecError as exc:
        return None, f"✖ {exc}"
    if run_spec.quantization_bit:
        what = tr(lang, "distill.method.qlora", bits=run_spec.quantization_bit)
    else:
        what = tr(lang, f"distill.method.{run_spec.finetuning_type}")
    return run_spec, tr(lang, "distill.finetune_set", method=what, model=spec.model_name_or_path,
                        dataset=dataset["name"], cutoff_len=flat["cutoff_len"]) + note


def kd_spec(model, teacher_model, teacher_adapter, method=None, quant=None, lang: str = "en"):
    """(RunSpec for the Train form, message): stage kd (logit distillation) of the top bar's model from the
    local teacher (its model, empty = the student's, and its adapter), the top bar's method and quantization
    (LoRA by default; QLoRA only with LoRA). (None, why) when neither a teacher model nor an adapter is named."""
    teacher, adapter = (teacher_model or "").strip(), (teacher_adapter or "").strip()
    if not teacher and not adapter:
        return None, tr(lang, "distill.kd_needs_teacher")
    flat = {"model_name_or_path": model, "stage": "kd", "teacher_model_name_or_path": teacher or model,
            "finetuning_type": method if method in METHODS else "lora"}
    if adapter:
        flat["teacher_adapter"] = adapter
    bits = None if quant in (None, "", "none") else int(quant)
    if bits is not None and METHODS[flat["finetuning_type"]].quantized_base:
        flat["quantization_bit"] = bits
    try:
        run_spec = validate_spec(flat, check_files=False)
    except SpecError as exc:
        return None, f"✖ {exc}"
    shown = flat["teacher_model_name_or_path"] + (f" + {adapter}" if adapter else "")
    return run_spec, tr(lang, "distill.kd_set", model=model, teacher=shown)


def attach(job_dir: str | None) -> dict:
    """The tab's state for an existing job folder (a page reload or a UI restart): its tool_spec.yaml says the
    run folder and the step."""

    flat = tools.read_tool_spec(job_dir)
    try:
        spec = validate_distill(flat, check_files=False)
    except DistillSpecError:
        return new_state()
    return {"job": str(job_dir), "out": str(spec.resolved_output_dir()),
            "kind": "score" if spec.steps == ["score"] else "generate", "log": None, "lines": []}


def on_load(request: gr.Request, st, lang: str = "en"):
    """Re-attach to the newest distill job (running, or ended within the hour: tools.find_job) unless this tab
    already holds one or a Start on the page got there first (webui.page_jobs). Inputs: state, language. Outputs:
    state, message, timer."""
    if (st or {}).get("job"):
        return gr.skip(), gr.skip(), gr.skip()
    job = tools.find_job("distill")
    st = attach(job) if job else None
    if not st or not st.get("job") or not page_jobs.show("distill", request, st["job"], first=True):
        return gr.skip(), gr.skip(), gr.skip()
    return st, tr(lang, "distill.reattached", job=Path(job).name), gr.Timer(active=True)


def abort(st: dict, lang: str = "en") -> tuple[dict, str]:
    job = (st or {}).get("job")
    if tools.stop(job, grace_s=20.0):  # in-flight requests get their time to end; answered chunks stay cached
        tools.mark_aborted(job)
        return st, tr(lang, "distill.stopping")
    return st, tr(lang, "distill.nothing_running")


def reason_word(reason: str, lang: str = "en") -> str:
    """A reject reason (backend.distill.REASONS) in `lang`."""
    return tr(lang, f"distill.reason.{reason}") if reason in REASONS else reason


def split_word(split, lang: str = "en") -> str:
    """A pair's split (train, eval) in `lang`."""
    return tr(lang, f"distill.split.{split}") if has(f"distill.split.{split}") else split


def counts_text(p: dict, lang: str = "en") -> str:
    if not p:
        return ""
    rejected = p.get("rejected") or {}
    why = ", ".join(f"{reason_word(r, lang)} {rejected[r]}" for r in REASONS if rejected.get(r))
    parts = [tr(lang, "distill.counts_chunks", documents=p.get("documents", 0), chunks=p.get("chunks", 0),
                train=p.get("train_chunks", 0), eval=p.get("eval_chunks", 0)),
             tr(lang, "distill.counts_accepted", n=p.get("accepted", 0)),
             tr(lang, "distill.counts_rejected", n=sum(rejected.values())) + (f" ({why})" if why else ""),
             tr(lang, "distill.counts_requests", n=p.get("requests", 0)),
             tr(lang, "distill.counts_tokens", n=p.get("prompt_tokens", 0) + p.get("completion_tokens", 0)),
             f"{p.get('elapsed_s', 0):.0f} s"]
    if p.get("eta_s"):
        parts.append(tr(lang, "distill.counts_eta", s=f"{p['eta_s']:.0f}"))
    return " · ".join(parts)


def pairs_frame(p: dict, lang: str = "en") -> pd.DataFrame:
    """The latest pairs (chunk, split, result, prompt, answer), headers, splits and results in `lang` (a reject's
    detail is the validator's own text)."""
    rows = [[r.get("chunk"), split_word(r.get("split"), lang),
             tr(lang, "distill.accepted") if r.get("reason") is None
             else f"✗ {reason_word(r['reason'], lang)}: {r.get('detail', '')}",
             tools.short(r.get("prompt"), 300), tools.short(r.get("answer"), 300)] for r in p.get("latest") or []]
    return headers(lang, pd.DataFrame(rows, columns=PAIR_COLUMNS))


def ended_message(st: dict, status: dict, p: dict, state: str, report: dict | None, lang: str = "en") -> str:
    """The message line once a job has ended: the scorecard, the registered dataset, stopped, or why it failed."""
    if st.get("kind") == "score":
        if report and status.get("state") == "completed":
            return tr(lang, "distill.scorecard", rows=report.get("rows"), path=Path(st["out"]) / DISTILL_REPORT_FILE)
        return f"✗ {status.get('error') or tr(lang, 'distill.no_report')}"
    dataset = p.get("dataset")
    if status.get("state") == "completed" and dataset:
        held = (tr(lang, "distill.held_rows", eval_rows=dataset["eval_rows"], eval_name=dataset.get("eval_name"))
                if dataset.get("eval_rows") else "")
        return tr(lang, "distill.completed", name=dataset.get("name"), train_rows=dataset.get("train_rows"),
                  held=held, dir=dataset.get("dataset_dir"))
    if state == "aborted":
        return tr(lang, "distill.stopped", answered=p.get("answered", 0), to_ask=p.get("to_ask", 0))
    return f"✗ {status.get('error') or p.get('message') or tr(lang, 'distill.no_result')}"


def poll(st: dict, lang: str = "en") -> tuple:
    """One tick: (state, progress html, counts md, pairs df, scorecard df | skip, log, message | skip, timer)."""
    job = (st or {}).get("job")
    if not job:
        return st, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=False)
    log = job_log(st, job, LOG_LINES)
    running = tools.alive(job)
    status = jobs.read_json(Path(st["out"]) / STATUS_FILE) if st.get("out") else {}
    p = read_progress(st.get("out"))
    if st.get("kind") == "score":
        done, total = status.get("step") or 0, status.get("total_steps")
    else:
        done, total = (p.get("answered", 0) + p.get("failed", 0)), p.get("to_ask")
    state = "running" if running else ("aborted" if tools.was_aborted(job) else status.get("state") or "failed")
    bar = tools.progress_html(state, done, total, tr(lang, "distill.bar_scoring" if st.get("kind") == "score"
                                                     else "distill.bar_generating"), lang)
    if running:
        st["watched"] = True  # its end is news: the Data tab may switch to the new dataset (data_tab_target)
        return st, bar, counts_text(p, lang), pairs_frame(p, lang), gr.skip(), log, gr.skip(), gr.Timer(active=True)
    report = read_report(st.get("out")) if st.get("kind") == "score" else None
    card = headers(lang, pd.DataFrame(report_rows(report), columns=SCORE_COLUMNS)) if report else gr.skip()
    message = ended_message(st, status, p, state, report, lang)
    return st, bar, counts_text(p, lang), pairs_frame(p, lang), card, log, message, gr.Timer(active=False)


def data_tab_target(st: dict | None) -> tuple[str, str] | None:
    """(dataset folder, name) the Data tab switches to once a job this page watched has registered its dataset;
    None for a job that had already ended when a reload picked it up: that leaves the user's pick alone."""
    dataset = read_progress((st or {}).get("out")).get("dataset")
    if not dataset or not st.get("watched"):
        return None
    return dataset["dataset_dir"], dataset["name"]


def wire(ctx, c: dict) -> None:
    top, train, tabs, data = ctx.top, ctx.tab("train"), ctx.tabs, ctx.comps.get("data")

    def show_teacher(kind):
        """Local teacher (pairs or logits): its model and adapter; endpoint: URL, model, key variable, key file;
        logits: the kd button instead of Generate, Fine-tune and Score. Inputs: teacher. Outputs: local model,
        local adapter, URL, model, key env, key file, start, finetune, score, kd."""
        local, logits = kind in ("local", "logits"), kind == "logits"
        return (gr.update(visible=local), gr.update(visible=local), *[gr.update(visible=not local)] * 4,
                *[gr.update(visible=not logits)] * 3, gr.update(visible=logits))

    c["teacher"].change(show_teacher, [c["teacher"]], [c["teacher_local_model"], c["teacher_local_adapter"],
                                                        c["teacher_url"], c["teacher_model"], c["key_env"],
                                                        c["key_file"], c["start"], c["finetune"], c["score"],
                                                        c["kd"]], show_progress="hidden")
    form = [top["model_name_or_path"], top["template"], c["documents"], c["text_column"], c["task"], c["schema"],
            c["answer_format"], c["examples"], c["teacher"], c["teacher_local_model"], c["teacher_local_adapter"],
            c["teacher_url"],
            c["teacher_model"], c["key_env"], c["key_file"], c["dataset_name"], c["dataset_dir"],
            *c["numbers"].values()]
    view = [c["state"], c["progress"], c["counts"], c["pairs"], c["scorecard"], c["log"], c["message"], c["timer"]]

    def on_start(st, lang, uploads, *values):
        """Inputs: state, language, uploads, the form. Outputs: message, state, progress, pairs, timer."""
        st, message, started = start_generate(st, distill_flat(*values), uploads, lang)
        if not started:
            return message, st, gr.skip(), gr.skip(), gr.skip()
        return (message, st, tools.progress_html("starting", 0, None, tr(lang, "distill.bar_starting"), lang),
                headers(lang, empty(PAIR_COLUMNS)), gr.Timer(active=True))

    c["start"].click(page_jobs.starting("distill", on_start, 1), [c["state"], top["lang"], c["upload"], *form],
                     [c["message"], c["state"], c["progress"], c["pairs"], c["timer"]])

    def on_score(st, lang, adapter):
        """Inputs: state, language, the top bar's adapter. Outputs: message, state, scorecard, timer."""
        st, message, started = start_score(st, adapter, lang)
        if not started:
            return message, st, gr.skip(), gr.skip()
        return message, st, headers(lang, empty(SCORE_COLUMNS)), gr.Timer(active=True)

    c["score"].click(page_jobs.starting("distill", on_score, 1), [c["state"], top["lang"], top["adapter_name_or_path"]],
                     [c["message"], c["state"], c["scorecard"], c["timer"]])
    c["abort"].click(lambda st, lang: tuple(reversed(abort(st, lang))), [c["state"], top["lang"]],
                     [c["message"], c["state"]])
    c["timer"].tick(page_jobs.ticking("distill", poll, len(view)), [c["state"], top["lang"]], view,
                    show_progress="hidden")

    top_names = list(TOPBAR_FIELDS)
    inputs = inputs_of(top, train)

    def on_finetune(st, method, quant, lang):
        """Fill the Train form for SFT of the student on the distilled dataset (the top bar's method and
        quantization, LoRA by default: finetune_spec). Inputs: state, top bar's method, quantization, language.
        Outputs: message, tabs, the form."""
        spec, message = finetune_spec(st, method, quant, lang)
        if spec is None:
            return (message, gr.skip(), *([gr.skip()] * len(inputs)))
        return (message, gr.Tabs(selected="train"), *spec_to_inputs(spec, top_names, train["names"]))

    c["finetune"].click(on_finetune, [c["state"], top["finetuning_type"], top["quantization_bit"], top["lang"]],
                        [c["message"], tabs, *inputs])

    def on_kd(model, teacher_model, teacher_adapter, method, quant, lang):
        """Fill the Train form for logit distillation from the local teacher (kd_spec). Inputs: the top bar's
        model, the teacher model and adapter, the top bar's method, quantization, language. Outputs: message,
        tabs, the form."""
        spec, message = kd_spec(model, teacher_model, teacher_adapter, method, quant, lang)
        if spec is None:
            return (message, gr.skip(), *([gr.skip()] * len(inputs)))
        return (message, gr.Tabs(selected="train"), *spec_to_inputs(spec, top_names, train["names"]))

    c["kd"].click(on_kd, [top["model_name_or_path"], c["teacher_local_model"], c["teacher_local_adapter"],
                          top["finetuning_type"], top["quantization_bit"], top["lang"]], [c["message"], tabs, *inputs])

    def relabel(st, lang):
        """A language switch: the tables' headers, the counts and the latest pairs in the new language (the
        message line stays until the next one). Inputs: state, language. Outputs: progress, counts, pairs,
        scorecard."""
        out = (st or {}).get("out")
        if not (st or {}).get("job"):
            return (tools.progress_html("idle", 0, None, lang=lang), "", headers(lang, empty(PAIR_COLUMNS)),
                    headers(lang, empty(SCORE_COLUMNS)))
        p = read_progress(out)
        report = read_report(out) if st.get("kind") == "score" else None
        card = headers(lang, pd.DataFrame(report_rows(report), columns=SCORE_COLUMNS)) if report else gr.skip()
        return gr.skip(), counts_text(p, lang), pairs_frame(p, lang), card

    top["lang"].change(relabel, [c["state"], top["lang"]], [c["progress"], c["counts"], c["pairs"], c["scorecard"]],
                       show_progress="hidden")
    if data is not None:
        def to_data_tab(st):
            """Inputs: state. Outputs: data folder, dataset (see data_tab_target)."""
            target = data_tab_target(st)
            if target is None:
                return gr.skip(), gr.skip()
            return target[0], gr.update(choices=choices.dataset_names(target[0]), value=target[1])

        c["message"].change(to_data_tab, [c["state"]], [data["dir"], data["dataset"]], show_progress="hidden")
