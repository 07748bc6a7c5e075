"""A DPO batch with each prompt computed once for both of its answers.

TRL's DPOTrainer runs a batch of B pairs as 2B rows, [chosen rows; rejected rows], each row its prompt followed by
one answer: every prompt goes through the model twice, in the policy's forward and backward and in the
reference's forward. Here the pair is one row instead, prompt + chosen + rejected, with an attention mask that lets
the rejected answer see the prompt but not the chosen answer, and position ids that start the rejected answer
where the prompt ends, so every token sees what it saw in its own row: the same hidden states, log-probabilities
and gradients (the prompt's gradient is the sum of what its two copies got). For the bench's extraction pairs the
prompt is ~40% of a row's tokens, so a step computes ~30% fewer tokens. The 2B rows' hidden states are gathered back
from the packed rows, so the head and the trainer see the layout they expect.

`pair_layout` checks a batch is such pairs (the two halves share each prompt's tokens; rows flush left, as TRL's
collator makes them); anything else (KTO, eval rows that are not pairs, a model whose attention would not take the
mask) keeps the rows as they are. TUNEBOARD_SHARED_PROMPT=0 switches it off (side-by-side measurements).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from backend.training.attention import NAME as VARLEN_SDPA

BOOL_MASK_ATTENTION = ("sdpa", VARLEN_SDPA)  # take a boolean 4D mask as it is (True = attend)
FLOAT_MASK_ATTENTION = ("eager",)  # add a float 4D mask to the scores


def enabled() -> bool:
    return os.environ.get("TUNEBOARD_SHARED_PROMPT", "1") != "0"


@dataclass
class PairLayout:
    input_ids: torch.Tensor  # [B, T]: prompt, chosen answer, rejected answer, padding
    position_ids: torch.Tensor  # [B, T]
    segment: torch.Tensor  # [B, T]: 0 prompt, 1 chosen, 2 rejected, -1 padding
    gather: torch.Tensor  # [2B * L]: for each position of the 2B rows, its position in the flattened packed rows

    def attention_mask(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, T, T]: causal within the packed row, a prompt token sees the prompt only, an answer token the
        prompt and its own answer; padding sees itself only (no empty softmax row)."""
        width = self.segment.shape[1]
        order = torch.arange(width, device=self.segment.device)
        causal = order[None, :] <= order[:, None]
        query, key = self.segment[:, :, None], self.segment[:, None, :]
        allowed = causal & ((key == 0) | (key == query)) & (key >= 0) & (query >= 0)
        allowed |= torch.eye(width, dtype=torch.bool, device=allowed.device)
        allowed = allowed[:, None]
        if kind == "bool":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)


def pair_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor) -> PairLayout | None:
    """The packed layout of a [chosen rows; rejected rows] batch, or None when the batch is not such pairs."""
    rows, length = input_ids.shape
    if rows == 0 or rows % 2 or labels is None or labels.shape != input_ids.shape:
        return None
    pairs = rows // 2
    device = input_ids.device
    order = torch.arange(length, device=device)
    lengths = (attention_mask.long().sum(1) if attention_mask is not None
               else torch.full((rows,), length, device=device))
    if attention_mask is not None and not torch.equal(attention_mask.bool(), order[None, :] < lengths[:, None]):
        return None  # not flush left
    labelled = labels != -100
    if not bool(labelled.any(1).all()):
        return None
    prompt = labelled.int().argmax(1)  # the first answer token: the prompt's length
    if not torch.equal(prompt[:pairs], prompt[pairs:]) or int(prompt.min()) < 1:
        return None
    in_prompt = order[None, :] < prompt[:pairs, None]
    if not torch.equal(input_ids[:pairs][in_prompt], input_ids[pairs:][in_prompt]):
        return None
    p, chosen_end, rejected = prompt[:pairs], lengths[:pairs], lengths[pairs:] - prompt[pairs:]
    width = int((chosen_end + rejected).max())

    # packed index j of each packed slot: the prompt and chosen answer as in the chosen row, then the rejected answer
    slot = torch.arange(width, device=device)[None, :].expand(pairs, width)
    is_chosen_part = slot < chosen_end[:, None]
    is_rejected = ~is_chosen_part & (slot < (chosen_end + rejected)[:, None])
    source_row = torch.where(is_chosen_part, torch.arange(pairs, device=device)[:, None],
                             torch.arange(pairs, rows, device=device)[:, None])
    source_col = torch.where(is_chosen_part, slot, slot - chosen_end[:, None] + p[:, None])
    valid = is_chosen_part | is_rejected
    source_col = torch.where(valid, source_col, torch.zeros_like(source_col))
    packed_ids = torch.where(valid, input_ids[source_row, source_col], input_ids[:pairs, :1].expand(pairs, width))
    segment = torch.where(slot < p[:, None], 0, torch.where(is_chosen_part, 1, torch.where(is_rejected, 2, -1)))
    positions = torch.where(valid, source_col, torch.zeros_like(source_col))

    # where each of the 2B rows' positions lives in the flattened packed rows (padding: any slot, it is unlabelled)
    pair_of_row = torch.arange(rows, device=device) % pairs
    col = order[None, :].expand(rows, length)
    rejected_answer = (torch.arange(rows, device=device)[:, None] >= pairs) & (col >= prompt[:, None])
    packed_col = torch.where(rejected_answer, col - prompt[:, None] + chosen_end[pair_of_row][:, None], col)
    inside = col < lengths[:, None]
    packed_col = torch.where(inside, packed_col, torch.zeros_like(packed_col)).clamp(max=width - 1)
    gather = (pair_of_row[:, None] * width + packed_col).reshape(-1)
    return PairLayout(packed_ids, positions, segment, gather)


def mask_kind(config) -> str | None:
    """'bool' or 'float': the 4D mask this model's attention takes as it is; None when it takes none (flash, flex)
    or would not apply it the same way (a sliding window: checked per batch by `fits`)."""
    attention = getattr(config, "_attn_implementation", None)
    if attention in BOOL_MASK_ATTENTION:
        return "bool"
    if attention in FLOAT_MASK_ATTENTION:
        return "float"
    return None


def fits(config, layout: PairLayout) -> bool:
    """A sliding window narrower than the packed row would be ignored by the custom mask."""
    window = getattr(config, "sliding_window", None)
    return window is None or int(window) >= layout.input_ids.shape[1]


def packed_hidden(backbone, layout: PairLayout, kind: str, rows: int, length: int) -> torch.Tensor:
    """The backbone's last hidden states of the 2B rows, [2B, L, H], computed on the packed pairs."""
    dtype = backbone.get_input_embeddings().weight.dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    hidden = backbone(input_ids=layout.input_ids, position_ids=layout.position_ids,
                      attention_mask=layout.attention_mask(kind, dtype), use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[layout.gather].view(rows, length, hidden.shape[-1])
