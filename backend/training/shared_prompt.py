"""A DPO batch with each prompt computed once for both of its answers.

TRL's DPOTrainer runs a batch of B pairs as 2B rows, [chosen rows; rejected rows], each row its prompt followed by
one answer: every prompt goes through the model twice, in the policy's forward and backward and in the
reference's forward. Here the pair is one row instead, prompt + chosen + rejected, with an attention mask that lets
the rejected answer see the prompt but not the chosen answer, and position ids that start the rejected answer
where the prompt ends, so every token sees what it saw in its own row: the same hidden states, log-probabilities
and gradients (the prompt's gradient is the sum of what its two copies got). For the bench's extraction pairs the
prompt is ~40% of a row's tokens, so a step computes ~30% fewer tokens. The 2B rows' hidden states are gathered back
from the packed rows, so the head and the trainer see the layout they expect.

With the varlen SDPA of backend/training/attention.py (switched on for this), the pairs of a batch are one row
without padding, each pair attending to itself through its own mask (`row_masks`): for the bench's pairs 48% of the
padded rows' tokens. Where it cannot be switched on, each pair is a row of a padded batch with a 4D mask (72%).

`find_pairs` checks a batch is such pairs (the two halves share each prompt's tokens; rows flush left, as TRL's
collator makes them); anything else (eval rows that are not pairs, a model whose attention would not take the
mask) keeps the rows as they are. TUNEBOARD_SHARED_PROMPT=0 switches it off (side-by-side measurements).

KTO's batches are single answers, not pairs: `find_rows` reads any padded batch of flush-left rows as its rows, and
the varlen SDPA runs them as one row without padding, each attending to itself causally (for the bench's KTO rows
a quarter to a third of the padded tokens are padding, in each of the step's four forwards).
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
class Pairs:
    """A [chosen rows; rejected rows] batch of 2B rows of width L, read as B pairs."""
    input_ids: torch.Tensor  # [2B, L]
    prompt: list[int]  # each pair's prompt length
    chosen_end: list[int]  # prompt + chosen answer
    rejected: list[int]  # the rejected answer's length

    def __len__(self) -> int:
        return len(self.prompt)

    def longest(self) -> int:
        return max(e + r for e, r in zip(self.chosen_end, self.rejected))

    def pieces(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pair i packed: (token ids, position ids, segment: 0 prompt, 1 chosen, 2 rejected)."""
        b, p, end, r = len(self.prompt), self.prompt[i], self.chosen_end[i], self.rejected[i]
        device = self.input_ids.device
        ids = torch.cat([self.input_ids[i, :end], self.input_ids[b + i, p:p + r]])
        positions = torch.cat([torch.arange(end, device=device), torch.arange(p, p + r, device=device)])
        segment = torch.cat([torch.zeros(p, dtype=torch.long, device=device),
                             torch.ones(end - p, dtype=torch.long, device=device),
                             torch.full((r,), 2, dtype=torch.long, device=device)])
        return ids, positions, segment

    def gather(self, offsets: list[int]) -> torch.Tensor:
        """[2B * L]: where each position of the 2B rows lives in the flattened packed tokens, pair i's starting at
        offsets[i] (padding: the pair's first slot; it is unlabelled)."""
        b, width = len(self.prompt), self.input_ids.shape[1]
        index = torch.zeros(2 * b, width, dtype=torch.long, device=self.input_ids.device)
        for i, (p, end, r, start) in enumerate(zip(self.prompt, self.chosen_end, self.rejected, offsets)):
            index[i] = start
            index[i, :end] = torch.arange(start, start + end)
            index[b + i] = start
            index[b + i, :p] = torch.arange(start, start + p)
            index[b + i, p:p + r] = torch.arange(start + end, start + end + r)
        return index.reshape(-1)


