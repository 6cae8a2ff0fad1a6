"""Group-relative advantages (DAPO Eq. 9 / GRPO): A_i = (R_i - mean(R_group)) / (std(R_group) + eps).

`std` is the unbiased standard deviation, as `torch.std`; groups of any size (each its own count). A group of one
sample has no spread: it gets mean 0 and std 1 (as verl). `normalize_std=False` drops the division (Dr.GRPO, arXiv
2503.20783). No KL term and no reference model: DAPO removes both (§2.3).
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    pool_mean: torch.Tensor | None = None,
    pool_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """rewards [N] float, group_index [N] int (any ids) -> advantages [N] float. Groups may differ in size (groups
    sampled in rounds): each is normalised by its own count. `pool_mean`/`pool_std` [N]: where finite, the
    baseline and spread of every sample drawn for the sample's group, not only of those it kept (a group the
    balanced rule down-sampled: Reinforce-Ada's global statistics, rollout/budget.py)."""
    if rewards.ndim != 1 or rewards.shape != group_index.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be 1-D, same size"
        )
    r = rewards.to(torch.float64)
    _, g = torch.unique(group_index, return_inverse=True)
    n_groups = int(g.max()) + 1 if g.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, r) / count
    dev = r - mean[g]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, dev * dev) / (count - 1).clamp(min=1)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    mean_i, std_i = mean[g], std[g]
    if pool_mean is not None and pool_std is not None:
        pooled = torch.isfinite(pool_mean) & torch.isfinite(pool_std)
        mean_i = torch.where(pooled, pool_mean.to(torch.float64), mean_i)
        std_i = torch.where(pooled, pool_std.to(torch.float64), std_i)
    centred = r - mean_i
    out = centred / (std_i + eps) if normalize_std else centred
    return out.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
