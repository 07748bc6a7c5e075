"""The online RL recipes of bench/run.py (--recipe grpo | ppo): which tools run them, with what, and the table.

grpo: TuneBoard (bench/recipe_grpo.yaml) against the same recipe as a plain TRL GRPOTrainer script
(bench/trl_grpo.py): same model, prompts, reward function, num_generations, batch, max_completion_length, steps.
LLaMA-Factory has no GRPO stage.

ppo: TuneBoard (bench/recipe_ppo.yaml) against LLaMA-Factory's PPO on the same file. LLaMA-Factory 0.9.5's PPO
trainer is TRL 0.9.6's PPOTrainer (TRL dropped it in 0.10), so it runs from its own venv, bench/.venv-lf-ppo
(bench/install_lf_ppo.sh: transformers 4.55.4, the oldest LLaMA-Factory 0.9.5 admits, and trl 0.9.6), with two
stand-ins: bench/lf_shims (torchaudio) and bench/lf_ppo_shims (two TRL names its other trainers import at start).
Transformers 4.55 cannot read the model folder that transformers 5 wrote (tokenizer class TokenizersBackend,
rope_parameters), so LLaMA-Factory gets a copy of it with both written the old way, the weights linked
(legacy_model_dir). Each tool's PPO scores with a reward model it trained itself from bench/recipe_rm.yaml
(1 LoRA step, not timed), loaded as a second model beside the policy by both (LLaMA-Factory: see LF_REWARD).
TRL (1.16) has no PPO trainer, so there is no plain-TRL row.

Measured per run (bench/run.py's run_once): steps per minute over steps 2..N (a step = one rollout batch:
generate, score, update), time to the first step, peak RSS, and the load average when the run ended (the machine
is shared: `uptime`'s three figures).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
RECIPES = {"grpo": BENCH / "recipe_grpo.yaml", "ppo": BENCH / "recipe_ppo.yaml"}
RM_RECIPE = BENCH / "recipe_rm.yaml"
LF_PPO_VENV = BENCH / ".venv-lf-ppo"
LF_PPO_ENV = {"PYTHONPATH": f"{BENCH / 'lf_shims'}:{BENCH / 'lf_ppo_shims'}",
              "DISABLE_VERSION_CHECK": "1"}  # LLaMA-Factory's own switch: its start-up check wants trl >= 0.18
# LLaMA-Factory's reward model: `reward_model_type: lora` loads the rm adapter onto the policy's base with peft's
# load_adapter, and peft 0.18 (LLaMA-Factory 0.9.5's pin) then sets the active adapter to inference mode: the policy's
# LoRA is frozen and PPO trains the value head alone (577 parameters, "Number of trainable parameters = 577" in its
# log). So the benchmark gives it the rm run as a second model, `reward_model_type: full` with the base as
# reward_model and the rm run as reward_model_adapters (its value head read from there), as TuneBoard loads it.
LF_REWARD = "full"
RESPONSE_TOKENS = 64  # max_completion_length (TuneBoard) = max_new_tokens (LLaMA-Factory)
LEVERS = {"full": ["finetuning_type=full"]}  # TuneBoard's PPO/GRPO full fine-tuning: a frozen reference copy
METRICS = ("reward", "kl", "completions/mean_length")


def facts(recipe_name: str, steps: int | None) -> dict:
    recipe = yaml.safe_load(RECIPES[recipe_name].read_text())
    return {"batch": recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"],
            "steps": steps or recipe["max_steps"], "num_generations": recipe.get("num_generations"),
            "response_tokens": RESPONSE_TOKENS, "dataset": recipe["dataset"]}


def legacy_model_dir(model_dir: Path, out_root: Path) -> Path:
    """model_dir as transformers 4.x reads it: tokenizer_config's class PreTrainedTokenizerFast (not
    TokenizersBackend), config.json's rope_theta at the top (not only in rope_parameters) and torch_dtype; every
    other file linked."""
    legacy = out_root / "model-transformers4"
    if legacy.exists():
        shutil.rmtree(legacy)
    legacy.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.name not in ("config.json", "tokenizer_config.json"):
            (legacy / item.name).symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config.update({k: v for k, v in (config.get("rope_parameters") or {}).items() if k == "rope_theta"})
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    (legacy / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = json.loads((model_dir / "tokenizer_config.json").read_text())
    if tokenizer.get("tokenizer_class") == "TokenizersBackend":
        tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
    (legacy / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
    return legacy


def train_reward_model(name: str, argv: list[str], env_extra: dict, out_dir: Path) -> Path | None:
    """A tool's rm run of bench/recipe_rm.yaml into out_dir (not timed; kept for the next benchmark while the
    command and the recipe are the same); None, saying why, when it fails."""
    stamp = json.dumps({"argv": argv, "recipe": RM_RECIPE.read_text()})
    if (out_dir / "adapter_config.json").is_file() and (out_dir / "bench_stamp.json").is_file() \
            and (out_dir / "bench_stamp.json").read_text() == stamp:
        print(f"{name}: its reward model from an earlier benchmark: {out_dir}")
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    print(f"{name}: training its reward model (bench/recipe_rm.yaml, not timed) ...", flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    with (out_dir / "bench_stdout.txt").open("w") as sink:
        code = subprocess.run(argv + [f"output_dir={out_dir}"], cwd=BENCH.parent, env=env, stdout=sink,
                              stderr=subprocess.STDOUT).returncode
    if code != 0 or not (out_dir / "adapter_config.json").is_file():
        print(f"  {name} skipped: its reward model did not train (exit {code}); see {out_dir / 'bench_stdout.txt'}")
        return None
    (out_dir / "bench_stamp.json").write_text(stamp)
    return out_dir


def tools(recipe_name: str, model_dir: Path, wanted: list[str], levers: list[str], steps: int | None,
          out_root: Path, py: str) -> list[tuple[str, list[str], dict]]:
    """(name, argv, extra env) per run kind for bench/run.py's loop; the ppo recipe trains the reward models first."""
    recipe = RECIPES[recipe_name]
    more = [f"max_steps={steps}"] if steps else []
    tb = [py, "-m", "backend.cli", "train", str(recipe), f"model_name_or_path={model_dir}", *more]
    out = []
    if recipe_name == "grpo":
        if "lf" in wanted:
            print("LLaMA-Factory skipped: it has no GRPO stage (0.9.5 trains pt, sft, rm, ppo, dpo, kto)")
        if "trl" in wanted:
            trl_steps = str(steps or facts("grpo", None)["steps"])
            out.append(("trl", [py, str(BENCH / "trl_grpo.py"), str(model_dir), trl_steps], {}))
        tb_extra: list[str] = []
    else:
        if "trl" in wanted:
            print("plain TRL skipped: TRL 1.16 has no PPO trainer (TuneBoard's PPO is its own, backend/stages/ppo.py)")
        if "lf" in wanted:
            cli = LF_PPO_VENV / "bin" / "llamafactory-cli"
            if not cli.is_file():
                print(f"LLaMA-Factory skipped: {cli} is missing (bash bench/install_lf_ppo.sh installs it; see "
                      "bench/install_lf_ppo.log)")
            else:
                legacy = legacy_model_dir(model_dir, out_root)
                lf = [str(cli), "train", str(recipe), f"model_name_or_path={legacy}", *more]
                rm = train_reward_model("llamafactory",
                                        [str(cli), "train", str(RM_RECIPE), f"model_name_or_path={legacy}"],
                                        LF_PPO_ENV, out_root / "runs" / "rm_llamafactory")
                if rm:  # the rm run as a second model (as TuneBoard's), not the lora type: see LF_REWARD
                    out.append(("llamafactory", lf + [f"reward_model={legacy}", f"reward_model_adapters={rm}",
                                                      f"reward_model_type={LF_REWARD}", f"max_new_tokens={RESPONSE_TOKENS}",
                                                      "top_k=0"], LF_PPO_ENV))
        tb_extra = []
        if "tuneboard" in wanted:
            rm = train_reward_model("tuneboard",
                                    [py, "-m", "backend.cli", "train", str(RM_RECIPE), f"model_name_or_path={model_dir}"],
                                    {}, out_root / "runs" / "rm_tuneboard")
            if rm is None:
                wanted = [w for w in wanted if w != "tuneboard"]
            tb_extra = [f"reward_model={rm}"]
    if "tuneboard" in wanted:
        tb += tb_extra + [f"max_completion_length={RESPONSE_TOKENS}"]
        out.append(("tuneboard", tb, {}))
        for lever in levers:
            out.append((f"tuneboard {lever}", tb + LEVERS[lever], {}))
    return out


