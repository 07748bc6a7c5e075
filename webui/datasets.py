"""Dataset preview and registration for the Data tab, without importing `datasets` in the UI process:
rendering goes through `tuneboard preview --json` subprocesses (the same code that trains), and the
registration writes dataset_info.json with a validating, atomic, pure-JSON writer."""
from __future__ import annotations

import csv
import html
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from backend.core import allowed, dataset_info, paths
from backend.core.dataset_info import FORMATTINGS, NAME_RE, DatasetError
from webui import jobs
from webui.i18n import refusal, tr
import yaml

FORMATS = FORMATTINGS  # the backend's list (backend.core.dataset_info)
COLUMN_KEYS = ("prompt", "query", "response", "history", "system", "messages", "tools")
SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")


class RegisterError(ValueError):
    pass


def preview_args(dataset, index, top_vals, cutoff, dataset_dir) -> list[str]:
    """`tuneboard preview` arguments for one row; `top_vals`: (model, template)."""
    model, template = top_vals
    args = ["--dataset", dataset, "--index", str(int(index or 0)), "--template", template or "auto",
            "--model", model or paths.DEFAULT_MODEL_ID, "--cutoff-len", str(int(cutoff or 1024))]
    if dataset_dir:
        args += ["--dataset-dir", dataset_dir]
    return args


def dir_refusal(dataset_dir, lang: str = "en", write: bool = False, model: str | None = None) -> str:
    """"" when the dataset folder may be read (written: `write`), else the refusal in `lang` (the folder,
    the allowed roots): its dataset_info.json and the files it names would be shown on the page. `model`:
    the tokenizer's model, checked as backend.core.allowed.check_model says (the preview's errors are shown)."""
    try:
        if (dataset_dir or "").strip():
            (allowed.check_write if write else allowed.check_read)(dataset_dir, "dataset_dir")
        allowed.check_model(model, "model_name_or_path")
    except allowed.PathRefused as exc:
        return refusal(lang, exc)
    return ""



def run_preview(args: list[str], timeout: float = 300) -> dict:
    """`tuneboard preview ... --json` -> its JSON (or {"error": ...})."""
    argv = jobs.tuneboard_argv() + ["preview", *args, "--json"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(paths.REPO_ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"preview took longer than {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")]
    if lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": "\n".join(tail) or f"preview exited with {proc.returncode}"}


def render_segments(segments: list[dict], elem_id: str | None = "data-rendered") -> str:
    """Trained spans in colour, masked spans dim, as HTML (escaped)."""
    out = []
    for s in segments:
        cls = "tb-trained" if s.get("trained") else "tb-masked"
        out.append(f'<span class="{cls}">{html.escape(s.get("text", ""))}</span>')
    id_attr = f' id="{elem_id}"' if elem_id else ""
    return f'<div class="tb-preview-text"{id_attr}>' + "".join(out) + "</div>"


_PART_LABEL = 'style="font-weight:600;font-size:0.85rem;margin:2px 0 4px"'
_TAG_STYLE = {"desirable": "background:rgba(22,163,74,.15);color:#15803d",
              "undesirable": "background:rgba(220,38,38,.12);color:#b91c1c"}


def _part(part: dict, name: str, label: str, lang: str = "en") -> str:
    tokens = tr(lang, "data.n_tokens", n=part.get("num_tokens", "?"))
    return (f'<div class="tb-pref-part" data-part="{name}"><div class="tb-pref-label" {_PART_LABEL}>'
            f'{html.escape(label)} · {html.escape(tokens)}</div>'
            f'{render_segments(part.get("segments") or [], elem_id=None)}</div>')


def render_row(row: dict, lang: str = "en") -> str:
    """One previewed row as HTML, by its kind: a conversation (trained spans in colour); a ranking pair as
    its prompt once, then the chosen and the rejected answer side by side; a KTO row with its tag. Labels
    in `lang`."""

    kind = row.get("kind")
    if kind == "ranking":
        answers = (_part(row["chosen"], "chosen", tr(lang, "data.chosen"), lang)
                   + _part(row["rejected"], "rejected", tr(lang, "data.rejected"), lang))
        return ('<div class="tb-pref" data-kind="ranking" style="display:flex;flex-direction:column;gap:8px">'
                + _part(row["prompt"], "prompt", tr(lang, "data.prompt_once"), lang)
                + '<div style="display:grid;grid-template-columns:repeat(auto-fit,minmax(240px,1fr));gap:8px">'
                + answers + "</div></div>")
    body = render_segments(row.get("segments") or [])
    if kind == "kto":
        tag = row.get("tag") or ("desirable" if row.get("kto_tag") else "undesirable")
        badge = (f'<span class="tb-kto-tag" data-tag="{tag}" style="{_TAG_STYLE.get(tag, "")};padding:1px 8px;'
                 f'border-radius:10px;font-size:0.85rem;font-weight:600">{"✓" if tag == "desirable" else "✗"} '
                 f'{tag}</span>')
        return (f'<div class="tb-pref" data-kind="kto"><div {_PART_LABEL}>{html.escape(tr(lang, "data.kto_label"))} '
                f'{badge}</div>{body}</div>')
    return body


