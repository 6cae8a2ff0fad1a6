"""Group-relative advantages (DAPO Eq. 9 / GRPO): A_i = (R_i - mean(R_group)) / (std(R_group) + eps).

`std` is the unbiased standard deviation, as `torch.std`. A group of one sample has no spread: it
gets mean 0 and std 1 (as verl). `normalize_std=False` drops the division (Dr.GRPO, arXiv 2503.20783).
No KL term and no reference model: DAPO removes both (§2.3).
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards [N] float, group_index [N] int (any ids) -> advantages [N] float."""
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
    centred = r - mean[g]
    out = centred / (std[g] + eps) if normalize_std else centred
    return out.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
