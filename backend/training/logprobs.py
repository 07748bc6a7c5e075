"""Per-token log-probabilities for TRL's DPO and KTO trainers in small tiles: never more than one tile of logits.

TRL 1.16's preference trainers get log-probabilities from `model(..., labels=..., fused_lm_head=True)`
(trl.trainer.utils.add_fused_lm_head, kernel trl.kernels.ChunkedLogProbFunction). On a CPU (no Triton) that head
scores EVERY position, prompt and padding too, in tiles of 4,096 tokens x 32,768 vocabulary entries (512 MB in
fp32), and its torch fold makes several tile-sized temporaries in the forward and again in the backward: for the
bench recipe (8 sequences of up to 512 tokens, vocabulary 49,152) ~2-3 GB at once, as much as full logits.

`install_lean_logprobs` replaces that head's forward with one that runs the same TRL kernel (same log-probabilities,
entropy, mean logits, top-1 flags; its backward recomputes each tile) on the labelled positions only, TILE_TOKENS
tokens at a time with TILE_VOCAB vocabulary entries a tile (16 MB). Anything else (no fused_lm_head: generation,
the plain loss; MoE router logits) goes to TRL's forward. A probe on the model compares both heads first.
TUNEBOARD_CHUNKED_LOSS=0 keeps TRL's head (bench/run.py's plain-loss lever).
"""
from __future__ import annotations

import functools
import os
import types

import torch
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import FusedCausalLMOutput

from backend.training import shared_prompt
from backend.training.attention import use_varlen_attention

TILE_TOKENS = 1024
TILE_VOCAB = 4096  # 1024 x 4096 fp32 logits = 16 MB a tile
MODEL_KEYS = {"input_ids", "attention_mask", "use_cache"}  # what TRL's trainers pass (peft adds None-valued keys)
# configs whose logits are scaled before the softmax: TRL's head handles them, this one keeps out
SCALED = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    outputs: tuple[str, ...], softcap: float | None = None) -> tuple:
    """TRL's ChunkedLogProbFunction (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1) of hidden [N, H]
    -> logits [N, V], TILE_TOKENS rows at a time (each its own autograd node, recomputed in the backward)."""
    pieces = [ChunkedLogProbFunction.apply(hidden[start:start + TILE_TOKENS], weight, bias,
                                           targets[start:start + TILE_TOKENS], 1.0, TILE_VOCAB, softcap, 1.0, outputs)
              for start in range(0, max(hidden.shape[0], 1), TILE_TOKENS)]
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*pieces))