def template_system_prompt(row: dict) -> str | None:
    """The default system prompt of a template (templates/*.yaml: default_system) when a previewed row's
    rendered text holds it: the template put it there, the row had none (smollm2's "... named SmolLM" on
    identity rows that teach another name)."""

    texts = [s.get("text", "") for s in row.get("segments") or []]
    for part in ("prompt", "chosen"):
        texts += [s.get("text", "") for s in (row.get(part) or {}).get("segments") or []]
    text = "".join(texts)
    for path in sorted(paths.TEMPLATES_DIR.glob("*.yaml")):
        try:
            system = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("default_system")
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(system, str) and system.strip() and system in text:
            return system
    return None


def row_summary(row: dict, lang: str = "en") -> str:
    parts = ["**" + tr(lang, "data.row_title", source=row.get("source", ""), row=row.get("row", "")) + "**"]
    if row.get("kind") == "ranking":
        parts.append(tr(lang, "data.pair_tokens", prompt=row["prompt"]["num_tokens"], chosen=row["chosen"]["num_tokens"],
                        rejected=row["rejected"]["num_tokens"], trained=row.get("num_trained", 0)))
    elif row.get("num_tokens") is not None:
        parts.append(tr(lang, "data.row_tokens", n=row["num_tokens"], trained=row.get("num_trained", 0)))
    if row.get("kind") == "kto":
        parts.append(row.get("tag", ""))
    if row.get("truncated"):
        parts.append("⚠ " + tr(lang, "data.row_truncated"))
    if row.get("num_trained") == 0:
        parts.append("⚠ " + tr(lang, "data.row_untrained"))
    return " · ".join(parts)


# ------------------------------------------------------------------ reading a file to register