@dataclass
class Rows:
    """A padded batch of B flush-left rows of width L, read as B sequences without their padding."""
    input_ids: torch.Tensor  # [B, L]
    lengths: list[int]

    def __len__(self) -> int:
        return len(self.lengths)

    def longest(self) -> int:
        return max(self.lengths)

    def pieces(self, i: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Row i without its padding: (token ids, position ids, None: causal)."""
        n = self.lengths[i]
        return self.input_ids[i, :n], torch.arange(n, device=self.input_ids.device), None

    def gather(self, offsets: list[int]) -> torch.Tensor:
        """[B * L]: where each position of the rows lives in the flattened packed tokens (padding: the row's first
        slot; it is unlabelled)."""
        index = torch.zeros(self.input_ids.shape, dtype=torch.long, device=self.input_ids.device)
        for i, (n, start) in enumerate(zip(self.lengths, offsets)):
            index[i] = start
            index[i, :n] = torch.arange(start, start + n)
        return index.reshape(-1)


class PrefixStash:
    """The keys and values of the first `lengths[r]` tokens of each row of a packed forward, per layer, detached:
    what a later forward of the rows' continuations attends to instead of computing those tokens again (the varlen
    SDPA of backend/training/attention.py fills and reads it). Only the first forward fills it (the layers that
    gradient checkpointing recomputes in the backward find their layer kept); `failed` when a layer has no index."""

    def __init__(self, lengths: list[int]):
        self.lengths, self.layers, self.failed = lengths, {}, False

    def keep(self, layer: int | None, keys, values) -> None:
        if layer is None:
            self.failed = True
        elif layer not in self.layers:
            self.layers[layer] = [(k[:, :, :n].detach().clone(), v[:, :, :n].detach().clone())
                                  for k, v, n in zip(keys, values, self.lengths)]

    def masks(self, sizes: list[int]) -> list[torch.Tensor]:
        """A continuation row of n tokens: [n, kept + n], the kept tokens and itself causally (True = attend)."""
        device = next(iter(self.layers.values()))[0][0].device
        return [torch.cat([torch.ones(n, kept, dtype=torch.bool, device=device),
                           torch.ones(n, n, dtype=torch.bool, device=device).tril()], 1)
                for kept, n in zip(self.lengths, sizes)]


@dataclass
class Continuations:
    """KTO's KL rows (row r: row r's prompt, then another row's answer) run as continuations of the batch's rows,
    whose prompt keys and values `stash` kept: each from its prompt's last token (whose logits score the answer's
    first) on, attending to the kept prompt before it. The KL rows' log-probabilities without their prompts'
    compute."""
    input_ids: torch.Tensor  # [B, L]: the KL rows, flush left
    prompt: list[int]
    lengths: list[int]
    stash: PrefixStash

    def __len__(self) -> int:
        return len(self.prompt)

    def longest(self) -> int:
        return max(self.lengths)

    def pieces(self, i: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        start, end = self.prompt[i] - 1, self.lengths[i]
        return self.input_ids[i, start:end], torch.arange(start, end, device=self.input_ids.device), None

    def gather(self, offsets: list[int]) -> torch.Tensor:
        """[B * L]: where each position of the KL rows lives in the packed tokens (the kept prompt: the row's first
        slot; it is unlabelled, and only its last token's logits score anything)."""
        index = torch.zeros(self.input_ids.shape, dtype=torch.long, device=self.input_ids.device)
        for i, (p, n, start) in enumerate(zip(self.prompt, self.lengths, offsets)):
            index[i] = start
            index[i, p - 1:n] = torch.arange(start, start + n - p + 1)
        return index.reshape(-1)


def answer_mask(segment: torch.Tensor) -> torch.Tensor:
    """[n, n] boolean (True = attend): causal, a prompt token sees the prompt only, an answer token the prompt and
    its own answer."""
    n = segment.shape[0]
    order = torch.arange(n, device=segment.device)
    query, key = segment[:, None], segment[None, :]
    return (order[None, :] <= order[:, None]) & ((key == 0) | (key == query))


def find_pairs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor) -> Pairs | None:
    """The pairs of a [chosen rows; rejected rows] batch, or None when the batch is not such pairs: each half's row i
    with the same prompt tokens (the unlabelled start), rows flush left."""
    rows, length = input_ids.shape
    if rows == 0 or rows % 2 or labels is None or labels.shape != input_ids.shape:
        return None
    b = rows // 2
    order = torch.arange(length, device=input_ids.device)
    lengths = (attention_mask.long().sum(1) if attention_mask is not None
               else torch.full((rows,), length, device=input_ids.device))
    if attention_mask is not None and not torch.equal(attention_mask.bool(), order[None, :] < lengths[:, None]):
        return None  # not flush left
    labelled = labels != -100
    if not bool(labelled.any(1).all()):
        return None
    prompt = labelled.int().argmax(1)  # the first answer token: the prompt's length
    if not torch.equal(prompt[:b], prompt[b:]) or int(prompt.min()) < 1:
        return None
    in_prompt = order[None, :] < prompt[:b, None]
    if not torch.equal(input_ids[:b][in_prompt], input_ids[b:][in_prompt]):
        return None
    return Pairs(input_ids, prompt[:b].tolist(), lengths[:b].tolist(), (lengths[b:] - prompt[b:]).tolist())


