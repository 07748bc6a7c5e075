"""Reward-model scoring: ranking pairs -> (chosen score, rejected score) with a reward model (a one-output score
head, saved by stage rm), the pairwise metrics, the per-pair file, and how an rm run's folder reloads. A library
module: the rm stage (its do_predict), `tuneboard eval` with stage rm and `tuneboard export` (reward checks)
import it, and the online RL stages (grpo, rloo), where a reward model scores completions (RewardModelReward), and
`tuneboard api --reward-model`, which scores texts over HTTP with it (RewardModelReward.score_texts).

The score of a sequence is the head's output at its last token that is not the pad token (transformers'
rule), so the model config carries the tokenizer's pad token, here and when reloaded.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from backend.training.adapters import apply_finetuning
from backend.training.models import load_model, load_tokenizer, model_folder, resolve_model
from backend.dataprep.preference import build_preference_dataset, scored_ids
from backend.dataprep.resolve import pick_template
from backend.core.rundir import SPEC_FILE, is_reward_model_dir  # the one light check (the web UI uses it too)


def sequences(row: dict) -> dict:
    """A preference row -> the two full sequences TRL's reward collator takes."""
    return {"chosen_ids": row["prompt_ids"] + row["chosen_ids"], "rejected_ids": row["prompt_ids"] + row["rejected_ids"]}


