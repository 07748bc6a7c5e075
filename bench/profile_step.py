"""Per-step time breakdown (not a test): forward, backward and optimizer of the bench recipe's LoRA step, for
several ways of computing it, interleaved in one process so a loaded machine slows them all alike.

    python bench/profile_step.py [--steps 4] [--modes padded-ckpt-nonreentrant,padding-free-chunked-...]
    bench/.venv-lf/bin/python bench/profile_step.py --modes padded-ckpt-reentrant   # LLaMA-Factory's libraries

Only torch, transformers and peft are needed for the plain modes, so the same script runs in LLaMA-Factory's
venv (its transformers/peft releases); the TuneBoard levers (padding-free batches, chunked loss) need this
repository's backend. The batches are the recipe's first rows, tokenized once by TuneBoard and cached in
bench/results/profile_batches.json. Each mode name is '-'-joined words: padded | padding-free, plain | chunked,
ckpt-reentrant | ckpt-nonreentrant | ckpt-selective | no-ckpt, and optionally bf16 (autocast, model in bf16,
LoRA in fp32). Prints per mode the median seconds of forward, backward, optimizer and the step, and the ratio
of each mode's step to the first mode's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "bench" / "results" / "profile_batches.json"


def batches(n_batches: int, batch: int = 4) -> tuple[str, list[list[dict]]]:
    """(model folder, [[row, ...], ...]) from the cache, made with TuneBoard's tokenization when missing."""
    if not CACHE.exists():
        sys.path.insert(0, str(REPO))
        sys.path.insert(0, str(REPO / "bench"))
        import make_data
        import yaml

        from backend.dataprep.data import load_examples
        from backend.training.models import load_tokenizer, materialize_gguf, resolve_model
        from backend.core.paths import default_model_file
        from backend.dataprep.preprocess import build_sft_dataset
        from backend.dataprep.resolve import pick_template

        make_data.main()
        folder = materialize_gguf(default_model_file())
        recipe = yaml.safe_load((REPO / "bench" / "recipe.yaml").read_text())
        resolved = resolve_model(str(folder))
        tokenizer = load_tokenizer(resolved)
        template = pick_template(recipe["template"], resolved, tokenizer)
        examples, _ = load_examples(recipe["dataset"], REPO / recipe["dataset_dir"])
        rows, _ = build_sft_dataset(examples, template, tokenizer, recipe["cutoff_len"])
        rows = [{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in rows[:64]]
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps({"model": str(folder), "rows": rows}))
    data = json.loads(CACHE.read_text())
    rows = data["rows"]
    return data["model"], [rows[i * batch:(i + 1) * batch] for i in range(n_batches)]


def collate(rows: list[dict], padding_free: bool) -> dict:
    if padding_free:
        ids, labels, pos = [], [], []
        for r in rows:
            ids += r["input_ids"]
            labels += [-100] + r["labels"][1:]
            pos += list(range(len(r["input_ids"])))
        return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]), "position_ids": torch.tensor([pos])}
    longest = max(len(r["input_ids"]) for r in rows)
    pad = lambda xs, v: xs + [v] * (longest - len(xs))  # noqa: E731
    return {"input_ids": torch.tensor([pad(r["input_ids"], 0) for r in rows]),
            "labels": torch.tensor([pad(r["labels"], -100) for r in rows]),
            "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows])}


def build(folder: str, mode: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    words = mode.split("-")
    bf16 = "bf16" in words
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if bf16 else torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    if "ckpt" in words and "no" not in words:
        if "selective" in mode:
            sys.path.insert(0, str(REPO))
            from backend.training.models import enable_checkpointing

            enable_checkpointing(model, "selective")
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": "nonreentrant" not in mode})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if "chunked" in words:
        sys.path.insert(0, str(REPO))
        from backend.training.models import install_chunked_loss

        problem = install_chunked_loss(model)
        assert problem is None, problem
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    return model, optimizer, bf16


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="padded-plain-ckpt-reentrant,padded-plain-ckpt-nonreentrant,"
                        "padding-free-chunked-ckpt-nonreentrant")
    parser.add_argument("--torch-profile", default="", help="a mode to run under torch.profiler (top ops printed)")
    args = parser.parse_args()
    folder, bs = batches(args.steps + 1)
    modes = args.modes.split(",")
    built = {m: build(folder, m) for m in modes}
    times: dict[str, dict[str, list[float]]] = {m: {"fwd": [], "bwd": [], "opt": [], "step": []} for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for m in modes:
            model, opt, bf16 = built[m]
            pf = "padding-free" in m
            for i, rows in enumerate(bs):
                batch = collate(rows, pf)
                ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
                t0 = time.perf_counter()
                with ctx:
                    loss = model(**batch).loss
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                if round_ == 0:
                    losses[m].append(loss.item())
                if i == 0:
                    continue  # warm-up
                for k, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2), ("step", t3 - t0)):
                    times[m][k].append(v)
    first = statistics.median(times[modes[0]]["step"])
    import peft
    import transformers

    print(f"torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__} "
          f"threads {torch.get_num_threads()}")
    for m in modes:
        med = {k: statistics.median(v) for k, v in times[m].items()}
        print(f"{m:45s} fwd {med['fwd']:.2f}  bwd {med['bwd']:.2f}  opt {med['opt']:.3f}  step {med['step']:.2f} s "
              f" ({med['step'] / first:.2f}x)  losses " + " ".join(f"{x:.4f}" for x in losses[m]))
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        model, opt, bf16 = built[args.torch_profile]
        batch = collate(bs[1], "padding-free" in args.torch_profile)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
                loss = model(**batch).loss
            loss.backward()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
