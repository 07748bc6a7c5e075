"""The GRPO benchmark recipe (bench/recipe_grpo.yaml) as a plain TRL GRPOTrainer script: the prompts of
extraction_short (one listing line each, bench/make_prompts.py) rendered with a plain ChatML template (no default
system prompt, as TuneBoard's `chatml`), 4 completions a step = 1 prompt x 4 generations, at most 64 new tokens,
reward json_valid (1.0 when the completion parses as JSON, a ```json fence allowed, as TuneBoard's built-in),
beta 0.04 (the reference: the base with the adapter disabled), temperature 0.9, top_p 1.0, LoRA r=8 on every
linear layer, lr 1e-5, cosine, fp32, TRL's defaults otherwise. Writes one JSON line per logged step to
OUTPUT_DIR/trainer_log.jsonl (step, loss, reward, kl, completions/mean_length), as TuneBoard does.

    python bench/trl_grpo.py MODEL_DIR OUTPUT_DIR [MAX_STEPS]
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from trl_sft import JsonlLog, prepare  # bench/trl_sft.py, on sys.path: this script's own folder

DATA = Path(__file__).resolve().parent / "data" / "rl" / "extraction_short.json"
LOGGED = ("loss", "reward", "kl", "completions/mean_length")


def json_valid(completions, **kwargs) -> list[float]:
    rewards = []
    for completion in completions:
        text = completion[0]["content"] if isinstance(completion, list) else completion
        fenced = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", text, re.S)
        try:
            json.loads(fenced.group(1) if fenced else text)
            rewards.append(1.0)
        except ValueError:
            rewards.append(0.0)
    return rewards


def main(model_dir: str, output_dir: str, max_steps: int = 6) -> None:
    rows = json.loads(DATA.read_text())
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{r['instruction']}\n{r['input']}"}]}
                                 for r in rows])
    tokenizer, out = prepare(model_dir, output_dir)
    config = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                        num_generations=4, max_completion_length=64, beta=0.04, temperature=0.9, top_p=1.0,
                        learning_rate=1e-5, lr_scheduler_type="cosine", max_steps=max_steps, logging_steps=1,
                        save_strategy="no", report_to="none", seed=42, bf16=False, fp16=False, use_cpu=True,
                        disable_tqdm=True)
    peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=json_valid, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft, callbacks=[JsonlLog(out / "trainer_log.jsonl", LOGGED)])
    trainer.train()


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or not all(a.isdigit() for a in sys.argv[3:]):
        sys.exit("usage: python bench/trl_grpo.py MODEL_DIR OUTPUT_DIR [MAX_STEPS]")
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
