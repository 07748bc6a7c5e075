"""Side-by-side benchmark (not a test): the recipe bench/recipe.yaml run by `tuneboard train`, by a plain TRL
SFTTrainer script (bench/trl_sft.py) and by LLaMA-Factory (bench/.venv-lf, see bench/install_lf.sh),
alternately, for --rounds rounds; prints useful tokens/s, time to first step, peak RSS, MFU and the ratios,
and checks that the tools trained the same tokens (per-step losses side by side).

    python bench/run.py [--rounds 2] [--tools tuneboard,trl,lf] [--levers all|padded,plain-loss,...] [--steps N]
                        [--isa native|avx2] [--recipe sft|dpo|kto|grpo|ppo]

--recipe dpo / kto: the preference recipes (bench/recipe_dpo.yaml, bench/recipe_kto.yaml: the same LoRA, batch, cutoff
and steps on the same 256 listings as pairs / tagged rows) in TuneBoard and LLaMA-Factory (plain TRL is the SFT
recipe's only); a useful token is one that goes through the policy: a pair counts its chosen and rejected sequences
(the prompt twice), a KTO row its prompt and answer.

--recipe grpo / ppo: the online RL recipes (bench/rl.py): TuneBoard's GRPO against a plain TRL GRPOTrainer script
(bench/trl_grpo.py), TuneBoard's PPO against LLaMA-Factory's (its own venv bench/.venv-lf-ppo with the TRL 0.9.6 its
PPO needs), in steps per minute (a step: one rollout batch), peak RSS and the load average; --levers full adds
TuneBoard fully fine-tuned (a frozen reference copy beside the policy: the LoRA runs keep one base model).

--isa avx2 runs every tool (and the matmul peak) on the AVX2 kernel path of torch and oneDNN
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, their own switches), so an AVX-512 machine also measures what
an AVX2-only CPU (a common cloud and laptop class) gets.

--levers adds TuneBoard with a lever switched off (padded batches, plain loss, no checkpointing) or bf16
(autocast, on CPUs with native bf16 matmul), so each lever is measured in the same run as the others.

Measured: time to first step = process start to the first logged step (loading, tokenizing, first step);
useful tokens/s = useful (non-pad) tokens of steps 2..N over the wall time from step 1's log line to step N's
(the tools log every step; step 1, with its warm-up, is left out); the useful tokens per step are the
dataset's mean row length (as TuneBoard tokenizes it) x batch size: the same figure for every tool, which
trains the same rows in the same order (equal first losses show it); peak RSS = the process's ru_maxrss
(wait4), its tokenizer workers included only when they are larger; MFU = 6 x parameters x tokens/s over this
machine's fp32 (and bf16) matmul peak, measured at the start of the run.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import rl  # bench/rl.py, the online RL recipes (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RECIPE = BENCH / "recipe.yaml"
RECIPES = {"sft": RECIPE, "dpo": BENCH / "recipe_dpo.yaml", "kto": BENCH / "recipe_kto.yaml",
           "grpo": BENCH / "recipe_grpo.yaml", "ppo": BENCH / "recipe_ppo.yaml"}  # grpo, ppo: bench/rl.py
LF_VENV = BENCH / ".venv-lf"
PY = sys.executable
# --isa: the environment that makes torch (ATen's kernels) and oneDNN (its matmuls) use that instruction set at most
ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def matmul_peak(dtype_name: str, n: int = 2048, reps: int = 5) -> float:
    """Best GFLOP/s of an n^3 matmul in this dtype on this machine, now."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def recipe_facts(model_dir: Path, recipe_file: Path = RECIPE) -> dict:
    """Mean useful tokens per row (TuneBoard's tokenization; a pair: both sequences), parameter count, batch size,
    steps."""
    import yaml

    sys.path.insert(0, str(REPO))
    from backend.dataprep.data import load_examples
    from backend.training.models import load_tokenizer, resolve_model
    from backend.dataprep.preference import build_kto_dataset, build_preference_dataset
    from backend.dataprep.preprocess import build_sft_dataset
    from backend.dataprep.resolve import pick_template

    recipe = yaml.safe_load(recipe_file.read_text())
    resolved = resolve_model(str(model_dir))
    tokenizer = load_tokenizer(resolved)
    template = pick_template(recipe["template"], resolved, tokenizer)
    stage = recipe.get("stage", "sft")
    examples, _ = load_examples(recipe["dataset"], REPO / recipe["dataset_dir"], stage=stage)
    build = {"dpo": build_preference_dataset, "kto": build_kto_dataset}.get(stage, build_sft_dataset)
    rows, stats = build(examples, template, tokenizer, recipe["cutoff_len"])
    config = json.loads((model_dir / "config.json").read_text())
    h, layers, inter, vocab = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * h // config["num_attention_heads"]
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + vocab * h  # the head: the tied embedding, as a matmul
    return {"mean_row_tokens": stats.total_tokens / stats.rows, "rows": stats.rows, "params": params,
            "batch": recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"],
            "steps": recipe["max_steps"]}