def install_lean_logprobs(model, outputs: tuple[str, ...] = ("log_probs",)) -> str | None:
    """Swap TRL's fused LM head of `model` (a trainer's model or reference model, peft-wrapped or not) for the lean
    one computing `outputs`. None when installed, else why not (TRL's head stays)."""
    if os.environ.get("TUNEBOARD_CHUNKED_LOSS", "1") == "0":
        return "TUNEBOARD_CHUNKED_LOSS=0"
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "forward" not in vars(lm):
        return f"{type(lm).__name__} has no fused LM head from TRL"
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    if getattr(text, "output_router_logits", False):
        return "a mixture-of-experts model (router logits)"
    if any(getattr(text, name, None) is not None for name in SCALED):
        return "its logits are scaled before the softmax"
    softcap = getattr(text, "final_logit_softcapping", None) or None
    trl_forward = lm.forward

    @functools.wraps(type(lm).forward)  # the original signature: generate() checks its kwargs against it
    def lean_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                     **kwargs):
        if not fused_lm_head or kwargs.get("output_router_logits"):
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden, stash = None, None
        pairs_kind, rows = getattr(self, "_shared_prompt", None), getattr(self, "_pack_rows", False)
        pending, continued = getattr(self, "_kl_pending", None), getattr(self, "_kl_continued", None)
        if pending is not None and not pending.is_batch_of(kwargs.get("input_ids")):
            pending = None  # another forward (the batch's own comes later)
        if ((pairs_kind or rows) and not args and shift_labels is None and "input_ids" in kwargs
                and all(value is None for key, value in kwargs.items() if key not in MODEL_KEYS)):
            ids, mask, kind = kwargs["input_ids"], kwargs.get("attention_mask"), pairs_kind
            if continued is not None and continued.input_ids is ids:
                packed, kind = continued, "varlen"
            else:
                packed = shared_prompt.find_pairs(ids, mask, labels) if pairs_kind else None
                if packed is None and rows:
                    packed, kind = shared_prompt.find_rows(ids, mask), "varlen"
            if packed is not None and shared_prompt.fits(text, packed):
                if pending is not None and isinstance(packed, shared_prompt.Rows) and min(pending.prompt) >= 1:
                    stash = shared_prompt.PrefixStash([p - 1 for p in pending.prompt])
                hidden = shared_prompt.packed_hidden(self.base_model, packed, kind, stash)
                self.packed_batches += 1
        if hidden is None:
            hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, shift_labels = hidden[:, :-1], labels[:, 1:]
        head = self.get_output_embeddings()
        shift_labels = shift_labels.to(head.weight.device)
        mask = shift_labels != -100
        fields = token_log_probs(hidden.to(head.weight.device)[mask], head.weight, head.bias, shift_labels[mask],
                                 outputs, softcap)
        # masked_scatter keeps an all-prompt batch connected to the graph (a zero with a gradient), as TRL's does
        log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = (
            None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in fields)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        output = FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                                     log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1,
                                     label_mask=mask)
        if pending is not None:  # the batch's own forward: now its KL rows, continuing its rows' prompts
            self._kl_pending = None
            pending.fill(self, stash)
        return output

    lm.forward = types.MethodType(lean_forward, lm)
    problem = _probe(model, trl_forward, outputs)
    if problem:
        lm.forward = trl_forward
    return problem


class PendingKL:
    """KTO's policy KL rows of one batch (each row's prompt with another row's answer: KL_input_ids and its masks),
    asked for before the batch's own forward (TRL asks in that order) and computed right after it, by the lean head
    of the policy (`_kl_pending`): continuing each row's prompt from the keys and values that forward kept
    (shared_prompt.Continuations), so the KL rows' prompts are not computed again; as a forward of their own where
    that cannot be (a layer without an index, rows that do not share their prompts). `out`: the rows' summed
    answer log-probabilities, filled in place (TRL reads them only after the batch's forward)."""

    def __init__(self, batch: dict):
        self.batch = batch
        self.prompt = batch["completion_mask"].int().argmax(1).tolist()  # flush-left rows: the first answer token
        self.out = torch.full((batch["input_ids"].shape[0],), float("nan"), device=batch["input_ids"].device)
        self.continued = False

    def is_batch_of(self, input_ids) -> bool:
        ids = self.batch["input_ids"]
        return input_ids is not None and (input_ids is ids or (input_ids.shape == ids.shape
                                                               and torch.equal(input_ids, ids)))

    def continuations(self, stash) -> shared_prompt.Continuations | None:
        """The KL rows as continuations of the stashed prompts, or None when they are not such rows."""
        b = self.batch
        if stash is None or stash.failed or not stash.layers or min(self.prompt) < 1:
            return None
        ids, mask, answer = b["KL_input_ids"], b["KL_attention_mask"].bool(), b["KL_completion_mask"].bool()
        lengths = mask.long().sum(1)
        order = torch.arange(ids.shape[1], device=ids.device)
        if not torch.equal(mask, order[None, :] < lengths[:, None]):
            return None  # not flush left
        for r, p in enumerate(self.prompt):  # row r's KL row: the same prompt tokens, then its answer
            if p > ids.shape[1] or not torch.equal(ids[r, :p], b["input_ids"][r, :p]) or answer[r, :p].any() \
                    or not answer[r, p:int(lengths[r])].all():
                return None
        return shared_prompt.Continuations(ids, self.prompt, lengths.tolist(), stash)

    def fill(self, lm, stash) -> None:
        b = self.batch
        labels = b["KL_input_ids"].masked_fill(b["KL_completion_mask"] == 0, -100)
        continued = self.continuations(stash)
        lm._kl_continued = continued
        try:
            with torch.no_grad():
                out = lm(input_ids=b["KL_input_ids"], attention_mask=b["KL_attention_mask"], labels=labels,
                         fused_lm_head=True)
        finally:
            lm._kl_continued = None
            if stash is not None:
                stash.layers = {}  # the checkpointed layers' recompute keeps no copy either
        self.out.copy_(out.log_probs.sum(-1))
        self.continued = continued is not None


