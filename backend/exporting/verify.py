"""The export's verification process: `python -m backend.exporting.verify REQUEST.json` reloads an export with
nothing of the exporting process carried over and saves what backend/exporting/export.py compares with the model it
exported from (logits and greedy answers on the probe prompts, chat renders, token ids, eos ids, the GGUF file's
tokenizer and chat keys), or a reward model's pair scores. It imports only torch, transformers and gguf (it starts
once per export); the reference outputs are computed with the same `logits` / `greedy` in the exporting process."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

GREEDY_TOKENS = 12


def logits(model, prompts: list[list[int]]):
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            out.append(model(input_ids=x).logits[0].float().cpu())
    return out


def greedy(model, prompts: list[list[int]], stop_ids: list[int], pad_id: int | None) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=GREEDY_TOKENS,
                                 do_sample=False, eos_token_id=stop_ids, pad_token_id=pad_id)
            out.append(gen[0][len(ids):].tolist())
    return out


def forced_logprobs(model, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced: for each prompt followed by its answer, the log-softmax of the next-token logits at the
    answer's positions, [len(answer) + 1, vocab]: row k is what the model gives answer[k] given the prompt and
    answer[:k]; the last row what it gives after the whole answer (an end-of-turn id when the answer stopped)."""
    out = []
    with torch.no_grad():
        for ids, answer in zip(prompts, answers):
            x = torch.tensor([ids + answer], device=model.device)
            rows = model(input_ids=x).logits[0, len(ids) - 1:].float()
            out.append(torch.log_softmax(rows, dim=-1).cpu())
    return out


def main(request_path: str) -> int:
    """Child process: load the export, compute what the parent compares, torch.save it."""
    req = json.loads(Path(request_path).read_text(encoding="utf-8"))
    if req.get("reward"):
        return _reward_main(req)
    folder, gguf_file = req["dir"], req.get("gguf_file")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file:
        _parse_gguf_once()
    dtype = torch.float32 if gguf_file else getattr(torch, req["dtype"])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(req["device"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    result = {
        "logits": logits(model, req["prompts"]),
        "greedy": greedy(model, req["prompts"], req["stop_ids"], tokenizer.pad_token_id),
        "renders": [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                    for m in req["conversations"]],
        "ids": [tokenizer(t, add_special_tokens=False).input_ids for t in req["rendered"]],
        "eos_ids": _eos_ids(model.generation_config),
        "shards": sorted(p.name for p in Path(folder).glob("*.safetensors")),
    }
    if gguf_file:
        result["gguf"] = read_gguf_metadata(Path(folder) / gguf_file)
    torch.save(result, req["out"])
    return 0


def _parse_gguf_once() -> None:
    """In this process only: transformers opens the GGUF file three times (config, weights, tokenizer) and
    read_gguf_metadata a fourth, and gguf's reader parses every vocabulary string each time (~5 s for a 49k
    vocabulary, most of a verification); each file is parsed once instead (the reader is read-only)."""
    parse, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader


def _reward_main(req: dict) -> int:
    """Child process, reward model export: reload it as a sequence classifier and score the probe pairs."""
    from backend.evaluation.reward_score import score_pairs  # the reward path only: it brings peft and the trainer

    folder = req["dir"]
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=getattr(torch, req["dtype"]))
    model = model.to(req["device"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    result = {
        # one batch, right-padded: the score must be read at each sequence's last non-pad token
        "scores": score_pairs(model, tokenizer, req["rows"], batch_size=len(req["rows"])),
        "architecture": type(model).__name__, "num_labels": model.config.num_labels,
        "pad_token_id": model.config.pad_token_id, "tokenizer_pad_id": tokenizer.pad_token_id,
        "renders": [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                    for m in req["conversations"]],
        "ids": [tokenizer(t, add_special_tokens=False).input_ids for t in req["rendered"]],
        "shards": sorted(p.name for p in Path(folder).glob("*.safetensors")),
    }
    torch.save(result, req["out"])
    return 0


def _eos_ids(generation_config) -> list[int]:
    eos = getattr(generation_config, "eos_token_id", None)
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def read_gguf_metadata(path: Path) -> dict:
    """The tokenizer and chat keys of a GGUF file (what llama.cpp / Ollama read to template and stop)."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "general.file_type"):
        field = reader.fields.get(key)
        if field is None:
            continue
        value = field.contents() if hasattr(field, "contents") else field.parts[-1].tolist()
        out[key] = value
    out["tensor_count"] = len(reader.tensors)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
