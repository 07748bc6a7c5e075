"""The arithmetic of PPO for language models, as pure functions on tensors (backend/stages/ppo.py runs them;
tests/backend/test_ppo_math.py checks them against values worked out by hand).

Shapes: (batch, response tokens); `mask` is 1 on the tokens of each response (up to and including its end
of turn) and 0 on the padding after it. The formulas are those of the PPO-for-RLHF recipe (Ziegler et al.
2019; TRL's PPOTrainer before its removal; LLaMA-Factory's stage ppo trains with them):
- per-token reward: -kl_coef x (log pi - log pi_ref) on every token, plus the sequence's score on its last one;
- advantages by GAE (gamma, lam) over the response tokens, returns = advantages + values; advantages whitened;
- policy loss: the clipped surrogate max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(log pi - log pi_old);
- value loss: 0.5 x max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2);
- the KL coefficient: fixed, or adapted towards a target KL (Ziegler et al.'s proportional controller).
"""
from __future__ import annotations

import math

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unbiased variance of the masked values (Bessel's correction, as numpy's ddof=1)."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = masked_mean((values - mean) ** 2, mask)
    return var * count / (count - 1) if count > 1 else var


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked entries; shift_mean False keeps the mean (rewards are whitened so)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    return (out + mean if not shift_mean else out) * mask


def token_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token rewards, per-token kl): -kl_coef x kl on every response token, each score added on the
    sequence's last response token."""
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] += scores
    return rewards * mask, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by generalized advantage estimation, backwards over the tokens: delta_t = r_t +
    gamma V_{t+1} - V_t (V after the last response token = 0), A_t = delta_t + gamma lam A_{t+1}."""
    values = values * mask
    width = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(width)):
        following = values[:, t + 1] if t + 1 < width else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * following - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    returns = advantages + values
    return advantages * mask, returns * mask


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cliprange: float) -> tuple[torch.Tensor, dict]:
    """(the clipped surrogate loss, {clip_fraction, approx_kl}) averaged over the response tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"clip_fraction": masked_mean((clipped > unclipped).float(), mask).item(),
                 "approx_kl": masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask).item()}
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, dict]:
    """(0.5 x the larger of the plain and the clipped squared error, {value_clip_fraction})."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    plain, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(plain, clipped), mask)
    with torch.no_grad():
        stats = {"value_clip_fraction": masked_mean((clipped > plain).float(), mask).item()}
    return loss, stats


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the softmax over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


class KLController:
    """The KL coefficient: fixed, or (adaptive) multiplied after each batch by 1 + clip(kl / target - 1, -0.2,
    0.2) x n / horizon, so it grows while the policy's KL to the reference is above target and shrinks below."""

    def __init__(self, init_kl_coef: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = float(init_kl_coef), target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        if self.target:
            error = min(max(current_kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon
        return self.value


class RunningMoments:
    """Mean and standard deviation of every score seen so far (batches merged as Chan et al.'s parallel
    algorithm): ppo_score_norm normalises each batch's scores by them."""

    def __init__(self, mean: float = 0.0, var: float = 1.0, count: float = 1e-24):
        self.mean, self.var, self.count = mean, var, count

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 else 1.0

    def update(self, scores: torch.Tensor) -> None:
        n = scores.numel()
        batch_mean, batch_var = scores.float().mean().item(), scores.float().var(unbiased=False).item()
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta ** 2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """Update with the batch, then (scores - mean) / std."""
        self.update(scores)
        return (scores - self.mean) / max(self.std, 1e-8)
