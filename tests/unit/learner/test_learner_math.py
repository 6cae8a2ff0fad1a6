"""DAPO maths against independent references written here from the formulas, token by token."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from learner.advantages import group_advantages
from learner.loss import entropy, policy_loss, token_logprobs, token_logprobs_and_entropy


@pytest.fixture(autouse=True)
def float64() -> Iterator[None]:
    """These references compare to 1e-6 and tighter: compute in float64, for this module only."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


# ----------------------------------------------------------------------------- advantages


def ref_advantages(rewards: list[float], groups: list[int], normalize_std: bool = True) -> list[float]:
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(members) / len(members)
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((r - mean) / (std + 1e-6) if normalize_std else r - mean)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_match_reference(normalize_std: bool) -> None:
    g = torch.Generator().manual_seed(0)
    groups = [7, 7, 7, 7, 3, 3, 9, 11, 11, 11, 11, 11, 11, 11, 11, 42]  # ragged, with groups of one
    rewards = torch.randn(len(groups), generator=g)
    rewards[4:6] = 1.0  # a group with no spread
    got = group_advantages(rewards, torch.tensor(groups), normalize_std=normalize_std)
    want = ref_advantages(rewards.tolist(), groups, normalize_std)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert got[6].item() == pytest.approx(rewards[6].item() / (1 + 1e-6))  # group of one: mean 0, std 1
    assert got[4].item() == 0.0 and got[5].item() == 0.0  # all-equal group: zero advantage


def test_group_advantages_use_unbiased_std_like_torch() -> None:
    r = torch.tensor([1.0, -1.0, -1.0, -1.0])
    assert group_advantages(r, torch.zeros(4, dtype=torch.long)).tolist() == pytest.approx(
        ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    )


# ----------------------------------------------------------------------------- loss


def ref_token_loss(lp: float, old: float, a: float, cl: float, ch: float, c: float) -> float:
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    l1, l2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
    loss = max(l1, l2)
    return min(loss, -a * c) if a < 0 else loss


def ref_loss(logp, old, adv, mask, agg, cl=0.2, ch=0.28, c=3.0, is_w=None, norm_len=None):
    b, t = logp.shape
    per = [[ref_token_loss(logp[i, j].item(), old[i, j].item(), adv[i].item(), cl, ch, c)
            * (is_w[i, j].item() if is_w is not None else 1.0) for j in range(t)] for i in range(b)]  # fmt: skip
    valid = [[bool(mask[i, j]) for j in range(t)] for i in range(b)]
    if agg == "token-mean":
        return sum(per[i][j] for i in range(b) for j in range(t) if valid[i][j]) / sum(map(sum, valid))
    if agg == "seq-mean-token-mean":
        seqs = [sum(per[i][j] for j in range(t) if valid[i][j]) / max(1, sum(valid[i])) for i in range(b)]
        return sum(seqs) / b
    return sum(per[i][j] for i in range(b) for j in range(t) if valid[i][j]) / (b * (norm_len or t))


def random_case(seed: int = 0, b: int = 6, t: int = 12):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + torch.randn(b, t, generator=g) * 0.6  # ratios well outside both clip edges too
    logp[0, 0] = old[0, 0] + 30  # beyond the +20 clamp
    logp[1] = old[1] + 2  # ratio e^2 > c = 3 on a negative advantage: the dual clip
    adv = torch.randn(b, generator=g)
    adv[0], adv[1] = abs(adv[0]) + 0.5, -abs(adv[1]) - 0.5
    lengths = [t, 1, 5, t - 3, 7, 2]
    mask = torch.zeros(b, t)
    for i, n in enumerate(lengths[:b]):
        mask[i, t - n - (i % 2) : t - (i % 2)] = 1  # ragged, not always right-aligned
    return logp, old, adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_matches_reference(agg: str, seed: int) -> None:
    logp, old, adv, mask = random_case(seed)
    budget = 16  # Dr.GRPO's constant (the generation budget), not the batch's padded width 12
    loss, _ = policy_loss(logp, old, adv, mask, agg=agg, norm_len=budget)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(ref_loss(logp, old, adv, mask, agg, norm_len=budget), abs=1e-6)


def test_policy_loss_other_clip_settings_and_is_weights() -> None:
    logp, old, adv, mask = random_case(3)
    w = torch.rand_like(logp, generator=torch.Generator().manual_seed(5)) * 2
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.1, clip_c=1.5, is_weights=w)
    assert loss.item() == pytest.approx(ref_loss(logp, old, adv, mask, "token-mean", 0.1, 0.1, 1.5, w), abs=1e-6)


