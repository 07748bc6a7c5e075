"""`tuneboard lint SPEC.yaml`: what in a run's data would quietly spoil the training, found before Start.

Each finding has a check, a severity (error: the rows train something wrong or nothing; warning: likely a
mistake; info: worth a look), the dataset, its rows and, where one exists, the safe fix that removes them. Rows are
numbered as backend.dataprep.data numbers `_row` (0-based: the index in a JSON list, the non-blank line of a JSONL
file, the data row of a CSV file, counted on across a folder's files), the numbers `tuneboard preview --index` and
the Data tab's Row field take: a row the loader skips opens there too, with the reason it is skipped.
- exact duplicates (the same normalized conversation or text as an earlier row) and near duplicates (MinHash
  over word 3-shingles, datasketch's LSH at Jaccard >= NEAR): fix drop_duplicates keeps the first of each;
- eval rows present in train (the same or near the same as a row of `eval_dataset`, or of the `val_size`
  split): fix drop_leaks drops them from the training data;
- answers cut by cutoff_len (rows, and the share of answer tokens lost) and rows that train no token at all,
  with the run's template, tokenizer and masks (train_on_prompt, mask_history): conversations of the sft kind
  (ranking and KTO rows are not tokenized here; pt documents are split into blocks, never cut);
- empty answers (rows the loader skips): fix drop_empty; other unusable rows, with the loader's reason;
- a chat template on a model that has none (a base model: it has never seen the markers);
- pre-training (pt): a tokenizer without an EOS token (documents would run together: TuneBoard ends every
  document with EOS) and documents that already end with the EOS text (it would be doubled);
- JSON answers that do not parse, in a dataset whose answers are mostly JSON (no dataset declares a schema
  in dataset_info.json, so nothing is checked against one);
- mixed languages: rows whose letters are mostly of another script than most rows' (Latin, Cyrillic, Han, ...).

A fix never edits a data file: it writes <stem>_vN<suffix> next to it without the rows and registers it in
dataset_info.json as <name>_vN (the same entry, the new file), for JSON and JSONL files.

The whole dataset is linted (max_samples is ignored: the file is what a fix rewrites), or its first rows with
--max-rows (the Train tab's pre-flight does, so a big set never holds up Start; fixes need the whole set).

--load-check (the Train tab's pre-flight asks for it) also loads the data as the run will (run_refusal: max_samples,
the val_size split, eval_dataset) and reports the error that would stop the run at once, so Start refuses it
instead of launching a run that fails: JSON key `refused`, exit 1.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backend.core import dataset_versions
from backend.core.dataset_info import DatasetError, read_dataset_info, resolve_dataset_dir
from backend.core.hub_data import hub_key
from backend.dataprep import data
from backend.dataprep.resolve import PLAIN_TEMPLATES
from backend.stages import get_stage

NEAR = 0.8  # Jaccard similarity of word 3-shingles above which two rows are near duplicates
NUM_PERM = 128
FIXES = ("drop_duplicates", "drop_leaks", "drop_empty")
SEVERITIES = ("error", "warning", "info")
MAX_SHOWN = 10  # row numbers printed per finding (the JSON has them all)


@dataclass
class Finding:
    check: str
    severity: str
    dataset: str
    message: str
    rows: list[int] = field(default_factory=list)
    fix: str | None = None

    @property
    def count(self) -> int:
        return len(self.rows)

    def line(self) -> str:
        shown = ", ".join(map(str, self.rows[:MAX_SHOWN])) + (", ..." if len(self.rows) > MAX_SHOWN else "")
        rows = f" (rows {shown})" if self.rows else ""
        fix = f" [fix: {self.fix}]" if self.fix else ""
        where = f" {self.dataset}:" if self.dataset != "-" else ""  # "-": about the model, not a dataset
        return f"{self.severity}: {self.check}:{where} {self.message}{rows}{fix}"


@dataclass
class LintReport:
    datasets: dict[str, int] = field(default_factory=dict)  # name -> rows in its files
    findings: list[Finding] = field(default_factory=list)
    usable: dict[str, int] = field(default_factory=dict)  # name -> rows the loader converts (not in the JSON)

    def to_dict(self) -> dict:
        return {"datasets": self.datasets, "count": len(self.findings),
                "findings": [dict(asdict(f), count=f.count) for f in self.findings]}

    def lines(self) -> list[str]:
        rows = ", ".join(f"{n} ({k} rows)" for n, k in self.datasets.items())
        out = [f.line() for f in self.findings]
        by = Counter(f.severity for f in self.findings)
        summary = ", ".join(f"{by[s]} {s}{'s' if by[s] != 1 else ''}" for s in SEVERITIES if by[s]) or "nothing found"
        return out + [f"{len(self.findings)} findings in {rows}: {summary}"]


# ------------------------------------------------------------------------------------------- rows
@dataclass
class _Data:
    name: str
    files: list[Path]
    examples: list[dict]                      # normalized, with _row
    bad: list[tuple[int, str]]                # rows the loader refuses, with its reason


def _load(name: str, dataset_dir: Path, stage: str, spec, max_rows: int | None = None) -> _Data:
    """Every row of one dataset (or its first max_rows), as the loader converts it; refused rows kept with their
    reason."""
    info = read_dataset_info(dataset_dir)
    entry = info.entry(name)
    espec = data._entry_spec(name, entry)
    data._check_stage(name, espec, stage)
    files = data._data_files(name, entry, dataset_dir, info.path)
    examples, bad = [], []
    for path in files:
        for row in data.read_rows(path, entry.get("split", "train")):
            i = len(examples) + len(bad)  # the dataset's row number (data.dataset_row's): a folder's files count on
            if max_rows is not None and i >= max_rows:
                break
            try:
                example = data.convert_row(row, espec, stage)
            except data.RowError as exc:
                bad.append((i, str(exc)))
                continue
            example = data._fill_identity(example, spec.identity_name, spec.identity_author)
            example["_row"], example["_source"] = i, name
            examples.append(example)
    return _Data(name, files, data.add_default_system(examples, spec.default_system), bad)


def _text(example: dict) -> str:
    if "text" in example:
        return example["text"]
    parts = [f"{m['role']}: {m.get('content') or ''}{json.dumps(m.get('tool_calls')) if m.get('tool_calls') else ''}"
             for m in example.get("messages", [])]
    for key in ("chosen", "rejected"):
        if example.get(key):
            parts.append(f"{key}: {example[key].get('content') or ''}")
    return "\n".join(parts)


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def _shingles(text: str) -> frozenset:
    words = _normal(text).split()
    return frozenset(" ".join(words[i:i + 3]) for i in range(max(len(words) - 2, 1)))


def _minhash(shingles: frozenset):
    from datasketch import MinHash  # heavy-ish (numpy, scipy): only the lint needs it

    m = MinHash(num_perm=NUM_PERM, seed=1)
    m.update_batch([s.encode("utf-8") for s in shingles])
    return m


class _Near:
    """Near-duplicate search: datasketch's MinHash LSH gives candidates (at a threshold below NEAR: the bands
    alone miss a fair share of pairs just above it), each confirmed by the exact Jaccard of the shingle sets."""

    def __init__(self):
        from datasketch import MinHashLSH  # heavy-ish (numpy, scipy): only the lint needs it

        self.lsh, self.sets = MinHashLSH(threshold=NEAR - 0.3, num_perm=NUM_PERM), {}

    def match(self, text: str, add: bool = True) -> bool:
        shingles = _shingles(text)
        m = _minhash(shingles)
        for key in self.lsh.query(m):
            other = self.sets[key]
            if len(shingles & other) / max(len(shingles | other), 1) >= NEAR:
                return True
        if add:
            key = str(len(self.sets))
            self.sets[key] = shingles
            self.lsh.insert(key, m)
        return False


# ------------------------------------------------------------------------------------------- checks
def _duplicates(d: _Data) -> list[Finding]:
    first: dict[str, int] = {}
    exact, near = [], []
    search = _Near()
    for k, example in enumerate(d.examples):
        text = _text(example)
        key = _normal(text)
        if key in first:
            exact.append(example["_row"])
            continue
        first[key] = k
        if search.match(text):
            near.append(example["_row"])
    out = []
    if exact:
        out.append(Finding("duplicates", "warning", d.name, f"{len(exact)} rows repeat an earlier row exactly "
                           "(each is trained twice as often)", exact, "drop_duplicates"))
    if near:
        out.append(Finding("near_duplicates", "warning", d.name, f"{len(near)} rows are near copies of an earlier row "
                           f"(MinHash Jaccard >= {NEAR} over word 3-shingles)", near, "drop_duplicates"))
    return out


def _leaks(train: list[dict], held_out: list[dict], name: str, against: str) -> list[Finding]:
    if not held_out:
        return []
    keys = {_normal(_text(e)) for e in held_out}
    search = _Near()
    for example in held_out:
        search.match(_text(example))
    rows = [e["_row"] for e in train if e.get("_source") == name
            and (_normal(_text(e)) in keys or search.match(_text(e), add=False))]
    if not rows:
        return []
    return [Finding("eval_in_train", "error", name, f"{len(rows)} training rows are (near) copies of {against} rows: "
                    "the evaluation measures memory, not learning", rows, "drop_leaks")]


def _bad_rows(d: _Data) -> list[Finding]:
    empty = [r for r, why in d.bad if why.startswith(("empty answer", "empty response"))]
    other = [(r, why) for r, why in d.bad if r not in set(empty)]
    out = []
    if empty:
        out.append(Finding("empty_answer", "error", d.name, f"{len(empty)} rows have an empty answer (skipped in "
                           "training)", empty, "drop_empty"))
    if other:
        reasons = Counter(why for _, why in other).most_common(2)
        out.append(Finding("unusable_row", "error", d.name, f"{len(other)} rows cannot be used (skipped in training): "
                           + "; ".join(w for w, _ in reasons), [r for r, _ in other]))
    return out


def _tokens(d: _Data, spec, template, tokenizer) -> list[Finding]:
    from backend.dataprep.preprocess import encode_example  # light, but only the token checks need it

    cut_rows, lost, answer, empty, longest = [], 0, 0, [], 0
    for example in d.examples:
        kw = dict(train_on_prompt=spec.train_on_prompt, mask_history=spec.mask_history)
        try:
            full = encode_example(example, template, tokenizer, None, **kw)
        except ValueError:
            continue  # the template refuses the row: the run skips and counts it
        longest = max(longest, len(full.input_ids))
        if full.num_trained == 0:
            empty.append(example["_row"])
            continue
        answer += full.num_trained
        if len(full.input_ids) > spec.cutoff_len:
            kept = encode_example(example, template, tokenizer, spec.cutoff_len, **kw).num_trained
            if kept < full.num_trained:
                cut_rows.append(example["_row"])
                lost += full.num_trained - kept
    out = []
    if cut_rows:
        out.append(Finding("cut_answers", "warning", d.name,
                           f"{len(cut_rows)} of {len(d.examples)} rows ({len(cut_rows) / len(d.examples):.0%}) lose "
                           f"trained tokens to cutoff_len={spec.cutoff_len}: {lost} of {answer} ({lost / answer:.1%}); "
                           f"the longest row has {longest} tokens", cut_rows))
    if empty:
        out.append(Finding("no_trained_token", "error", d.name, f"{len(empty)} rows train no token with template "
                           f"{template.name} (dropped in training)", empty))
    return out


def _template(spec, resolved, tokenizer, warnings: list[str]) -> list[Finding]:
    out = [Finding("template", "warning", "-", w) for w in warnings]
    name = spec.template
    if (name != "auto" and name not in PLAIN_TEMPLATES and not getattr(tokenizer, "chat_template", None)
            and not any("base model" in w for w in warnings)):
        out.append(Finding("template", "warning", "-", f"template {name} is a chat template and "
                           f"{spec.model_name_or_path} has none (a base model): it has never seen these markers; "
                           "fine for teaching a chat format, unexpected otherwise"))
    return out


def _pretraining(d: _Data, tokenizer) -> list[Finding]:
    if tokenizer.eos_token is None:
        return [Finding("pt_eos", "error", d.name, "the tokenizer has no EOS token: the documents would run together "
                        "(TuneBoard ends each document with EOS)")]
    doubled = [e["_row"] for e in d.examples if e["text"].rstrip().endswith(tokenizer.eos_token)]
    if doubled:
        return [Finding("pt_eos", "info", d.name, f"{len(doubled)} documents end with the EOS text "
                        f"{tokenizer.eos_token!r}: TuneBoard adds one, so it is doubled", doubled)]
    return []


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _answer(example: dict) -> str | None:
    if example.get("chosen"):
        return example["chosen"].get("content")
    messages = example.get("messages") or []
    return messages[-1].get("content") if messages and messages[-1].get("role") == "assistant" else None


def _json_answers(d: _Data) -> list[Finding]:
    answers = [(e["_row"], (_answer(e) or "").strip()) for e in d.examples]
    answers = [(r, (_FENCE.match(a).group(1) if _FENCE.match(a) else a)) for r, a in answers if a]
    looks = [(r, a) for r, a in answers if a[:1] in "{["]
    if len(answers) < 2 or len(looks) * 2 < len(answers):
        return []
    bad = []
    for r, a in answers:
        try:
            json.loads(a)
        except ValueError:
            bad.append(r)
    if not bad:
        return []
    return [Finding("bad_json", "error", d.name, f"{len(bad)} answers do not parse as JSON, in a dataset whose "
                    f"answers are JSON ({len(looks)} of {len(answers)})", bad)]


_SCRIPTS = {"HIRAGANA": "Japanese", "KATAKANA": "Japanese", "CJK": "Han", "HANGUL": "Hangul"}


def _script(text: str) -> str | None:
    counts: Counter = Counter()
    for ch in text:
        if ch.isalpha():
            try:
                word = unicodedata.name(ch).split()[0]
            except ValueError:
                continue
            counts[_SCRIPTS.get(word, word.title())] += 1
    if sum(counts.values()) < 3:
        return None
    if counts.get("Japanese") and counts.get("Han"):
        counts["Japanese"] += counts.pop("Han")  # kanji in Japanese text
    return counts.most_common(1)[0][0]


def _languages(d: _Data) -> list[Finding]:
    scripts = {e["_row"]: _script(_text(e).replace("user: ", "").replace("assistant: ", "").replace("system: ", ""))
               for e in d.examples}
    counted = Counter(s for s in scripts.values() if s)
    if len(counted) < 2:
        return []
    main = counted.most_common(1)[0][0]
    rows = [r for r, s in scripts.items() if s and s != main]
    others = ", ".join(f"{s} {n}" for s, n in counted.most_common() if s != main)
    return [Finding("mixed_languages", "info", d.name, f"{len(rows)} rows are mostly in another script ({others}) "
                    f"than most rows ({main} {counted[main]})", rows)]


# ------------------------------------------------------------------------------------------- the lint
def lint(spec, max_rows: int | None = None) -> LintReport:
    """Every check on the spec's `dataset` (and its `eval_dataset` / `val_size` split), with its model's
    tokenizer and template; on the first `max_rows` rows of each dataset when given. Raises DatasetError (one
    line) for data that cannot be read at all."""
    from backend.training.models import load_tokenizer, resolve_model  # heavy: transformers

    dataset_dir = resolve_dataset_dir(spec.resolved_dataset_dir())
    stage = spec.stage
    kind = get_stage(stage).data
    report = LintReport()
    loaded = {n: _load(n, dataset_dir, stage, spec, max_rows) for n in spec.dataset_names}
    evals = {n: _load(n, dataset_dir, stage, spec, max_rows) for n in spec.eval_dataset_names}
    for d in list(loaded.values()) + list(evals.values()):
        report.datasets[d.name] = len(d.examples) + len(d.bad)
        report.usable[d.name] = len(d.examples)

    resolved = resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved, new_special_tokens=spec.new_special_tokens)
    template = None
    if kind != "text":
        warnings: list[str] = []
        template = data_template(spec, resolved, tokenizer, warnings)
        report.findings += _template(spec, resolved, tokenizer, warnings)

    for d in loaded.values():
        report.findings += _bad_rows(d) + _duplicates(d)
        held = [e for v in evals.values() for e in v.examples]
        if held:
            report.findings += _leaks(d.examples, held, d.name, f"eval_dataset {spec.eval_dataset}")
        elif spec.val_size:
            train, val = data.split_train_val(d.examples, spec.val_size, spec.seed)
            report.findings += _leaks(train, val, d.name, "the val_size split's held-out")
        if kind == "text":
            report.findings += _pretraining(d, tokenizer)
        elif kind == "plain":
            report.findings += _tokens(d, spec, template, tokenizer)
        report.findings += _json_answers(d) + _languages(d)
    for d in evals.values():
        report.findings += _bad_rows(d)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    report.findings.sort(key=lambda f: order[f.severity])
    return report


def run_refusal(spec, report: LintReport | None = None, max_rows: int | None = None) -> str | None:
    """The error that stops the run at once on this spec's data, or None: the run's own loading of it
    (backend/stages/base.py train_and_eval_rows: load_examples with max_samples, then the val_size split, and
    eval_dataset), so what it refuses the run would refuse too (a mapped column no row has, no usable row, a
    val_size that leaves no training rows, a missing file or entry). Other errors of the lint (the tokenizer,
    the datasketch package) stop the lint, not the run: they are not this answer.

    Not checked (None) for a streamed run (it reads its data another way), data on a hub (it would be
    downloaded here), nor when `report` (the lint's, on its first `max_rows` rows) saw usable rows of a dataset
    bigger than that which max_samples does not cap: a full pass over a big set would hold up Start."""
    if spec.streaming:
        return None
    try:
        dataset_dir = resolve_dataset_dir(spec.resolved_dataset_dir())
        info = read_dataset_info(dataset_dir)
        for key, names in (("dataset", spec.dataset_names), ("eval_dataset", spec.eval_dataset_names)):
            for name in names:
                if hub_key(_entry(info, name, key)) is not None:  # `org/name` too: info.entry makes one for it
                    return None
        if report is not None and max_rows and not (spec.max_samples and spec.max_samples < max_rows) and any(
                rows >= max_rows and report.usable.get(n) for n, rows in report.datasets.items()):
            return None
        common = dict(stage=spec.stage, max_samples=spec.max_samples, identity_name=spec.identity_name,
                      identity_author=spec.identity_author, seed=spec.seed, default_system=spec.default_system,
                      mix_strategy=spec.mix_strategy, interleave_probs=spec.interleave_probs)
        examples, _ = data.load_examples(spec.dataset, dataset_dir, **common)
        data.split_train_val(examples, spec.val_size, spec.seed)
        if spec.eval_dataset:
            try:
                data.load_examples(spec.eval_dataset, dataset_dir, **common)
            except DatasetError as exc:
                raise DatasetError(f"eval_dataset: {exc}") from None
    except DatasetError as exc:
        return str(exc)
    except (ValueError, OSError):  # not the data's refusal: the run says what it is, if it meets it too
        return None
    return None


def _entry(info, name: str, key: str) -> dict:
    try:
        return info.entry(name)
    except DatasetError as exc:
        raise DatasetError(f"eval_dataset: {exc}" if key == "eval_dataset" else str(exc)) from None


def data_template(spec, resolved, tokenizer, warnings: list[str]):
    from backend.dataprep.resolve import pick_template  # the run's own choice of template

    return pick_template(spec.template, resolved, tokenizer, warn=warnings.append, enable_thinking=spec.enable_thinking)


def apply_fixes(spec, report: LintReport, fixes: list[str]) -> list[str]:
    """Write a new version of each dataset the chosen fixes touch, registered as a new entry; the original
    file and entry are never changed. Returns one line per new version."""
    unknown = [f for f in fixes if f not in FIXES]
    if unknown:
        raise DatasetError(f"--fix: unknown fix {', '.join(unknown)} (known: {', '.join(FIXES)})")
    dataset_dir = resolve_dataset_dir(spec.resolved_dataset_dir())
    drop: dict[str, set[int]] = {}
    for f in report.findings:
        if f.fix in fixes:
            drop.setdefault(f.dataset, set()).update(f.rows)
    lines = []
    for name, rows in drop.items():
        if rows:
            lines.append(_new_version(dataset_dir, name, rows))
    return lines or ["nothing to fix: no finding has one of the fixes " + ", ".join(fixes)]


def _new_version(dataset_dir: Path, name: str, rows: set[int]) -> str:
    """The dataset without `rows`, as a new registered version (backend.core.dataset_versions)."""
    _, path = dataset_versions.local_file(dataset_dir, name)
    kept = [r for i, r in enumerate(dataset_versions.read_rows(path, name)) if i not in rows]
    version = dataset_versions.new_version(dataset_dir, name, kept)
    return (f"{version.name}: {version.path} ({len(kept)} rows; {len(rows)} dropped from {path.name}, which is "
            f"unchanged), registered in {dataset_dir / 'dataset_info.json'}")


def main(args: list[str]) -> int:
    """tuneboard lint SPEC.yaml [key=value ...] [--fix a,b] [--json]: exit 0 when nothing of severity error
    was found, 1 otherwise (or on bad input, one line)."""
    from backend.core.spec import load_or_report  # light, but only the command reads a spec

    p = argparse.ArgumentParser(prog="tuneboard lint", description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="+", help="SPEC.yaml [key=value ...] (dataset, eval_dataset, val_size, model, template, "
                   "cutoff_len, ...)")
    p.add_argument("--fix", default="", help=f"comma-separated safe fixes: {', '.join(FIXES)}")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--max-rows", type=int, default=None, help="lint only the first N rows of each dataset (fast on "
                   "a big set; --fix needs the whole set)")
    p.add_argument("--load-check", action="store_true", help="also load the data as the run will (max_samples, "
                   "val_size, eval_dataset) and report what would stop it at once (JSON key `refused`)")
    opts = p.parse_intermixed_args(args)  # key=value after --json too
    if opts.max_rows is not None and (opts.max_rows < 1 or opts.fix):
        return _fail(opts, "--max-rows: " + ("a fix rewrites the whole dataset: drop --max-rows to fix" if opts.fix
                                             else f"{opts.max_rows} is not a positive number of rows"))
    spec = load_or_report(opts.spec)
    if spec is None:
        return 1
    report, failed = None, None
    try:
        report = lint(spec, opts.max_rows)
        fixed = apply_fixes(spec, report, [f.strip() for f in opts.fix.split(",") if f.strip()]) if opts.fix else []
    except ImportError as exc:
        failed = f"the lint needs the datasketch package ({exc}): pip install -e '.[lint]'"
    except (DatasetError, ValueError, OSError) as exc:
        failed = str(exc)
    # the run's own load, even when the lint could not run (its tokenizer or package may be what failed)
    refused = run_refusal(spec, report, opts.max_rows) if opts.load_check else None
    if failed is not None:
        return _fail(opts, failed, refused)
    if opts.json:
        capped = {"max_rows": opts.max_rows} if opts.max_rows else {}
        print(json.dumps(dict(report.to_dict(), fixed=fixed, **capped, **({"refused": refused} if refused else {})),
                         ensure_ascii=False))
    else:
        stops = [f"refused: the run would stop at once: {refused}"] if refused else []
        print("\n".join(report.lines() + fixed + stops))
    return 1 if refused or any(f.severity == "error" for f in report.findings) else 0


def _fail(opts, message: str, refused: str | None = None) -> int:
    if opts.json:
        print(json.dumps({"error": message, **({"refused": refused} if refused else {})}))
    else:
        print(f"error: {message}", file=sys.stderr)
        if refused:
            print(f"refused: the run would stop at once: {refused}", file=sys.stderr)
    return 1
