"""The causal-LM loss from the last hidden state, in chunks of tokens: never the full [tokens x vocab] logits.

The plain path (transformers' ``ForCausalLMLoss``) projects EVERY position onto the vocabulary, upcasts the
logits to fp32, takes log-softmax and keeps what the backward needs: for SmolLM2 (vocab 49,152) a batch of
4 x 512 tokens holds ~400 MB per copy, several copies at once, and the guide's recipe (16k tokens a batch)
~3 GB per copy. Here only the positions that have a label are projected (prompt tokens of SFT rows have
none), chunk by chunk, and each chunk's gradient is computed right away (softmax - one-hot, through the
head's weight), as Liger's fused linear cross-entropy does on GPU; so the backward needs no logits and no
recompute. Same loss and gradients as the plain path (tests/backend/test_chunked_loss.py).

``install_chunked_loss`` (backend.training.models) wires it into a model's forward for training; on a GPU with
liger-kernel installed, Liger's fused kernel does the same job (``linear_cross_entropy``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 24  # logits per chunk (64 MB in fp32): about 340 tokens for a 49k vocabulary


def _mm_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matmul runs in here: autocast's when it is on (bf16 on CPU/GPU), else the tensor's."""
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T + bias [softcapped], labels), with every label valid.

    Forward walks the rows in chunks; for each chunk it computes the logits (fp32 for the softmax), the
    loss, and the gradient of the summed loss with respect to the chunk's logits, which it pushes straight
    through the head into grad_hidden / grad_weight / grad_bias. Backward only scales those by grad_output.
    Gradients are computed only for inputs that require them (a frozen head: no grad_weight)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap, chunk_tokens):
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        mm = _mm_dtype(hidden)
        w = weight.to(mm)
        grad_hidden = torch.empty_like(hidden) if want_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start:start + chunk_tokens].to(mm)
            y = labels[start:start + chunk_tokens]
            logits = (h @ w.t()).float()
            if bias is not None:
                logits += bias.float()
            if softcap:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, y[:, None])[:, 0]).sum()
            if not (want_h or want_w or want_b):
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(len(y), device=y.device), y] -= 1.0
            if softcap:
                grad *= 1.0 - capped * capped
            if want_b:
                grad_bias += grad.sum(0)
            grad = grad.to(mm)
            if want_h:
                grad_hidden[start:start + chunk_tokens] = (grad @ w).to(hidden.dtype)
            if want_w:
                grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight, grad_bias) if t is not None))
        ctx.have = (want_h, want_w, want_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        saved = list(ctx.saved_tensors)
        out = []
        for have, dtype in zip(ctx.have, (None, *ctx.dtypes)):
            if not have:
                out.append(None)
                continue
            grad = saved.pop(0) * grad_output
            out.append(grad if dtype is None else grad.to(dtype))
        return out[0], out[1], out[2], None, None, None


def chunk_tokens_for(vocab_size: int) -> int:
    return max(16, CHUNK_ELEMENTS // max(vocab_size, 1))


def liger_usable() -> bool:
    """Whether liger-kernel can run here (a CUDA GPU and the package importing)."""
    # liger's own availability check says yes without a GPU, then the first forward fails.
    if not torch.cuda.is_available():
        return False
    try:
        import liger_kernel.transformers  # noqa: F401  (optional dependency: only its import tells)
    except Exception:
        return False
    return True


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """Summed cross-entropy of (hidden [N, H] -> logits [N, V]) against labels [N] (all valid), never holding
    more than one chunk of logits. On a GPU with liger-kernel: Liger's fused kernel (same sum)."""
    if hidden.is_cuda:
        if liger_usable():
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # optional dependency (GPU)

            kwargs = {"softcap": softcap} if softcap else {}
            return LigerFusedLinearCrossEntropyLoss(reduction="sum", **kwargs)(weight, hidden, labels, bias).float()
    return LinearCrossEntropy.apply(hidden, weight, bias, labels, softcap, chunk_tokens_for(weight.shape[0]))


def causal_lm_loss(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   labels: torch.Tensor | None, *, num_items_in_batch=None, shift_labels: torch.Tensor | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss (labels shifted left, -100 ignored; summed / num_items_in_batch when given,
    else the mean over labelled tokens), from the last hidden state [B, T, H] and the head's weight/bias,
    projecting only the positions that have a label."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat_hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = shift_labels.reshape(-1).to(flat_hidden.device)
    keep = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)
    total = linear_cross_entropy(flat_hidden.index_select(0, keep), weight, bias, flat_labels.index_select(0, keep),
                                 softcap)
    if num_items_in_batch is None:
        return total / keep.numel()  # 0 labelled tokens: nan, as the plain mean gives
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
