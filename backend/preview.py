"""`tuneboard preview`: what the model will see for a dataset row, and which tokens it learns.

Used by people (coloured terminal output) and by the web UI's Data tab (`--json`).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from backend.paths import DEFAULT_MODEL_ID

GREEN, DIM, RESET = "\033[32m", "\033[2m", "\033[0m"


def parse_args(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tuneboard preview", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="registered dataset name(s), comma separated")
    source.add_argument("--messages", help="a JSON file holding an OpenAI-style messages list")
    p.add_argument("--dataset-dir", default=None, help="folder with dataset_info.json (default: the repo's data/)")
    p.add_argument("--index", type=int, default=0, help="first row to show (0-based)")
    p.add_argument("--count", type=int, default=1, help="how many rows to show")
    p.add_argument("--template", default="auto", help="template name, or auto (the tokenizer's own)")
    p.add_argument("--model", default=DEFAULT_MODEL_ID, help="model whose tokenizer is used")
    p.add_argument("--stage", default="sft", help="stage the rows are prepared for (sft, pt, ...)")
    p.add_argument("--cutoff-len", type=int, default=1024)
    p.add_argument("--train-on-prompt", action="store_true")
    p.add_argument("--mask-history", action="store_true")
    p.add_argument("--stats", action="store_true", help="statistics over the whole dataset instead of rows")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p.parse_args(args)


def preview_row(example: dict, template, tokenizer, opts) -> dict:
    from backend.preprocess import encode_segments

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


def dataset_stats(examples: list[dict], report, template, tokenizer, opts) -> dict:
    rows = [preview_row(e, template, tokenizer, opts) for e in examples]
    lengths = [r["num_tokens"] for r in rows]
    return {
        "num_rows": len(rows),
        "lengths": lengths,
        "max_length": max(lengths, default=0),
        "mean_length": round(sum(lengths) / len(lengths), 1) if lengths else 0,
        "truncated_rows": [r["row"] for r in rows if r["truncated"]],
        "rows_without_trained_tokens": [r["row"] for r in rows if r["num_trained"] == 0],
        "roles": dict(Counter(m["role"] for e in examples for m in e["messages"])),
        "report": report.summary_lines() if report is not None else [],
    }


def show(row: dict) -> str:
    coloured = "".join((GREEN if s["trained"] else DIM) + s["text"] + RESET for s in row["segments"])
    where = f"{row['source']} row {row['row']}" if row.get("source") else "messages"
    cut = ", truncated" if row["truncated"] else ""
    return f"--- {where}: {row['num_tokens']} tokens, {row['num_trained']} trained{cut} ---\n{coloured}\n"


def main(args: list[str]) -> int:
    opts = parse_args(args)
    from backend.data import DatasetError, load_examples
    from backend.models import load_tokenizer, resolve_model
    from backend.resolve import pick_template

    warnings: list[str] = []
    try:
        resolved = resolve_model(opts.model)
        tokenizer = load_tokenizer(resolved)
        template = pick_template(opts.template, resolved, tokenizer, warn=warnings.append)
        report = None
        if opts.messages:
            with open(opts.messages, encoding="utf-8") as f:
                loaded = json.load(f)
            messages = loaded.get("messages", loaded) if isinstance(loaded, dict) else loaded
            examples = [{"messages": messages, "_row": 0, "_source": opts.messages}]
        else:
            examples, report = load_examples(opts.dataset, opts.dataset_dir, stage=opts.stage)
        if opts.stats:
            result = dataset_stats(examples, report, template, tokenizer, opts)
        else:
            if not 0 <= opts.index < len(examples):
                raise ValueError(f"--index {opts.index} is out of range: the dataset has {len(examples)} rows (0..{len(examples) - 1})")
            chosen = examples[opts.index: opts.index + max(opts.count, 1)]
            rows = [preview_row(e, template, tokenizer, opts) for e in chosen]
            result = rows[0] if opts.count == 1 else {"rows": rows, "num_rows": len(examples)}
    except (DatasetError, ValueError, FileNotFoundError, OSError) as exc:
        if opts.json:
            print(json.dumps({"error": str(exc)}))
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