def set_pad_token(model, tokenizer) -> None:
    """The score is read at the last non-pad token: the model must know the tokenizer's pad id."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id


def encode_pairs(examples: list[dict], template, tokenizer, cutoff_len, log=None) -> list[tuple[dict, dict]]:
    """(example, preference row) for each ranking example that encodes; why the others do not goes to log."""
    pairs = []
    for example in examples:
        try:
            rows, _ = build_preference_dataset([example], template, tokenizer, cutoff_len)
        except ValueError as exc:
            if log:
                log(str(exc))
            continue
        pairs.append((example, rows[0]))
    return pairs


def score_pairs(model, tokenizer, rows: list[dict], batch_size: int = 8, *, stop=None,
                progress=None) -> list[tuple[float, float]]:
    """(chosen score, rejected score) of each preference row, batched and right-padded like training.
    stop() -> a reason or None, asked before each batch: the pairs scored by then are returned.
    progress(n): called with the number of pairs scored so far."""
    flat = [seq for row in rows for seq in (sequences(row)["chosen_ids"], sequences(row)["rejected_ids"])]
    # a pair's two sequences always share a batch
    scores = score_sequences(model, tokenizer.pad_token_id, flat, 2 * max(batch_size, 1), stop=stop,
                             progress=(lambda n: progress(n // 2)) if progress else None)
    return list(zip(scores[0::2], scores[1::2]))


def score_sequences(model, pad_token_id: int, flat: list[list[int]], batch_size: int = 8, *, stop=None,
                    progress=None) -> list[float]:
    """The score of each token sequence, in batches of `batch_size`, right-padded like training (no gradient).
    stop() -> a reason or None, asked before each batch; progress(n): sequences scored so far."""
    scores: list[float] = []
    device = next(model.parameters()).device
    step = max(batch_size, 1)
    with torch.no_grad():
        for i in range(0, len(flat), step):
            if stop and stop():
                break
            chunk = flat[i:i + step]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, seq in enumerate(chunk):
                ids[j, :len(seq)] = torch.tensor(seq, dtype=torch.long)
                mask[j, :len(seq)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            scores.extend(float(x) for x in logits.float().view(-1))
            if progress:
                progress(len(scores))
    return scores


def pair_metrics(scores: list[tuple[float, float]]) -> dict:
    """Pairwise accuracy (chosen scored above rejected), mean margin and mean scores."""
    n = max(len(scores), 1)
    return {
        "accuracy": sum(c > r for c, r in scores) / n,
        "margin": sum(c - r for c, r in scores) / n,
        "rewards/chosen": sum(c for c, _ in scores) / n,
        "rewards/rejected": sum(r for _, r in scores) / n,
        "pairs": len(scores),
    }


def write_scores(path: Path, examples: list[dict], scores: list[tuple[float, float]]) -> None:
    """One JSON line per pair: where it comes from, its question and two answers (what the Evaluate tab's
    pair view shows), both scores, whether the chosen one won."""
    with open(path, "w", encoding="utf-8") as f:
        for i, (example, (chosen, rejected)) in enumerate(zip(examples, scores)):
            f.write(json.dumps({"index": i, "source": example.get("_source"), "row": example.get("_row"),
                                "question": _last_user_text(example), "chosen": _answer_text(example, "chosen"),
                                "rejected": _answer_text(example, "rejected"),
                                "chosen_score": chosen, "rejected_score": rejected, "margin": chosen - rejected,
                                "correct": chosen > rejected}, ensure_ascii=False) + "\n")


def _last_user_text(example: dict) -> str:
    turn = next((m for m in reversed(example.get("messages") or []) if m.get("role") == "user"), None)
    return "" if turn is None else str(turn.get("content") or "")


def _answer_text(example: dict, key: str) -> str:
    answer = example.get(key)
    return str(answer.get("content") or "") if isinstance(answer, dict) else str(answer or "")


def reward_model_location(path: str | Path) -> tuple[str, str | None]:
    """(model_name_or_path, adapter_name_or_path) that load a reward model run dir (for PPO's reward_model):
    a full model is its own folder; an adapter goes on the base model its run_spec.yaml names (else the
    base recorded in adapter_config.json)."""
    path = Path(path).expanduser().resolve()
    if not is_reward_model_dir(path):
        raise ValueError(f"{path} is not a reward model (train one with stage: rm)")
    if not (path / "adapter_config.json").is_file():
        return str(path), None
    spec_file = path / SPEC_FILE
    base = None
    if spec_file.is_file():
        base = (yaml.safe_load(spec_file.read_text(encoding="utf-8")) or {}).get("model_name_or_path")
    if not base:
        base = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    return str(base), str(path)


def load_reward_model(spec, resolved=None, *, warn=None):
    """(model, tokenizer) for scoring: spec.model_name_or_path with a score head, plus adapter_name_or_path.
    Refuses a model / adapter that no rm run saved (its score head would be random)."""
    adapters = [a.strip() for a in str(spec.adapter_name_or_path or "").split(",") if a.strip()]
    holder = adapters[-1] if adapters else spec.model_name_or_path
    if not is_reward_model_dir(holder if adapters else _model_folder(spec, resolved)):
        field = "adapter_name_or_path" if adapters else "model_name_or_path"
        raise ValueError(f"{field}: {holder} is not a reward model (no trained score head): give the output_dir "
                         "of a stage rm run")
    resolved = resolved or resolve_model(spec.model_name_or_path)
    tokenizer = load_tokenizer(resolved)
    model = load_model(spec, resolved, for_training=False, warn=warn, reward_head=True)
    if adapters:
        model = apply_finetuning(model, spec, for_training=False, warn=warn)
    set_pad_token(model, tokenizer)
    model.eval()
    return model, tokenizer


def _model_folder(spec, resolved) -> Path:
    return model_folder(resolved or resolve_model(spec.model_name_or_path))


# the keys of an rm run's run_spec.yaml that say how its model loads and how it renders what it scores
# (trust_remote_code is not one of them: the spec that uses the reward model decides whether its code runs)
_RM_LOAD_KEYS = ("finetuning_type", "quantization_bit", "quantization_method", "quantization_type",
                 "double_quantization", "template", "enable_thinking", "rope_scaling", "resize_vocab",
                 "new_special_tokens", "cutoff_len", "flash_attn", "bf16", "fp16", "pure_bf16")


def reward_model_spec(path: str | Path, *, trust_remote_code: bool = False):
    """How to load the reward model in `path` (an rm run's output_dir, or a sequence-classification model folder):
    its run_spec.yaml's loading keys when it has one (LoRA: its base model + the folder as the adapter), else a
    full model with the tokenizer's own chat template; trust_remote_code is the caller's (its spec's)."""
    model, adapter = reward_model_location(path)
    saved = {}
    spec_file = Path(path).expanduser() / SPEC_FILE
    if spec_file.is_file():
        saved = yaml.safe_load(spec_file.read_text(encoding="utf-8")) or {}
    keys = {key: saved[key] for key in _RM_LOAD_KEYS if saved.get(key) is not None}
    keys.setdefault("template", "auto")
    keys.setdefault("cutoff_len", 1024)
    keys["finetuning_type"] = keys.get("finetuning_type", "lora") if adapter else "full"
    return SimpleNamespace(**keys, model_name_or_path=model, adapter_name_or_path=adapter,
                           trust_remote_code=trust_remote_code)


class RewardModelReward:
    """A reward model as a reward function of the online RL stages (TRL's signature, rewards/<name>/mean|std):
    loaded once (eval mode, no gradients), it scores each prompt's conversation + completion rendered by the reward
    model's own template (the rm run's), as stage rm scored its pairs: the same tokens, cut the same way."""

    def __init__(self, path: str, name: str, *, batch_size: int = 8, warn=None, trust_remote_code: bool = False):
        self.__name__ = name  # TRL names the metrics rewards/<name>/mean|std after it
        self.path, self.batch_size = path, batch_size
        spec = reward_model_spec(path, trust_remote_code=trust_remote_code)
        self.cutoff_len = spec.cutoff_len
        resolved = resolve_model(spec.model_name_or_path)
        self.model, self.tokenizer = load_reward_model(spec, resolved, warn=warn)
        self.model.requires_grad_(False)
        self.placed = bool(getattr(self.model, "hf_device_map", None))  # a quantized model loads onto its device
        self.template = pick_template(spec.template, resolved, self.tokenizer, warn=warn or print,
                                      enable_thinking=getattr(spec, "enable_thinking", True))

    def __call__(self, prompts, completions, conversation=None, **kwargs) -> list[float | None]:
        """One score per completion; None where the template renders no answer token (not counted)."""
        if conversation is None:
            raise ValueError(f"reward model {self.path}: the rows carry no conversation to render")
        self._place()
        sequences_, where = [], []
        for i, (row, completion) in enumerate(zip(conversation, completions)):
            ids = scored_ids(json.loads(row), completion, self.template, self.tokenizer, self.cutoff_len)
            if ids is not None:
                sequences_.append(ids)
                where.append(i)
        out: list[float | None] = [None] * len(completions)
        for i, score in zip(where, score_sequences(self.model, self.tokenizer.pad_token_id, sequences_,
                                                   self.batch_size)):
            out[i] = score
        return out

    def _place(self) -> None:
        if not self.placed:  # on the first call: the trainer has picked this process's GPU by then
            if torch.cuda.is_available():
                self.model.to(torch.cuda.current_device())
            self.placed = True

    def score_texts(self, texts: list[str], max_length: int | None = None) -> list[float]:
        """The score of each text as it stands (already rendered, special tokens written out: what a scoring
        endpoint receives, backend.serving.api's POST /v1/score/evaluation): tokenized without adding special
        tokens, cut to its last max_length (default: the rm run's cutoff_len) tokens, since the score is read at
        the last token. A text rendered by the reward model's template from a conversation + answer gets the same
        score as __call__ gives that answer."""
        self._place()
        limit = max_length or self.cutoff_len
        ids = [self.tokenizer(text, add_special_tokens=False)["input_ids"][-limit:] or [self.tokenizer.pad_token_id]
               for text in texts]
        return score_sequences(self.model, self.tokenizer.pad_token_id, ids, self.batch_size)