def find_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Rows | None:
    """The rows of a padded batch, or None when there is no padding to drop or the rows are not flush left."""
    rows, length = input_ids.shape
    if rows == 0 or attention_mask is None:
        return None
    lengths = attention_mask.long().sum(1)
    order = torch.arange(length, device=input_ids.device)
    if int(lengths.min()) < 1 or bool((lengths == length).all()):
        return None  # an empty row, or nothing padded
    if not torch.equal(attention_mask.bool(), order[None, :] < lengths[:, None]):
        return None
    return Rows(input_ids, lengths.tolist())


def attention_kind(config) -> str | None:
    """How this model's attention takes the pairs: 'varlen' (one row, a mask a pair), 'bool' / 'float' (a padded
    row a pair, a 4D mask of that kind); None when it takes none (flash, flex)."""
    attention = getattr(config, "_attn_implementation", None)
    if attention == VARLEN_SDPA:
        return "varlen"
    if attention in BOOL_MASK_ATTENTION:
        return "bool"
    if attention in FLOAT_MASK_ATTENTION:
        return "float"
    return None


def fits(config, pairs: Pairs | Rows) -> bool:
    """A sliding window narrower than a packed pair (or row) would be ignored by the custom masks."""
    window = getattr(config, "sliding_window", None)
    return window is None or int(window) >= pairs.longest()


def packed_hidden(backbone, pairs: Pairs | Rows | Continuations, kind: str, stash: PrefixStash | None = None
                  ) -> torch.Tensor:
    """The backbone's last hidden states of the batch's rows, [rows, L, H], computed on the packed pairs (or rows,
    or continuations: the varlen kind only); `stash` keeps the rows' first keys and values on the way."""
    pieces = [pairs.pieces(i) for i in range(len(pairs))]
    sizes = [len(ids) for ids, _, _ in pieces]
    if kind == "varlen":
        bounds = torch.tensor([0] + sizes, device=pairs.input_ids.device).cumsum(0).to(torch.int32)
        extra = {"prefix_stash": stash} if stash is not None else {}
        if isinstance(pairs, Continuations):
            extra = {"prefix_kv": pairs.stash, "row_masks": pairs.stash.masks(sizes)}
        else:
            extra["row_masks"] = [None if seg is None else answer_mask(seg) for _, _, seg in pieces]
        hidden = backbone(input_ids=torch.cat([ids for ids, _, _ in pieces])[None],
                          position_ids=torch.cat([pos for _, pos, _ in pieces])[None], use_cache=False,
                          cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=max(sizes),
                          max_length_k=max(sizes), **extra).last_hidden_state
        offsets = bounds[:-1].tolist()
    else:
        width = max(sizes)
        ids = torch.stack([torch.nn.functional.pad(piece[0], (0, width - n), value=int(piece[0][0]))
                           for piece, n in zip(pieces, sizes)])
        positions = torch.stack([torch.nn.functional.pad(piece[1], (0, width - n)) for piece, n in zip(pieces, sizes)])
        allowed = torch.zeros(len(pieces), 1, width, width, dtype=torch.bool, device=ids.device)
        for i, (piece, n) in enumerate(zip(pieces, sizes)):
            allowed[i, 0, :n, :n] = answer_mask(piece[2])
        allowed |= torch.eye(width, dtype=torch.bool, device=ids.device)  # padding sees itself: no empty softmax row
        if kind == "float":
            dtype = backbone.get_input_embeddings().weight.dtype
            dtype = dtype if dtype.is_floating_point else torch.float32
            mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill(~allowed,
                                                                                         torch.finfo(dtype).min)
        else:
            mask = allowed
        hidden = backbone(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).last_hidden_state
        offsets = [i * width for i in range(len(pieces))]
    rows, length = pairs.input_ids.shape
    return hidden.reshape(-1, hidden.shape[-1])[pairs.gather(offsets)].view(rows, length, hidden.shape[-1])
