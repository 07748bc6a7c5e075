"""The benchmark recipe (bench/recipe.yaml) as a plain TRL SFTTrainer script: the same rows rendered with a
plain ChatML template (no default system prompt, as TuneBoard's `chatml`), loss on the answer only
(prompt-completion rows), LoRA r=8 on every linear layer, batch 4, max_length 512, lr 2e-4, cosine, 12 steps,
fp32, TRL's defaults otherwise (gradient checkpointing on, padded batches). Writes one JSON line per logged step
to OUTPUT_DIR/trainer_log.jsonl (step, loss), as the other two tools do.

    python bench/trl_sft.py MODEL_DIR OUTPUT_DIR [MAX_STEPS]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
DATA = Path(__file__).resolve().parent / "data" / "extraction_bench.json"


class JsonlLog(TrainerCallback):
    """TRL's logs as trainer_log.jsonl rows (step + the `logged` keys), as TuneBoard's run folder has them."""

    def __init__(self, path: Path, logged: tuple[str, ...] = ("loss",)):
        self.path, self.logged = path, logged

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, **{k: logs[k] for k in self.logged if k in logs}}) + "\n")


def prepare(model_dir: str, output_dir: str):
    """The model's tokenizer with the benchmark's chatml template, and the output folder with no earlier log."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHATML
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_log.jsonl").unlink(missing_ok=True)
    return tokenizer, out


def main(model_dir: str, output_dir: str, max_steps: int = 12) -> None:
    rows = json.loads(DATA.read_text())
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"{r['instruction']}\n{r['input']}"}],
         "completion": [{"role": "assistant", "content": r["output"]}]} for r in rows])
    tokenizer, out = prepare(model_dir, output_dir)
    config = SFTConfig(output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                       learning_rate=2e-4, lr_scheduler_type="cosine", max_steps=max_steps, logging_steps=1,
                       save_strategy="no", report_to="none", seed=42, max_length=512, bf16=False, fp16=False,
                       use_cpu=True, disable_tqdm=True)
    peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft, callbacks=[JsonlLog(out / "trainer_log.jsonl")])
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
