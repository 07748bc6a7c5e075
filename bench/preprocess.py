"""Preprocessing at scale (not a test): N generated alpaca rows (default 1,000,000; bench/make_data.py alpaca_rows)
tokenized by TuneBoard and by LLaMA-Factory, same rows, same tokenizer (the default model's), same template
(chatml), cutoff_len, preprocessing_num_workers and preprocessing_batch_size; each tool's preprocessing alone, in its
own process, saving the tokenized dataset (datasets' save_to_disk) and stopping before any model loads:

- TuneBoard: its SFT stage's own steps, tokenizer_and_template then backend.stages.sft.tokenized, with tokenized_path
  set to an empty folder (the tokenized cache, backend/dataprep/token_cache.py), in a run folder (status.json);
- LLaMA-Factory (bench/.venv-lf): its SFT workflow's own first steps, load_tokenizer, get_template_and_fix_tokenizer
  and get_dataset, with tokenized_path set to an empty folder (0.9.5 saves there and goes on to load the model and
  train: this worker stops after get_dataset).

    python bench/preprocess.py [--rows 1000000] [--workers 2] [--batch-size 1000] [--cutoff 512] [--rounds 1]
                               [--tools tuneboard,lf]

Measured: rows/s = input rows / the process's wall time (start to exit: imports, tokenizer, reading, tokenizing,
saving); peak RSS = the process's ru_maxrss (wait4) and the sampled peak of its whole process tree (the workers'
RSS added: pages shared after the fork count once per process); both tools' saved rows and tokens are counted from
what they saved, to show they did the same work. Results: bench/results/preprocess-*.json and the table printed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LF_PY = HERE / ".venv-lf" / "bin" / "python"
DATASET = "alpaca_bench"


def settings(model_dir: str, data_dir: Path, out: Path, args) -> dict:
    """The spec both tools read (LLaMA-Factory's key vocabulary)."""
    return {"stage": "sft", "do_train": True, "finetuning_type": "lora", "model_name_or_path": model_dir,
            "dataset": DATASET, "dataset_dir": str(data_dir), "template": "chatml", "cutoff_len": args.cutoff,
            "preprocessing_num_workers": args.workers, "preprocessing_batch_size": args.batch_size,
            "tokenized_path": str(out / "tokenized"), "output_dir": str(out / "run"), "overwrite_output_dir": True,
            "report_to": "none", "seed": 42}


def tuneboard_worker(spec_file: Path) -> int:
    """TuneBoard's preprocessing: the SFT stage's tokenizer/template and tokenized rows, saved to tokenized_path."""
    sys.path.insert(0, str(REPO))
    # TuneBoard's interpreter only (this file also runs as LLaMA-Factory's worker, in its venv)
    from backend.core.rundir import RunDir
    from backend.core.spec import load_or_report
    from backend.dataprep.preprocess import tokenizing
    from backend.stages.base import tokenizer_and_template
    from backend.stages.sft import tokenized

    spec = load_or_report([str(spec_file)])
    if spec is None:
        return 1
    run_dir = RunDir(spec.output_dir)
    run_dir.start()
    _, tokenizer, template = tokenizer_and_template(spec, run_dir)
    with tokenizing(spec.preprocessing_batch_size, run_dir.tokenizing_progress):  # as backend.training.train runs a stage
        tokenized(spec, run_dir, tokenizer, template)
    return run_dir.end()


def lf_worker(spec_file: Path) -> int:
    """LLaMA-Factory's preprocessing: the first steps of its run_sft, up to get_dataset (which saves to tokenized_path)."""
    # LLaMA-Factory's venv only (bench/.venv-lf)
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    model_args, data_args, training_args, _, _ = get_train_args(json.loads(spec_file.read_text()))
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    return 0


def counts(folder: Path) -> dict:
    """Rows, tokens and trained tokens (labels != -100) of a saved tokenized dataset's train split."""
    import datasets  # heavy: pyarrow; the workers import their own
    import pyarrow.compute as pc

    train = datasets.load_from_disk(str(folder / "train")).data.table
    labels = pc.list_flatten(train.column("labels"))
    return {"rows": train.num_rows, "tokens": pc.sum(pc.list_value_length(train.column("input_ids"))).as_py(),
            "trained_tokens": pc.sum(pc.not_equal(labels, -100).cast("int64")).as_py()}


def measure(tool: str, spec: dict, out: Path) -> dict:
    from run import spawn_measured  # bench/run.py (on sys.path from main): the same measurement as the training benchmark

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = dict(spec, tokenized_path=str(out / "tokenized"), output_dir=str(out / "run"))
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    if tool == "tuneboard":
        argv, env = [sys.executable, __file__, "--worker", "tuneboard", str(spec_file)], {}
    else:
        argv, env = [str(LF_PY), __file__, "--worker", "lf", str(spec_file)], {"PYTHONPATH": str(HERE / "lf_shims")}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env)
    start = time.perf_counter()
    code, peak_kib, tree_kib = spawn_measured(argv, env, out / "stdout.txt")
    wall = time.perf_counter() - start
    result = {"tool": tool, "returncode": code, "wall_s": wall, "peak_rss_mib": peak_kib / 1024,
              "tree_peak_rss_mib": tree_kib / 1024}
    if code != 0:
        print(f"  {tool} failed (exit {code}); see {out / 'stdout.txt'}", flush=True)
        return result
    result.update(counts(out / "tokenized"))
    shutil.rmtree(out / "tokenized", ignore_errors=True)  # GBs at 1M rows
    return result


