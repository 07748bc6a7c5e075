"""`tuneboard preview`: what the model will see for a dataset row, and which tokens it learns.

Used by people (coloured terminal output) and by the web UI's Data tab (`--json`). The row's shape follows
the dataset's kind (or `--stage`): a conversation (sft), a ranking pair shown as its prompt once + the
chosen and the rejected answer (the tokens backend.dataprep.preference gives the DPO / reward trainers), or a KTO
row: prompt + answer with its desirable / undesirable tag.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from backend.core.paths import DEFAULT_MODEL_ID
from backend.dataprep.preprocess import encode_segments
from backend.dataprep.preference import build_preference_dataset, build_kto_dataset
from backend.stages import stages_with_data, get_stage
from backend.dataprep.resolve import pick_template

GREEN, DIM, RESET = "\033[32m", "\033[2m", "\033[0m"


def parse_args(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tuneboard preview", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="registered dataset name(s), comma separated")
    source.add_argument("--messages", help="a JSON file holding an OpenAI-style messages list")
    p.add_argument("--dataset-dir", default=None, help="folder with dataset_info.json (default: the repo's data/)")
    p.add_argument("--row", default=None, help="with --dataset (one name): a JSON file holding one raw row in that "
                   "dataset's own format, shown instead of the file's rows (the Data tab's row editor)")
    p.add_argument("--index", type=int, default=0, help="the row to show: its number in the dataset's file (0-based, as "
                   "tuneboard lint and the data report number rows; a row training skips says why); with --count "
                   "or several datasets, the first row shown")
    p.add_argument("--count", type=int, default=1, help="how many rows to show (rows training uses, from --index on)")
    p.add_argument("--template", default="auto", help="template name, or auto (the tokenizer's own)")
    p.add_argument("--model", default=DEFAULT_MODEL_ID, help="model whose tokenizer is used")
    p.add_argument("--stage", default="auto",
                   help="stage the rows are prepared for (sft, dpo, kto, ...); auto = by the dataset's kind "
                        "(ranking -> pairs, kto_tag -> tagged rows, else conversations)")
    p.add_argument("--cutoff-len", type=int, default=1024)
    p.add_argument("--train-on-prompt", action="store_true")
    p.add_argument("--mask-history", action="store_true")
    p.add_argument("--stats", action="store_true", help="statistics over the whole dataset instead of rows")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p.parse_args(args)


def preview_row(example: dict, template, tokenizer, opts) -> dict:
    segments = template.render(example["messages"], tools=example.get("tools"),
                               train_on_prompt=opts.train_on_prompt, mask_history=opts.mask_history)
    encoded = encode_segments(segments, tokenizer, opts.cutoff_len)
    return {
        "row": example.get("_row"),
        "source": example.get("_source"),
        "text": "".join(s.text for s in segments),
        "segments": [{"text": s.text, "trained": s.trained, "role": s.role} for s in segments],
        "input_ids": encoded.input_ids,
        "labels": encoded.labels,
        "tokens": tokenizer.convert_ids_to_tokens(encoded.input_ids),
        "num_tokens": len(encoded.input_ids),
        "num_trained": encoded.num_trained,
        "truncated": encoded.truncated,
    }


def _segment(s, trained: bool) -> dict:
    return {"text": s.text, "trained": trained, "role": s.role}


def _prompt_and_answer(messages: list[dict], tools, template) -> tuple[list[dict], list[dict]]:
    """A conversation ending with the answer -> (prompt segments, answer segments), split where
    backend.dataprep.preference splits the tokens: the answer is the template's trained span of the last turn (its
    end-of-turn marker included), all of it trained; everything before it is the prompt, all masked."""
    segments = template.render(messages, tools=tools, mask_history=True)
    trained = [i for i, s in enumerate(segments) if s.trained]
    if not trained:
        raise ValueError("the template trains no token of the answer")
    first, last = trained[0], trained[-1] + 1
    return ([_segment(s, False) for s in segments[:first]], [_segment(s, True) for s in segments[first:last]])


def preview_pair(example: dict, template, tokenizer, opts) -> dict:
    """A ranking row: its prompt (once) and both answers, with the token counts of the row the DPO and
    reward trainers get (backend.dataprep.preference: same split, same truncation)."""

    [row], stats = build_preference_dataset([example], template, tokenizer, opts.cutoff_len)
    messages = list(example["messages"])
    prompt, chosen = _prompt_and_answer(messages + [example["chosen"]], example.get("tools"), template)
    _, rejected = _prompt_and_answer(messages + [example["rejected"]], example.get("tools"), template)
    n_prompt, n_chosen, n_rejected = (len(row[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    return {
        "kind": "ranking",
        "row": example.get("_row"),
        "source": example.get("_source"),
        "prompt": {"segments": prompt, "num_tokens": n_prompt},
        "chosen": {"segments": chosen, "num_tokens": n_chosen},
        "rejected": {"segments": rejected, "num_tokens": n_rejected},
        "prompt_ids": row["prompt_ids"], "chosen_ids": row["chosen_ids"], "rejected_ids": row["rejected_ids"],
        # the longer of the two sequences the model reads, and the answer tokens it learns from
        "num_tokens": n_prompt + max(n_chosen, n_rejected),
        "num_trained": n_chosen + n_rejected,
        "truncated": bool(stats.truncated),
    }


def preview_kto(example: dict, template, tokenizer, opts) -> dict:
    """A KTO row: prompt + answer (the last turn, trained) and its desirable / undesirable tag, with the
    token counts of the row the KTO trainer gets (backend.dataprep.preference)."""

    [row], stats = build_kto_dataset([example], template, tokenizer, opts.cutoff_len)
    prompt, answer = _prompt_and_answer(list(example["messages"]), example.get("tools"), template)
    segments = prompt + answer
    return {
        "kind": "kto",
        "row": example.get("_row"),
        "source": example.get("_source"),
        "kto_tag": row["label"],
        "tag": "desirable" if row["label"] else "undesirable",
        "text": "".join(s["text"] for s in segments),
        "segments": segments,
        "prompt_ids": row["prompt_ids"], "completion_ids": row["completion_ids"],
        "num_tokens": len(row["prompt_ids"]) + len(row["completion_ids"]),
        "num_trained": len(row["completion_ids"]),
        "truncated": bool(stats.truncated),
    }


def preview_any(example: dict, kind: str, template, tokenizer, opts) -> dict:
    if kind == "ranking":
        return preview_pair(example, template, tokenizer, opts)
    if kind == "kto":
        return preview_kto(example, template, tokenizer, opts)
    return preview_row(example, template, tokenizer, opts)


def resolve_stage(opts) -> str:
    """--stage auto -> a stage of the first dataset's kind: a ranking dataset previews as pairs, one with a
    kto_tag column as tagged KTO rows, anything else as SFT conversations."""
    if opts.stage != "auto":
        return opts.stage
    if not opts.dataset:
        return "sft"
    from backend.dataprep.data import load_dataset_info  # heavy: loaded on use, so importing this module stays light

    first = opts.dataset.split(",")[0].strip()
    entry = load_dataset_info(opts.dataset_dir).get(first) or {}
    kind = "ranking" if entry.get("ranking") else "kto" if "kto_tag" in (entry.get("columns") or {}) else "plain"
    return next(iter(stages_with_data(kind)), "sft")


def dataset_stats(examples: list[dict], report, template, tokenizer, opts, kind: str = "plain") -> dict:
    rows = [preview_any(e, kind, template, tokenizer, opts) for e in examples]
    lengths = [r["num_tokens"] for r in rows]
    return {
        "num_rows": len(rows),
        "lengths": lengths,
        "max_length": max(lengths, default=0),
        "mean_length": round(sum(lengths) / len(lengths), 1) if lengths else 0,
        "truncated_rows": [r["row"] for r in rows if r["truncated"]],
        "rows_without_trained_tokens": [r["row"] for r in rows if r["num_trained"] == 0],
        "roles": dict(Counter(m["role"] for e in examples for m in e.get("messages") or [])),
        "report": report.summary_lines() if report is not None else [],
    }


def _coloured(segments: list[dict]) -> str:
    return "".join((GREEN if s["trained"] else DIM) + s["text"] + RESET for s in segments)


def show(row: dict) -> str:
    where = f"{row['source']} row {row['row']}" if row.get("source") else "messages"
    cut = ", truncated" if row["truncated"] else ""
    head = f"--- {where}: {row['num_tokens']} tokens, {row['num_trained']} trained{cut}"
    if row.get("kind") == "ranking":
        parts = [f"{head} ---", f"[prompt: {row['prompt']['num_tokens']} tokens]", _coloured(row["prompt"]["segments"])]
        for key in ("chosen", "rejected"):
            parts += [f"[{key}: {row[key]['num_tokens']} tokens]", _coloured(row[key]["segments"])]
        return "\n".join(parts) + "\n"
    if row.get("kind") == "kto":
        head += f", {row['tag']}"
    return f"{head} ---\n{_coloured(row['segments'])}\n"


def main(args: list[str]) -> int:
    opts = parse_args(args)
    from backend.dataprep.data import DatasetError, dataset_row, example_from_row, load_examples  # heavy: loaded on use, so importing this module stays light
    from backend.training.models import load_tokenizer, resolve_model  # heavy: loaded on use, so importing this module stays light

    warnings: list[str] = []
    try:
        resolved = resolve_model(opts.model)
        tokenizer = load_tokenizer(resolved)
        template = pick_template(opts.template, resolved, tokenizer, warn=warnings.append)
        report, kind, start = None, "plain", opts.index  # start: the first of `examples` shown
        if opts.messages:
            with open(opts.messages, encoding="utf-8-sig") as f:
                loaded = json.load(f)
            messages = loaded.get("messages", loaded) if isinstance(loaded, dict) else loaded
            examples = [{"messages": messages, "_row": 0, "_source": opts.messages}]
        elif opts.row:
            stage = resolve_stage(opts)
            with open(opts.row, encoding="utf-8-sig") as f:
                try:
                    raw = json.load(f)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the row is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") \
                        from None
            examples = [dict(example_from_row(opts.dataset, raw, opts.dataset_dir, stage=stage), _row=opts.index,
                             _source=opts.dataset)]
            kind, start = get_stage(stage).data, 0
        elif opts.count == 1 and not opts.stats and "," not in opts.dataset:
            # row --index of the file, the number the lint and the data report name (data.dataset_row)
            stage = resolve_stage(opts)
            examples = [dataset_row(opts.dataset.strip(), opts.index, opts.dataset_dir, stage=stage)]
            kind, start = get_stage(stage).data, 0
        else:
            stage = resolve_stage(opts)
            examples, report = load_examples(opts.dataset, opts.dataset_dir, stage=stage)
            kind = get_stage(stage).data
            # the rows training uses from file row --index on
            start = next((k for k, e in enumerate(examples) if e["_row"] >= opts.index), len(examples))
        if opts.stats:
            result = dataset_stats(examples, report, template, tokenizer, opts, kind)
        else:
            if not 0 <= start < len(examples):
                raise ValueError(f"--index {opts.index} is out of range: the dataset has {len(examples)} rows (0..{len(examples) - 1})")
            chosen = examples[start: start + max(opts.count, 1)]
            rows = [preview_any(e, kind, template, tokenizer, opts) for e in chosen]
            result = rows[0] if opts.count == 1 else {"rows": rows, "num_rows": len(examples)}
    except (DatasetError, ValueError, FileNotFoundError, OSError) as exc:
        if opts.json:  # a row training skips: its number too (the Data tab's row editor loads it to be mended)
            skipped = {"row": exc.row} if isinstance(getattr(exc, "row", None), int) else {}
            print(json.dumps({"error": str(exc), **skipped}))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 1
    if opts.json:
        result = dict(result, template=template.name, warnings=warnings)
        print(json.dumps(result, ensure_ascii=False))
        return 0
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if opts.stats:
        print(json.dumps({k: v for k, v in result.items() if k != "lengths"}, indent=2, ensure_ascii=False))
    else:
        for row in result.get("rows", [result]):
            print(show(row))
    return 0