def summarize(results: list[dict], facts_: dict) -> str:
    """Markdown table: medians per tool of steps/min, first step, peak RSS, the ratios against LLaMA-Factory (else
    plain TRL), the load average; then the per-step losses, rewards, kl and response lengths (first round)."""
    by_tool: dict[str, list[dict]] = {}
    for r in results:
        by_tool.setdefault(r["tool"], []).append(r)
    med = {}
    for tool, runs in by_tool.items():
        ok = [r for r in runs if "steps_per_min" in r]
        if ok:
            med[tool] = {k: statistics.median(r[k] for r in ok)
                         for k in ("steps_per_min", "first_step_s", "peak_rss_mib")}
            med[tool].update(losses=ok[0]["losses"], metrics=ok[0].get("metrics", {}),
                             load=" / ".join(f"{x:.1f}" for x in ok[-1]["load"]))
    base = "llamafactory" if "llamafactory" in med else "trl" if "trl" in med else None
    lines = [f"batch {facts_['batch']} ({'completions' if facts_.get('num_generations') else 'prompts'}), "
             f"{facts_['steps']} steps, at most {facts_['response_tokens']} new tokens, prompts: {facts_['dataset']}",
             f"| tool | steps/min | vs {base} | first step (s) | peak RSS (MiB) | vs {base} | load 1/5/15 min at its end |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for tool, m in med.items():
        speed = m["steps_per_min"] / med[base]["steps_per_min"] if base else float("nan")
        memory = m["peak_rss_mib"] / med[base]["peak_rss_mib"] if base else float("nan")
        lines.append(f"| {tool} | {m['steps_per_min']:.2f} | {speed:.2f}x | {m['first_step_s']:.0f} | "
                     f"{m['peak_rss_mib']:,.0f} | {memory:.2f}x | {m['load']} |")
    for tool in by_tool:
        if tool not in med:
            lines.append(f"| {tool} | failed: see its bench_stdout.txt | | | | | |")
    lines.append("")
    lines.append("per-step loss (first round):")
    for tool, m in med.items():
        lines.append(f"  {tool:20s} " + " ".join(f"{x:.4f}" for x in m["losses"]))
    for key in METRICS:
        if any(key in m["metrics"] for m in med.values()):
            lines.append(f"per-step {key} (first round):")
            for tool, m in med.items():
                lines.append(f"  {tool:20s} " + " ".join(f"{x:.4f}" for x in m["metrics"].get(key, [])))
    return "\n".join(lines)
