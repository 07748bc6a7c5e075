"""The cost of eval_metric (not a test): the bench recipe (bench/recipe.yaml) trained twice per round, with the same
held-out split (val_size) and the same saves, once without a task metric and once with eval_metric json_field_f1
at the default eval_samples (issue 20: scoring must cost at most 20% of the recipe's training time).

    python bench/scoring.py [--rounds 1] [--steps 12] [--save-steps 4] [--model DIR]

Measured: the Trainer's train_runtime (status.json final_metrics: every step, save and scoring) of each run, the
scoring seconds checkpoint_scores.json records per save, and the overhead = extra training time / training time
without. --model: another model folder (default: the bundled default model, as bench/run.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RECIPE = BENCH / "recipe.yaml"
METRIC = "json_field_f1"
HELD_OUT = 32  # val_size rows: the default eval_samples


def train(model: str, out: Path, steps: int, save_steps: int, metric: str | None) -> dict:
    """One `tuneboard train` of the recipe; its train_runtime and (with a metric) the scoring seconds per save."""
    sys.path.insert(0, str(REPO))
    from backend.core.rundir import CHECKPOINT_SCORES_FILE, STATUS_FILE

    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "backend.cli", "train", str(RECIPE), f"model_name_or_path={model}",
            f"output_dir={out}", f"max_steps={steps}", f"val_size={HELD_OUT}", "save_strategy=steps",
            f"save_steps={save_steps}"] + ([f"eval_metric={metric}"] if metric else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{out.name} failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    status = json.loads((out / STATUS_FILE).read_text())
    result = {"train_runtime": status["final_metrics"]["train_runtime"]}
    if metric:
        scores = json.loads((out / CHECKPOINT_SCORES_FILE).read_text())
        result.update(scoring_s=[s["seconds"] for s in scores["scores"]], values=[s["value"] for s in scores["scores"]],
                      samples=scores["samples"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="max_steps (the recipe's: 12)")
    parser.add_argument("--save-steps", type=int, default=4, help="save (and score) every N steps")
    parser.add_argument("--model", default=None, help="model folder (default: the bundled default model)")
    parser.add_argument("--out", default=str(BENCH / "results" / "scoring"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(BENCH))
    import make_data

    make_data.main()
    if args.model:
        model = args.model
    else:
        from backend.training.models import materialize_gguf
        from backend.core.paths import default_model_file

        model = str(materialize_gguf(default_model_file()))
    plain, scored = [], []
    for round_ in range(1, args.rounds + 1):
        for metric, into in ((None, plain), (METRIC, scored)):
            name = f"{'with' if metric else 'without'}-eval_metric"
            print(f"round {round_}: {name} ...", flush=True)
            r = train(model, Path(args.out) / name, args.steps, args.save_steps, metric)
            print(f"  train_runtime {r['train_runtime']:.1f} s"
                  + (f", scoring {sum(r['scoring_s']):.1f} s over {len(r['scoring_s'])} saves "
                     f"({r['samples']} rows each; {METRIC} {r['values']})" if metric else ""), flush=True)
            into.append(r)
    base = statistics.median(r["train_runtime"] for r in plain)
    with_metric = statistics.median(r["train_runtime"] for r in scored)
    scoring = statistics.median(sum(r["scoring_s"]) for r in scored)
    saves = len(scored[0]["scoring_s"])
    print(f"\n| run | train time (s) | scoring (s) | overhead |\n| --- | --- | --- | --- |\n"
          f"| without eval_metric | {base:.1f} | - | - |\n"
          f"| eval_metric {METRIC}, eval_samples {scored[0]['samples']}, {saves} saves | {with_metric:.1f} | "
          f"{scoring:.1f} | {100 * (with_metric - base) / base:+.0f}% (scoring alone {100 * scoring / base:.0f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