def table(results: list[dict], rows_in: int) -> str:
    by_tool: dict[str, list[dict]] = {}
    for r in results:
        if r["returncode"] == 0:
            by_tool.setdefault(r["tool"], []).append(r)
    med = {t: {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "peak_rss_mib", "tree_peak_rss_mib")}
           | {k: runs[0][k] for k in ("rows", "tokens", "trained_tokens")} for t, runs in by_tool.items()}
    base = med.get("llamafactory")
    lines = ["| tool | rows/s | vs llamafactory | wall (s) | peak RSS, process (MiB) | peak RSS, process tree (MiB) "
             "| vs llamafactory (tree) | rows saved | tokens | trained tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tool, m in med.items():
        speed = f"{base['wall_s'] / m['wall_s']:.2f}x" if base else "-"
        memory = f"{m['tree_peak_rss_mib'] / base['tree_peak_rss_mib']:.2f}x" if base else "-"
        lines.append(f"| {tool} | {rows_in / m['wall_s']:,.0f} | {speed} | {m['wall_s']:.0f} | {m['peak_rss_mib']:,.0f} | "
                     f"{m['tree_peak_rss_mib']:,.0f} | {memory} | {m['rows']:,} | {m['tokens']:,} | {m['trained_tokens']:,} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2, help="preprocessing_num_workers")
    parser.add_argument("--batch-size", type=int, default=1000, help="preprocessing_batch_size")
    parser.add_argument("--cutoff", type=int, default=512, help="cutoff_len")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tools", default="tuneboard,lf")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        tool, spec_file = args.worker
        return (tuneboard_worker if tool == "tuneboard" else lf_worker)(Path(spec_file))
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    import make_data
    from backend.core.paths import default_model_file
    from backend.training.models import materialize_gguf

    out = Path(args.out) / "preprocess"
    data_dir = out / "data"
    started = time.perf_counter()
    make_data.write_alpaca(data_dir, args.rows, DATASET)
    print(f"{args.rows:,} alpaca rows written to {data_dir} in {time.perf_counter() - started:.0f} s", flush=True)
    model_dir = str(materialize_gguf(default_model_file()))
    spec = settings(model_dir, data_dir, out, args)
    tools = [t for t in args.tools.split(",") if t]
    if "lf" in tools and not LF_PY.is_file():
        print(f"LLaMA-Factory skipped: {LF_PY} is missing (bash bench/install_lf.sh installs it)")
        tools.remove("lf")
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"{when}  {os.cpu_count()} CPUs  load average {os.getloadavg()[0]:.1f}  rows {args.rows:,}, workers "
          f"{args.workers}, batch {args.batch_size}, cutoff {args.cutoff}", flush=True)
    results = []
    for round_ in range(1, args.rounds + 1):
        for tool in tools:
            name = "llamafactory" if tool == "lf" else tool
            print(f"round {round_}: {name} ...", flush=True)
            r = measure(tool, spec, out / name)
            r.update(tool=name, round=round_, load_average=os.getloadavg()[0])
            if r["returncode"] == 0:
                print(f"  {args.rows / r['wall_s']:,.0f} rows/s ({r['wall_s']:.0f} s), peak RSS {r['peak_rss_mib']:,.0f} MiB "
                      f"(process tree {r['tree_peak_rss_mib']:,.0f}), {r['rows']:,} rows, {r['tokens']:,} tokens, "
                      f"{r['trained_tokens']:,} trained", flush=True)
            results.append(r)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M")
    (Path(args.out) / f"preprocess-{stamp}.json").write_text(json.dumps(
        {"when": when, "rows": args.rows, "workers": args.workers, "batch_size": args.batch_size, "cutoff": args.cutoff,
         "cpus": os.cpu_count(), "runs": results}, indent=1))
    print(table(results, args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