def read_rows(path: Path, limit: int = 5) -> list[dict]:
    """First rows of a JSON / JSONL / CSV / Parquet file, to check the column mapping. Text is read as utf-8-sig: a
    byte order mark (Excel's "CSV UTF-8") is not part of the first column's name, as the backend reads it."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8-sig"))
        if not isinstance(data, list):
            raise RegisterError(f"{path.name}: a JSON dataset must be a list of rows")
        return data[:limit]
    if suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8-sig") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise RegisterError(f"{path.name} line {n}: bad JSON ({exc.msg})") from None
                if len(rows) >= limit:
                    break
        return rows
    if suffix == ".csv":
        with open(path, encoding="utf-8-sig", newline="") as fh:
            return [row for _, row in zip(range(limit), csv.DictReader(fh))]
    if suffix == ".parquet":
        import pandas as pd  # already loaded by gradio; pyarrow does the reading

        return pd.read_parquet(path).head(limit).to_dict("records")
    raise RegisterError(f"{path.name}: unsupported file type (use {', '.join(SUFFIXES)})")


def make_entry(file_name: str, formatting: str, columns: dict) -> dict:
    entry: dict = {"file_name": file_name}
    if formatting != "alpaca":
        entry["formatting"] = formatting
    cols = {k: v.strip() for k, v in columns.items() if v and v.strip()}
    if cols:
        entry["columns"] = cols
    return entry


def check_entry(name: str, path: Path, formatting: str, columns: dict, existing: dict) -> list[dict]:
    """Validates a new entry; returns the first rows. Raises RegisterError naming the problem."""
    if not name or not NAME_RE.match(name):
        raise RegisterError("name: use letters, digits, '_', '-', '.' (e.g. my_data)")
    if name in existing:
        raise RegisterError(f"name: '{name}' is already registered in dataset_info.json")
    if formatting not in FORMATS:
        raise RegisterError(f"formatting: must be one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise RegisterError(f"file: {path} does not exist")
    rows = read_rows(path)
    if not rows:
        raise RegisterError(f"{path.name}: no rows")
    defaults = ({"prompt": "instruction", "query": "input", "response": "output"} if formatting == "alpaca"
                else {"messages": "conversations" if formatting == "sharegpt" else "messages"})
    wanted = {**defaults, **{k: v.strip() for k, v in columns.items() if v and v.strip()}}
    keys = set().union(*(r.keys() for r in rows if isinstance(r, dict)))
    required = ("prompt", "response") if formatting == "alpaca" else ("messages",)
    for key in required:
        if wanted[key] not in keys:
            raise RegisterError(f"columns.{key}: column '{wanted[key]}' is not in the file "
                                f"(columns: {', '.join(sorted(keys))})")
    for key, col in wanted.items():
        if key not in required and key in columns and columns[key] and col not in keys:
            raise RegisterError(f"columns.{key}: column '{col}' is not in the file")
    return rows


def stage_file(src: Path, name: str, data_dir: Path) -> str:
    """Copies an uploaded file into the dataset folder (never overwriting); returns its file_name."""
    dest = data_dir / f"{name}{src.suffix.lower()}"
    n = 1
    while dest.exists():
        n += 1
        dest = data_dir / f"{name}_{n}{src.suffix.lower()}"
    shutil.copyfile(src, dest)
    return dest.name


def preview_entry(name: str, entry: dict, count: int = 3) -> dict:
    """Renders the first rows of an unsaved entry through the real backend: a temporary dataset_info.json
    pointing at the file by absolute path."""
    with tempfile.TemporaryDirectory(prefix="tb-register-") as tmp:
        (Path(tmp) / "dataset_info.json").write_text(json.dumps({name: entry}), encoding="utf-8")
        return run_preview(["--dataset", name, "--dataset-dir", tmp, "--count", str(count)])


def write_entry(name: str, entry: dict, data_dir: Path | None = None) -> Path:
    """Adds one entry to dataset_info.json through the backend's one writer (backend.core.dataset_info.write_entry:
    re-read, refuse duplicates, atomic replace; a malformed existing file is an error, never overwritten)."""
    try:
        return dataset_info.write_entry(Path(data_dir or paths.DATA_DIR), name, entry)
    except DatasetError as exc:
        raise RegisterError(str(exc)) from None


# ------------------------------------------------------------------ which datasets fit a stage (the Train form)

# The dataset kinds (backend.stages.DATA_KINDS) each stage's data kind can train on, best first. The stage's
# kind comes from its declaration in backend/stages; a dataset's kind from its dataset_info.json entry
# (entry_kind), as `validate` reads it: a ranking set only for ranking stages, a kto_tag column for kto.
ACCEPTS: dict[str, tuple[str, ...]] = {
    "text": ("text", "plain"),   # pt: a raw-text corpus, or any conversation read as text
    "plain": ("plain",),         # sft: conversations / instructions with answers
    "ranking": ("ranking",),     # rm, dpo, orpo, simpo: prompt + chosen + rejected
    "kto": ("kto",),             # kto: conversations tagged desirable / undesirable
    "prompts": ("plain", "text"),  # grpo: prompts (an answer, when there is one, is the reward's reference)
}


def entry_kind(entry) -> str:
    """The data kind of one dataset_info.json entry: "ranking" (chosen / rejected pairs), "kto" (a kto_tag
    column), "text" (an alpaca entry with only a text column, e.g. c4_demo's {"prompt": "text"}) or "plain"."""
    if not isinstance(entry, dict):
        return "plain"
    columns = entry.get("columns") if isinstance(entry.get("columns"), dict) else {}
    if entry.get("ranking") is True:
        return "ranking"
    if "kto_tag" in columns:
        return "kto"
    if entry.get("formatting", "alpaca") == "alpaca" and ("prompt" in columns or "text" in columns) \
            and not {"response", "query", "history", "messages"} & set(columns):
        return "text"
    return "plain"


def stage_data_kind(stage: str | None) -> str | None:
    """The data kind a stage declares (backend/stages), None for an unknown stage."""
    from backend.stages import get_stage  # light: the declarations only

    try:
        return get_stage(stage or "sft").data
    except KeyError:
        return None


def fitting_datasets(stage: str | None, info: dict) -> list[str]:
    """The names of `info` (a dataset_info.json mapping) a stage can train on: its best kind first, then in
    file order. Every name of `info` for an unknown stage."""
    kind = stage_data_kind(stage)
    if kind is None:
        return list(info)
    accepted = ACCEPTS.get(kind, (kind,))
    kinds = {name: entry_kind(entry) for name, entry in info.items()}
    return [n for k in accepted for n, nk in kinds.items() if nk == k]


def fit_dataset(stage: str | None, current: str | None, info: dict) -> tuple[str, list[str]]:
    """The dataset value to keep after a stage change: (new value, the names that did not fit). The names of
    `current` (comma-separated) that `info` registers with a kind the stage cannot use are dropped; names it
    does not know are kept (a set registered later, or another dataset_dir: validate names them). When nothing
    is left, the stage's first fitting set. ("" when none fits; the value unchanged when all fit.)"""
    names = [n.strip() for n in str(current or "").split(",") if n.strip()]
    fitting = fitting_datasets(stage, info)
    misfits = [n for n in names if n in info and n not in fitting]
    if not misfits:
        return str(current or ""), []
    kept = [n for n in names if n not in misfits]
    return ",".join(kept) if kept else (fitting[0] if fitting else ""), misfits