def kl_after_rows(model, batch: dict) -> torch.Tensor | None:
    """KTO's policy KL log-probabilities of `batch`, to be filled by the batch's own forward right after it
    (PendingKL), or None where the policy's lean head does not pack rows (then TRL's own forward computes them)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(lm, "_pack_rows", False) or getattr(lm, "_kl_pending", None) is not None:
        return None
    lm._kl_pending = PendingKL(batch)
    return lm._kl_pending.out


def kl_left_pending(model) -> bool:
    """After a KTO batch: True (and cleared) when its KL rows were asked for but its forward never filled them."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    left = getattr(lm, "_kl_pending", None) is not None
    lm._kl_pending = None
    return left


def _probe(model, trl_forward, outputs: tuple[str, ...]) -> str | None:
    """None when the lean head gives TRL's head's numbers on a few random tokens of this model."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    device = lm.get_output_embeddings().weight.device
    ids = torch.randint(0, min(int(config.vocab_size), 4096), (2, 9), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    labels = ids.masked_fill(torch.arange(9, device=device) < 3, -100)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            lean = model(input_ids=ids, labels=labels, fused_lm_head=True)
            trl = trl_forward(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False)
    except Exception as exc:  # a family whose backbone or head this forward cannot call the same way
        return f"the lean log-probability probe failed ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
    half = lm.get_output_embeddings().weight.dtype != torch.float32
    tolerance = 2e-2 if half else 1e-4
    for name in outputs:
        ours, theirs = getattr(lean, name).float(), getattr(trl, name).float()
        if not (ours - theirs).abs().max().item() <= tolerance * max(1.0, theirs.abs().max().item()):
            return f"its {name} differ from TRL's fused head"
    return None


def share_prompts(model) -> str | None:
    """Have the lean head of `model` (installed first) compute each DPO pair's prompt once
    (backend/training/shared_prompt.py), after a probe that compares pairs packed and as rows: one row of pairs on
    the varlen SDPA where it switches on, else a padded row a pair. None when on, else why not (the rows stay as
    TRL makes them)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not shared_prompt.enabled():
        return "TUNEBOARD_SHARED_PROMPT=0"
    use_varlen_attention(model)
    kind = shared_prompt.attention_kind(lm.config)
    if kind is None:
        return f"attention '{getattr(lm.config, '_attn_implementation', None)}' takes no custom mask"
    problem = _probe_packing(model, kind)
    if problem and kind == "varlen":
        problem = _probe_packing(model, "bool")
    return problem


def pack_rows(model) -> str | None:
    """Have the lean head of `model` (installed first) run a padded batch's rows as one row without padding on the
    varlen SDPA (KTO's single answers: backend/training/shared_prompt.py `find_rows`), after a probe that compares
    them packed and padded. None when on, else why not (the padded rows stay)."""
    if not shared_prompt.enabled():
        return "TUNEBOARD_SHARED_PROMPT=0"
    problem = use_varlen_attention(model)
    if problem:
        return problem
    return _probe_packing(model, "rows")