# TuneBoard with one lever changed: name -> (extra argv, extra env)
LEVERS = {
    "padded": ([], {"TUNEBOARD_PADDING_FREE": "0"}),
    "no-varlen": ([], {"TUNEBOARD_VARLEN": "0"}),
    "plain-loss": ([], {"TUNEBOARD_CHUNKED_LOSS": "0"}),
    "rows": ([], {"TUNEBOARD_SHARED_PROMPT": "0"}),  # DPO: each pair as two rows; KTO: padded rows (shared_prompt.py)
    "padded+plain-loss": ([], {"TUNEBOARD_PADDING_FREE": "0", "TUNEBOARD_CHUNKED_LOSS": "0"}),
    "no-ckpt": (["gradient_checkpointing=false"], {}),
    "bf16": (["bf16=true"], {}),
    "fp32": (["bf16=false"], {}),  # bf16 is the default on a CPU with native bf16 matmul (bf16_by_default)
    "full-recompute": ([], {"TUNEBOARD_SELECTIVE_CHECKPOINT": "0"}),  # plain checkpointing (backend/core/checkpointing.py)
    "glibc": ([], {"TUNEBOARD_ALLOCATOR": "glibc"}),  # no jemalloc: glibc with a 1 MiB mmap threshold (backend.training.train)
    "jemalloc-decay": ([], {"MALLOC_CONF": ""}),  # jemalloc's own decay (freed pages returned after 10 s)
    "glibc-heap": ([], {"TUNEBOARD_ALLOCATOR": "glibc", "TUNEBOARD_MMAP_THRESHOLD": "0"}),  # glibc's own defaults
}


def tools(model_dir: Path, wanted: list[str], levers: list[str], steps: int | None,
          recipe: Path = RECIPE) -> list[tuple[str, list[str], dict]]:
    """(name, argv, extra env) per run kind, in the order they alternate."""
    more = [f"max_steps={steps}"] if steps else []
    tb = [PY, "-m", "backend.cli", "train", str(recipe), f"model_name_or_path={model_dir}", *more]
    out = []
    if "lf" in wanted:
        cli = LF_VENV / "bin" / "llamafactory-cli"
        if cli.is_file():
            shims = {"PYTHONPATH": str(BENCH / "lf_shims")}  # torchaudio stand-in: see lf_shims/torchaudio
            out.append(("llamafactory", [str(cli), "train", str(recipe), f"model_name_or_path={model_dir}", *more], shims))
        else:
            print(f"LLaMA-Factory skipped: {cli} is missing (bash bench/install_lf.sh installs it; see its log)")
    if "trl" in wanted and recipe != RECIPE:
        print("plain TRL skipped: bench/trl_sft.py runs the SFT recipe only")
    elif "trl" in wanted:
        out.append(("trl", [PY, str(BENCH / "trl_sft.py"), str(model_dir), str(steps or 12)], {}))
    if "tuneboard" in wanted:
        out.append(("tuneboard", tb, {}))
        for lever in levers:
            argv, env = LEVERS[lever]
            out.append((f"tuneboard {lever}", tb + argv, env))
    return out