def test_clip_metrics_count_the_right_tokens() -> None:
    logp, old, adv, mask = random_case(4)
    _, m = policy_loss(logp, old, adv, mask)
    r = torch.exp((logp - old).clamp(-20, 20))
    a = adv.unsqueeze(-1).expand_as(r)
    n = mask.sum().item()
    upper = sum(1 for i, j in mask.nonzero().tolist() if a[i, j] > 0 and r[i, j] > 1.28) / n
    lower = sum(1 for i, j in mask.nonzero().tolist() if a[i, j] < 0 and r[i, j] < 0.8) / n
    clip = lambda x: min(max(x, 0.8), 1.28)  # noqa: E731
    dual = sum(
        1 for i, j in mask.nonzero().tolist()
        if a[i, j] < 0 and max(-a[i, j] * r[i, j], -a[i, j] * clip(r[i, j])) > -a[i, j] * 3
    ) / n  # fmt: skip
    kl = sum((old[i, j] - logp[i, j]).clamp(-20, 20).item() for i, j in mask.nonzero().tolist()) / n
    assert (m["clip_frac_upper"], m["clip_frac_lower"], m["clip_frac_dual"]) == pytest.approx((upper, lower, dual))
    assert upper > 0 and lower > 0 and dual > 0, "the case should exercise every clip"
    assert m["approx_kl"] == pytest.approx(kl, abs=1e-9)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_gives_the_same_loss_and_gradient(agg: str) -> None:
    logp, old, adv, mask = random_case(6)
    full_lp = logp.clone().requires_grad_(True)
    full, _ = policy_loss(full_lp, old, adv, mask, agg=agg, norm_len=16)  # type: ignore[arg-type]
    full.backward()

    split_lp = logp.clone().requires_grad_(True)
    total = torch.zeros(())
    for part in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches
        loss, _ = policy_loss(
            split_lp[part], old[part], adv[part], mask[part], agg=agg,  # type: ignore[arg-type]
            global_tokens=mask.sum().item(), global_seqs=logp.shape[0], norm_len=16,
        )  # fmt: skip
        loss.backward()
        total = total + loss.detach()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(split_lp.grad, full_lp.grad, atol=1e-6)  # type: ignore[arg-type]


def test_dr_grpo_needs_a_constant_divisor() -> None:
    logp, old, adv, mask = random_case(8)
    with pytest.raises(ValueError, match="norm_len, a constant"):
        policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm")


def test_seq_mean_counts_only_sequences_with_a_loss_token() -> None:
    """A row the overlong filter (or token-mask) emptied adds nothing to the loss, and no sequence to its divisor:
    the other rows' loss and gradient are what they are without it."""
    logp, old, adv, mask = random_case(9)
    emptied = mask.clone()
    emptied[2] = 0
    keep = [i for i in range(len(mask)) if i != 2]
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        with_row, _ = policy_loss(logp, old, adv, emptied, agg=agg, norm_len=16)  # type: ignore[arg-type]
        without, _ = policy_loss(logp[keep], old[keep], adv[keep], mask[keep], agg=agg, norm_len=16)  # type: ignore[arg-type]
        assert with_row.item() == pytest.approx(without.item(), abs=1e-7), agg


def test_masked_tokens_do_not_matter() -> None:
    logp, old, adv, mask = random_case(7)
    noisy = logp.clone()
    noisy[mask == 0] += 100.0
    a, _ = policy_loss(logp, old, adv, mask)
    b, _ = policy_loss(noisy, old, adv, mask)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


def test_dual_clip_must_exceed_one() -> None:
    logp, old, adv, mask = random_case(0)
    with pytest.raises(ValueError, match="clip_c must be > 1"):
        policy_loss(logp, old, adv, mask, clip_c=1.0)


def test_positive_advantage_gradient_raises_logp() -> None:
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3))
    loss.backward()
    assert (logp.grad < 0).all()  # type: ignore[operator]  # descending the loss raises logp


# ----------------------------------------------------------------------------- helpers


def test_token_logprobs_and_entropy() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=g)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    lp = token_logprobs(logits, ids)
    for i in range(2):
        assert lp[i, 0] == 0
        for t in range(1, 5):
            want = logits[i, t - 1, ids[i, t]] - torch.logsumexp(logits[i, t - 1], -1)
            assert lp[i, t].item() == pytest.approx(want.item(), abs=1e-9)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0]], dtype=torch.float64)
    p = torch.softmax(logits, -1)
    per = -(p * p.log()).sum(-1)
    assert entropy(logits, mask).item() == pytest.approx(((per * mask).sum() / mask.sum()).item(), abs=1e-9)
    lp2, ent = token_logprobs_and_entropy(logits, ids)
    assert torch.allclose(lp2, lp) and ent is not None
    assert torch.allclose(ent[:, 1:], per[:, :-1], atol=1e-9) and (ent[:, 0] == 0).all()


def test_group_advantages_of_groups_of_different_sizes_and_a_pooled_baseline() -> None:
    """Groups sampled in rounds: sizes 2, 3 and 5 in one batch, each normalised by its own count (worked by hand);
    a down-sampled group's baseline the pool of every sample drawn where given."""
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 2])
    got = group_advantages(rewards, groups, eps=0.0)
    # group 0: mean 0, std sqrt(2); group 1: mean 1/3, std sqrt(4/3); group 2: mean -0.6, std sqrt(3.2/4)
    s0, s1, s2 = 2**0.5, (4 / 3) ** 0.5, 0.8**0.5
    want = [1 / s0, -1 / s0, (2 / 3) / s1, (2 / 3) / s1, (-4 / 3) / s1, 1.6 / s2] + [-0.4 / s2] * 4
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    nan = float("nan")
    # group 1 was down-sampled from a pool of mean -0.5, std 1.0: its samples are measured against that
    pool_mean = torch.tensor([nan, nan, -0.5, -0.5, -0.5, nan, nan, nan, nan, nan])
    pool_std = torch.tensor([nan, nan, 1.0, 1.0, 1.0, nan, nan, nan, nan, nan])
    pooled = group_advantages(rewards, groups, eps=0.0, pool_mean=pool_mean, pool_std=pool_std)
    assert pooled.tolist() == pytest.approx(want[:2] + [1.5, 1.5, -0.5] + want[5:], abs=1e-6)
    flat = group_advantages(rewards, groups, normalize_std=False, pool_mean=pool_mean, pool_std=pool_std)
    assert flat[2:5].tolist() == pytest.approx([1.5, 1.5, -0.5])
