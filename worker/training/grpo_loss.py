"""GRPO's objective (DeepSeekMath's group-relative policy optimisation) as TRL's
`GRPOTrainer` computes it, in pieces a trainer composes: each completion's advantage from
its group's rewards, the completion tokens' log-probabilities under the policy, and the
clipped token-level policy loss with an optional KL term to a reference.

The loss comes back as a sum and the weight it is to be divided by, never as a mean: the
trainer adds both up over micro-batches and ranks and divides once, so that the step is
weighted by tokens (`dapo`) or by completions (`grpo`) over the whole optimizer step,
as every other method here weights its loss (worker/training/step_loss.py).
- `grpo`: each completion's token-mean loss, averaged over completions (TRL's `grpo`).
- `dapo`: every completion token weighs the same over the step (TRL's `dapo`, its default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

LossType = Literal["grpo", "dapo"]
# TRL's: a group whose rewards are all equal has no spread to divide by.
ADVANTAGE_EPS = 1e-4


def _nanstd(grouped: torch.Tensor) -> torch.Tensor:
    """Each row's sample standard deviation (Bessel-corrected, as TRL's `nanstd`), NaNs
    (rewards a grader could not give) left out; NaN for a row with fewer than two."""
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    variance = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, torch.nan))
    return torch.sqrt(variance * correction)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage: its reward less its group's mean, divided by the
    group's spread when `scale` (TRL's `scale_rewards="group"`). `rewards` holds the groups
    one after another; a NaN reward (the grader failed) counts in no mean and gets no
    advantage. Also returns which groups' rewards are all equal (no signal to learn)."""
    grouped = rewards.view(-1, group_size).to(torch.float32)
    advantages = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    spread = _nanstd(grouped)
    if scale:
        advantages = advantages / (spread + ADVANTAGE_EPS)
    flat = torch.isclose(spread, torch.zeros_like(spread)) | torch.isnan(spread)
    return torch.nan_to_num(advantages.view(-1), nan=0.0), flat.view(-1)


def completion_logps(
    logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of `completion_ids` and the entropy at each of their positions,
    from the `logits` that predict them (one row per completion token), at the sampling
    `temperature`, as the completions were drawn."""
    scaled = logits.float() / temperature
    log_probs = F.log_softmax(scaled, dim=-1)
    logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


@dataclass
class PolicyLoss:
    """A micro-batch's share of the step's loss, and what to log of it. Each `*_sum` is
    divided by `weight` (summed over the step) to get the step's value; `tokens` weighs
    the token means (clip fractions, KL, entropy)."""

    loss_sum: torch.Tensor
    weight: torch.Tensor
    tokens: torch.Tensor
    kl_sum: torch.Tensor
    entropy_sum: torch.Tensor
    clipped_low_sum: torch.Tensor
    clipped_high_sum: torch.Tensor


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: LossType,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> PolicyLoss:
    """The clipped surrogate loss of completions (rows of `logps`, masked by `mask`) whose
    advantages are `advantages`. `old_logps` are the log-probabilities the completions were
    sampled with (None: this very policy, one update per generation, as TRL's default),
    `ref_logps` the reference's for the KL term (`beta > 0`, as TRL's)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    gain = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * gain, clipped * gain)
    kl = torch.zeros_like(per_token)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        # k3's estimate of KL(policy || reference), times the importance ratio so that its
        # gradient is the unbiased reverse-KL gradient off-policy too (DeepSeek-V3.2; TRL's
        # default, `use_bias_correction_kl`).
        kl = (torch.exp(delta) - delta - 1) * ratio
        per_token = per_token + beta * kl
    lengths = mask.sum(-1)
    if loss_type == "grpo":
        loss_sum = ((per_token * mask).sum(-1) / lengths.clamp(min=1.0)).sum()
        weight = torch.tensor(float(logps.size(0)), device=logps.device)
    else:
        loss_sum = (per_token * mask).sum()
        weight = lengths.sum()
    with torch.no_grad():
        # As TRL logs them: a token clipped at the low end had a negative advantage.
        low = ((ratio < 1 - epsilon_low) & (gain < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (gain > 0)).to(mask.dtype)
        return PolicyLoss(
            loss_sum=loss_sum,
            weight=weight,
            tokens=lengths.sum().detach(),
            kl_sum=(kl.detach() * mask).sum(),
            entropy_sum=(entropy.detach() * mask).sum() if entropy is not None else mask.sum() * 0,
            clipped_low_sum=(low * mask).sum(),
            clipped_high_sum=(high * mask).sum(),
        )