# preference metrics compared per step: TuneBoard's trainer_log.jsonl and the Trainer's log_history name them as TRL
# does; LLaMA-Factory's trainer_log.jsonl calls rewards/accuracies "accuracy"
PREF_METRICS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
LF_NAMES = {"rewards/accuracies": "accuracy"}


def metrics_of(out_dir: Path) -> dict[str, list[float]]:
    """{metric: per-step values} of the preference metrics a run logged: from trainer_state.json's log_history when
    the run saved one (both tools do at the end), else from trainer_log.jsonl."""
    rows = []
    state = out_dir / "trainer_state.json"
    if state.exists():
        try:
            rows = [r for r in json.loads(state.read_text()).get("log_history", []) if "loss" in r]
        except ValueError:
            rows = []
    if not rows and (out_dir / "trainer_log.jsonl").exists():
        for line in (out_dir / "trainer_log.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    out = {}
    for key in PREF_METRICS + rl.METRICS:
        values = [r.get(key, r.get(LF_NAMES.get(key, key))) for r in rows]
        if any(v is not None for v in values):
            out[key] = [float(v) for v in values if v is not None]
    return out


def losses_of(log: Path) -> list[tuple[float, float]]:
    """[(step, loss)] from a trainer_log.jsonl (TuneBoard/TRL: step; LLaMA-Factory: current_steps)."""
    rows = []
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            step = row.get("step", row.get("current_steps"))
            if step is not None and row.get("loss") is not None:
                rows.append((step, float(row["loss"])))
    return rows


def tree_rss_kib(pid: int) -> int:
    """RSS of a process and all its descendants now, summed (KiB; pages shared after a fork count once per
    process, as top shows them)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total // 1024


def spawn_measured(argv: list[str], env: dict, stdout: Path, tick=None) -> tuple[int, int, int]:
    """Run argv to its end, its output into `stdout`; tick(now) every 0.25 s. (exit code, peak RSS of the process
    = its ru_maxrss from wait4 in KiB, peak RSS of its whole process tree sampled every 0.25 s in KiB)."""
    tree_peak = 0
    with stdout.open("w") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        while True:  # wait4 (not Popen.poll, which would reap the child and lose its rusage)
            tree_peak = max(tree_peak, tree_rss_kib(proc.pid))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if tick is not None:
                tick(time.perf_counter())
            if pid:
                break
            time.sleep(0.25)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss, max(tree_peak, usage.ru_maxrss)


def run_once(name: str, argv: list[str], env_extra: dict, out_dir: Path) -> dict:
    """One run: spawn, watch its trainer_log.jsonl for step lines, wait4 for its peak RSS."""
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    argv = argv[:3] + [str(out_dir)] + argv[3:] if argv[1].endswith(("trl_sft.py", "trl_grpo.py")) else argv + [f"output_dir={out_dir}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    for switch in ("TUNEBOARD_PADDING_FREE", "TUNEBOARD_CHUNKED_LOSS", "TUNEBOARD_VARLEN", "TUNEBOARD_MMAP_THRESHOLD",
                   "TUNEBOARD_ALLOCATOR", "LD_PRELOAD", "TUNEBOARD_SELECTIVE_CHECKPOINT"):
        if switch not in env_extra:
            env.pop(switch, None)
    log = out_dir / "trainer_log.jsonl"
    seen: dict[int, float] = {}

    def watch(now: float) -> None:
        for step, _ in losses_of(log):
            seen.setdefault(int(step), now)

    start = time.perf_counter()
    returncode, peak_kib, _ = spawn_measured(argv, env, out_dir / "bench_stdout.txt", watch)
    end = time.perf_counter()
    for step, _ in losses_of(log):
        seen.setdefault(int(step), end)
    steps = sorted(seen)
    result = {"tool": name, "returncode": returncode, "losses": [loss for _, loss in losses_of(log)],
              "metrics": metrics_of(out_dir),
              "peak_rss_mib": peak_kib / 1024, "wall_s": end - start,
              # the dtype the steps ran in, for the MFU: TuneBoard's log names it (bf16 by default on native bf16 CPUs)
              "bf16": "dtype torch.bfloat16" in (out_dir / "bench_stdout.txt").read_text(errors="replace")}
    if returncode == 0 and len(steps) >= 2:
        result["first_step_s"] = seen[steps[0]] - start
        result["steady_s"] = seen[steps[-1]] - seen[steps[0]]
        result["steady_steps"] = steps[-1] - steps[0]
    else:
        print(f"  {name} failed (exit {returncode}); see {out_dir / 'bench_stdout.txt'}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tools", default="tuneboard,trl,lf")
    parser.add_argument("--levers", default="", help="also TuneBoard with levers off / bf16: 'all' or names from "
                        + ", ".join(LEVERS))
    parser.add_argument("--steps", type=int, default=None, help="max_steps for every tool (default: the recipe's)")
    parser.add_argument("--out", default=str(BENCH / "results"))
    parser.add_argument("--recipe", choices=tuple(RECIPES), default="sft",
                        help="sft (bench/recipe.yaml), the preference recipes dpo / kto, or the online RL recipes "
                        "grpo / ppo (bench/rl.py)")
    parser.add_argument("--isa", choices=tuple(ISA_ENV), default="native",
                        help="avx2: every tool and the matmul peak on torch's and oneDNN's AVX2 kernels")
    args = parser.parse_args()
    online = args.recipe in rl.RECIPES
    levers = (list(rl.LEVERS if online else LEVERS) if args.levers == "all"
              else [x for x in args.levers.split(",") if x])
    unknown = [x for x in levers if x not in (rl.LEVERS if online else LEVERS)]
    if unknown:
        parser.error(f"--levers: no lever {', '.join(unknown)} for --recipe {args.recipe} (known: "
                     f"{', '.join(rl.LEVERS if online else LEVERS)})")
    unknown = [x for x in args.tools.split(",") if x not in ("tuneboard", "trl", "lf")]
    if unknown:
        parser.error(f"--tools: no tool {', '.join(unknown)} (known: tuneboard, trl, lf)")
    if args.steps is not None and args.steps < 2:
        parser.error("--steps: at least 2 (the speed is taken over steps 2..N)")
    # before torch is imported here (the matmul peak) and inherited by every tool's process (run_once copies os.environ)
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        os.environ.pop(name, None)
    os.environ.update(ISA_ENV[args.isa])

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(BENCH))
    import make_data

    from backend.training.models import materialize_gguf
    from backend.core.paths import default_model_file

    make_data.main()
    model_dir = materialize_gguf(default_model_file())
    if online:
        import make_prompts  # the short prompts of the RL recipes

        make_prompts.main()
    facts = rl.facts(args.recipe, args.steps) if online else recipe_facts(model_dir, RECIPES[args.recipe])
    if args.steps:
        facts["steps"] = args.steps
    import torch

    peaks = {"fp32": matmul_peak("float32"),
             "bf16": matmul_peak("bfloat16") if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None}
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    machine = (f"{cpu_name()}, {os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}, "
               f"kernels {torch.backends.cpu.get_cpu_capability()} (--isa {args.isa})")
    print(f"{when}  {machine}  load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"matmul peak 2048^3: fp32 {peaks['fp32']:.0f} GFLOP/s" + (f", bf16 {peaks['bf16']:.0f} GFLOP/s" if peaks["bf16"] else ""))
    sys.stdout.flush()
    if online:
        print(f"recipe {args.recipe}: {facts}", flush=True)
    else:
        print(f"recipe {args.recipe}: {facts['rows']} rows, mean {facts['mean_row_tokens']:.1f} useful tokens a row, batch {facts['batch']}, "
              f"{facts['steps']} steps, {facts['params'] / 1e6:.0f}M matmul parameters", flush=True)
    out_root = Path(args.out)
    if online:
        kinds = rl.tools(args.recipe, model_dir, args.tools.split(","), levers, args.steps, out_root, PY)
    else:
        kinds = tools(model_dir, args.tools.split(","), levers, args.steps, RECIPES[args.recipe])
    results: list[dict] = []
    for round_ in range(1, args.rounds + 1):
        for name, argv, env in kinds:
            print(f"round {round_}: {name} ...", flush=True)
            r = run_once(name, argv, env, out_root / "runs" / name.replace(" ", "_"))
            r["round"] = round_
            r["load"] = os.getloadavg()  # the machine may be shared: the load when the run ended (uptime's figures)
            if "steady_s" in r and online:
                r["steps_per_min"] = 60 * r["steady_steps"] / r["steady_s"]
                print(f"  {r['steps_per_min']:.2f} steps/min, first step after {r['first_step_s']:.0f} s, peak RSS "
                      f"{r['peak_rss_mib']:.0f} MiB, load {' '.join(f'{x:.1f}' for x in r['load'])}", flush=True)
            elif "steady_s" in r:
                r["tokens_per_s"] = r["steady_steps"] * facts["batch"] * facts["mean_row_tokens"] / r["steady_s"]
                print(f"  {r['tokens_per_s']:.1f} useful tokens/s, first step after {r['first_step_s']:.0f} s, "
                      f"peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
            results.append(r)
    table = rl.summarize(results, facts) if online else summarize(results, facts, peaks)
    out_root.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M")
    (out_root / f"bench-{stamp}.json").write_text(json.dumps(
        {"when": when, "machine": machine, "isa": args.isa, "recipe": args.recipe, "peaks_gflops": peaks, "facts": facts, "runs": results},
        indent=1))
    print(table)
    return 0


def summarize(results: list[dict], facts: dict, peaks: dict) -> str:
    """Markdown table: medians per tool and the ratios against LLaMA-Factory (else TRL); the losses side by side."""
    by_tool: dict[str, list[dict]] = {}
    for r in results:
        by_tool.setdefault(r["tool"], []).append(r)
    med = {}
    for tool, runs in by_tool.items():
        ok = [r for r in runs if "tokens_per_s" in r]
        if ok:
            med[tool] = {k: statistics.median(r[k] for r in ok) for k in ("tokens_per_s", "first_step_s", "peak_rss_mib")}
            med[tool]["losses"] = ok[0]["losses"]
            med[tool]["bf16"] = ok[0].get("bf16", False)
            med[tool]["metrics"] = ok[0].get("metrics", {})
    base = "llamafactory" if "llamafactory" in med else "trl" if "trl" in med else None
    lines = [f"| tool | useful tokens/s | vs {base} | first step (s) | peak RSS (MiB) | vs {base} | MFU |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for tool, m in med.items():
        speed = m["tokens_per_s"] / med[base]["tokens_per_s"] if base else float("nan")
        memory = m["peak_rss_mib"] / med[base]["peak_rss_mib"] if base else float("nan")
        dtype = "bf16" if m.get("bf16") and peaks.get("bf16") else "fp32"  # against the peak of what it ran in
        mfu = 6 * facts["params"] * m["tokens_per_s"] / (peaks[dtype] * 1e9)
        lines.append(f"| {tool} | {m['tokens_per_s']:.1f} | {speed:.2f}x | {m['first_step_s']:.0f} | "
                     f"{m['peak_rss_mib']:,.0f} | {memory:.2f}x | {100 * mfu:.1f}% {dtype} |")
    lines.append("")
    lines.append("per-step losses (first round):")
    for tool, m in med.items():
        lines.append(f"  {tool:28s} " + " ".join(f"{x:.4f}" for x in m["losses"]))
    for key in PREF_METRICS:
        if any(key in m.get("metrics", {}) for m in med.values()):
            lines.append(f"per-step {key} (first round):")
            for tool, m in med.items():
                lines.append(f"  {tool:28s} " + " ".join(f"{x:.4f}" for x in m.get("metrics", {}).get(key, [])))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
