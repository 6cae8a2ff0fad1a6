"""The DAPO policy loss (arXiv 2503.14476, Eq. 8 and 10), as a pure function of tensors.

Per token, with ratio r = exp(clamp(logp - old_logp, -20, 20)) and advantage A:

    clip-higher (Eq. 10):  l = max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))     eps_low 0.2, eps_high 0.28
    dual clip (A < 0):     l = min(l, -A*c)                                      c > 1, default 3

then, optionally, times truncated importance weights (rollout/learner mismatch), and aggregated:

    token-mean               sum of l over every loss token / global_tokens          (DAPO Eq. 8)
    seq-mean-token-mean      sum over sequences of each one's token mean / global_seqs  (GRPO)
    seq-mean-token-sum-norm  sum of l / (global_seqs * norm_len)                      (Dr.GRPO, arXiv 2503.20783)

`global_tokens` / `global_seqs` are the counts of the whole batch that makes one optimizer step, so
splitting it into micro-batches (or data-parallel ranks) and summing their losses gives the same
loss and the same gradient; `global_seqs` counts the sequences with at least one loss token (a sample the
overlong filter or token-mask left without one adds nothing, so it must not dilute the others). Dr.GRPO's
`norm_len` is a constant, the generation budget L_max: a divisor that follows the batch's padded width would
change the effective learning rate with every batch's longest prompt. No KL term (DAPO §2.3).
"""

from __future__ import annotations

from typing import Literal

import torch

Agg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_METRICS = ("clip_frac_upper", "clip_frac_lower", "clip_frac_dual", "approx_kl", "ratio_mean")


def loss_sequences(mask: torch.Tensor) -> torch.Tensor:
    """The sequences (rows of a [B, T] loss mask) with at least one loss token: the seq-mean modes' count."""
    return (mask.sum(-1) > 0).sum()


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float = 3.0,
    agg: Agg = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """logp, old_logp, response_mask [B, T]; advantages [B] or [B, T] -> (scalar loss, metrics)."""
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 (dual clip), got {clip_c}")
    mask = response_mask.to(logp.dtype)
    adv = advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_c
    per_token = torch.where(adv < 0, torch.minimum(clipped, loss3), clipped)
    if is_weights is not None:
        per_token = per_token * is_weights

    if agg == "token-mean":
        denom = global_tokens if global_tokens is not None else mask.sum().clamp(min=1)
        loss = (per_token * mask).sum() / denom
    elif agg == "seq-mean-token-mean":
        seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        loss = seq.sum() / (global_seqs if global_seqs is not None else loss_sequences(mask).clamp(min=1))
    elif agg == "seq-mean-token-sum-norm":
        if norm_len is None:
            raise ValueError("seq-mean-token-sum-norm (Dr.GRPO) needs norm_len, a constant: the generation budget")
        seqs = global_seqs if global_seqs is not None else loss_sequences(mask).clamp(min=1)
        loss = (per_token * mask).sum() / (seqs * norm_len)
    else:
        raise ValueError(f"unknown agg {agg!r}")

    with torch.no_grad():
        metrics = {
            "clip_frac_upper": _masked_mean(((adv > 0) & (ratio > 1.0 + clip_high)).to(mask.dtype), mask).item(),
            "clip_frac_lower": _masked_mean(((adv < 0) & (ratio < 1.0 - clip_low)).to(mask.dtype), mask).item(),
            "clip_frac_dual": _masked_mean(((adv < 0) & (clipped > loss3)).to(mask.dtype), mask).item(),
            "approx_kl": _masked_mean(-log_ratio, mask).item(),  # k1 estimate of KL(old || new)
            "ratio_mean": _masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token given the ones before it, aligned with `input_ids` ([B, T]; column 0 is 0).

    picked logit - logsumexp: one pass over the vocabulary, no [B, T, V] log-softmax tensor.
    """
    return token_logprobs_and_entropy(logits, input_ids, with_entropy=False)[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`, plus the entropy of each next-token distribution ([B, T], aligned the same way),
    sharing the logsumexp: H = lse - sum(softmax * logits)."""
    logits = _full(logits[:, :-1])
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logp = torch.nn.functional.pad(picked - lse, (1, 0))
    if not with_entropy:
        return logp, None
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, torch.nn.functional.pad(ent, (1, 0))


def _full(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are upcast: log-softmax over a large vocabulary needs fp32."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy of the next-token distributions at the masked positions (logits [B, T, V]).

    Logits at position t predict token t+1: for response tokens pass (logits[:, :-1], mask[:, 1:]).
    """
    logp = torch.log_softmax(_full(logits), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return _masked_mean(ent, mask.to(ent.dtype))