def _probe_packing(model, kind: str) -> str | None:
    """None (and the lean head packing the `kind` way: 'rows', or pairs as 'varlen' / 'bool' / 'float') when 4 random
    rows, 2 pairs sharing their prompts, give the padded rows' numbers packed."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(int(config.vocab_size), 4096), (n,), generator=generator) for n in (3, 5)]
    answers = [torch.randint(0, min(int(config.vocab_size), 4096), (n,), generator=generator) for n in (4, 2, 1, 5)]
    rows = [torch.cat([prompts[i % 2], answers[i]]) for i in range(4)]  # chosen 0, 1; rejected 2, 3
    ids = torch.zeros(4, 10, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
        labels[i, len(prompts[i % 2]):len(row)] = row[len(prompts[i % 2]):]
    device = lm.get_output_embeddings().weight.device
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device),
             "fused_lm_head": True}
    what = "rows" if kind == "rows" else "pairs"
    kept = (getattr(lm, "_shared_prompt", None), getattr(lm, "_pack_rows", False))  # the other packing, if on
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            _set_packing(lm, None, False)
            plain = model(**batch).log_probs
            _set_packing(lm, None if kind == "rows" else kind, kind == "rows")
            lm.packed_batches = 0
            packed = model(**batch).log_probs
            if lm.packed_batches != 1:
                raise RuntimeError(f"the probe's {what} were not packed")
    except Exception as exc:  # a family whose backbone does not take position ids or masks this way
        _set_packing(lm, *kept)
        return f"the {'packed-rows' if what == 'rows' else 'shared-prompt'} probe failed ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
    _set_packing(lm, *kept)
    half = lm.get_output_embeddings().weight.dtype != torch.float32
    if not (packed - plain).abs().max().item() <= (2e-2 if half else 1e-4) * max(1.0, plain.abs().max().item()):
        return f"packed {what}' log-probabilities differ from the padded rows'"
    if kind == "rows":
        lm._pack_rows = True
    else:
        lm._shared_prompt = kind
    return None


def _set_packing(lm, pairs_kind: str | None, rows: bool) -> None:
    lm._shared_prompt, lm._pack_rows = pairs_kind, rows


def install_on_trainer(trainer, outputs: tuple[str, ...], pairs: bool = False, rows: bool = False) -> str:
    """The lean head on a TRL preference trainer's policy (computing `outputs`, what the trainer logs) and on its
    separate reference model, if any, with each pair's prompt computed once (`pairs`: DPO) or a batch's rows without
    padding (`rows`: KTO; with `pairs` too, the model that computes the reference also packs KTO's rows and KL rows as
    pairs, each prompt once: backend/stages/kto.py `reference_log_probs`); returns the run log's line saying which head
    computes the log-probabilities."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    problem = install_lean_logprobs(policy, outputs)
    if problem:
        return f"log-probabilities: TRL's fused head over every position ({problem})"
    line = (f"log-probabilities: answer tokens only, in tiles of {TILE_TOKENS} tokens x {TILE_VOCAB} vocabulary "
            "entries (no full logits)")
    reference = None
    if getattr(trainer, "ref_model", None) is not None:
        reference = trainer.accelerator.unwrap_model(trainer.ref_model)
        problem = install_lean_logprobs(reference)
        line += f"; the reference model: TRL's fused head ({problem})" if problem else ", the reference model too"
        if problem:
            reference = None
        elif rows:
            problem = pack_rows(reference)
            line += f"; the reference model's rows padded ({problem})" if problem else ""
        elif pairs:
            problem = share_prompts(reference)
            line += f"; the reference model's pairs as two rows ({problem})" if problem else ""
    if rows:
        problem = pack_rows(policy)
        line += f"; the rows padded ({problem})" if problem else "; a batch's rows in one row without padding"
        if pairs and not problem:  # KTO: kl_after_rows engages where the policy packs its rows
            line += "; the policy's KL rows continue its rows' prompts (their keys and values kept, not recomputed)"
        if pairs and (reference is not None or getattr(trainer, "ref_model", None) is None):
            problem = share_prompts(reference if reference is not None else policy)
            line += (f"; the reference's rows and KL rows in two forwards ({problem})" if problem else
                     "; the reference's rows and KL rows in one forward, each prompt computed once")
        return line
    if pairs:
        problem = share_prompts(policy)
        if problem:
            return line + f"; each pair as two rows ({problem})"
        lm = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        how = "the batch's pairs in one row without padding" if lm._shared_prompt == "varlen" else "a padded row a pair"
        line += f"; each pair's prompt computed once for both answers ({how})"
    return line
