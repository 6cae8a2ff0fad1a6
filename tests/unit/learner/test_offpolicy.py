"""The off-policy correction and the gap measures against references written here from the formulas, token by
token, on ragged masks and with weights far outside the caps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from learner.offpolicy import MODES, gap_by_lag, gap_metrics, importance_weights, token_versions

CAP = 2.0


def ragged() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    behav = prox + torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.5
    behav[0, 1] = prox[0, 1] - 5.0  # weight e^5: far above the cap
    behav[1, 2] = prox[1, 2] + 5.0  # weight e^-5: far below 1/C
    behav[2, 3] = prox[2, 3] - 30.0  # beyond the clamp of 20 in log space
    mask = torch.zeros(4, 7, dtype=torch.float64)
    for i, (a, b) in enumerate([(1, 7), (2, 5), (0, 7), (3, 4)]):  # ragged: every row its own span
        mask[i, a:b] = 1
    return prox, behav, mask


def ref_weight(mode: str, prox: list[list[float]], behav: list[list[float]], mask: list[list[float]], i: int,
               t: int) -> float:  # fmt: skip
    if not mask[i][t]:
        return 0.0

    def w(j: int) -> float:
        return math.exp(max(-20.0, min(20.0, prox[i][j] - behav[i][j])))

    if mode == "off":
        return 1.0
    if mode == "token-tis":
        return min(w(t), CAP)
    if mode == "token-mask":
        return w(t) if 1 / CAP <= w(t) <= CAP else 0.0
    logs = [math.log(w(j)) for j in range(len(mask[i])) if mask[i][j]]
    return min(math.exp(sum(logs) / len(logs)), CAP)  # seq-geo-tis: the geometric mean


@pytest.mark.parametrize("mode", MODES)
def test_weights_match_the_reference(mode: str) -> None:
    prox, behav, mask = ragged()
    got, bound = importance_weights(prox, behav, mask, mode=mode, cap=CAP)  # type: ignore[arg-type]
    p, b, m = prox.tolist(), behav.tolist(), mask.tolist()
    for i in range(4):
        for t in range(7):
            assert got[i, t].item() == pytest.approx(ref_weight(mode, p, b, m, i, t), rel=1e-9), (mode, i, t)
    assert not bool((bound & (mask == 0)).any())  # nothing outside the mask is counted
    if mode in ("token-tis", "token-mask"):
        assert bool(bound[0, 1]) and got[0, 1].item() == (CAP if mode == "token-tis" else 0.0)
        assert bool(bound[1, 2]) == (mode == "token-mask")  # far below 1/C: masked, not truncated
    if mode == "seq-geo-tis":  # one weight per sequence, the same for each of its tokens
        for i in range(4):
            row = got[i][mask[i] > 0]
            assert torch.allclose(row, row[0].expand_as(row))


def test_a_cap_of_one_or_less_is_refused() -> None:
    prox, behav, mask = ragged()
    with pytest.raises(ValueError, match="cap C must be > 1"):
        importance_weights(prox, behav, mask, mode="token-tis", cap=1.0)


def test_gap_metrics_match_the_reference() -> None:
    prox, behav, mask = ragged()
    d = [max(-20.0, min(20.0, p - b)) for pr, br, mr in zip(prox.tolist(), behav.tolist(), mask.tolist(), strict=True)
         for p, b, m in zip(pr, br, mr, strict=True) if m]  # fmt: skip
    got = gap_metrics(prox, behav, mask)
    assert got["behav_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / len(d))
    assert got["logp_gap_mean"] == pytest.approx(sum(abs(x) for x in d) / len(d))
    gaps = sorted(abs(x) for x in d)
    pos = 0.99 * (len(gaps) - 1)  # linear interpolation, as torch.quantile
    lo = math.floor(pos)
    assert got["logp_gap_p99"] == pytest.approx(gaps[lo] + (gaps[min(lo + 1, len(gaps) - 1)] - gaps[lo]) * (pos - lo))
    same = gap_metrics(prox, prox.clone(), mask)
    assert same == {"behav_kl": 0.0, "logp_gap_mean": 0.0, "logp_gap_p99": 0.0}  # on-policy: no gap


def test_gap_by_lag_splits_the_tokens() -> None:
    prox, behav, mask = ragged()
    lags = torch.tensor([1, 2, 1, 0]).unsqueeze(-1).expand_as(mask).clone()
    lags[2, :3] = 0  # the third sample spans a weight update: its first three tokens lag 0, the rest lag 1
    got = gap_by_lag(prox, behav, mask, lags)
    assert set(got) == {f"{k}_lag{n}" for k in ("behav_kl", "logp_gap_mean", "logp_gap_p99") for n in (0, 1, 2)}
    rows = torch.tensor([True, False, True, False])
    by_rows = gap_metrics(prox[rows], behav[rows], mask[rows])["logp_gap_mean"]
    assert got["logp_gap_mean_lag1"] != pytest.approx(by_rows)  # the spanning sample's lag-1 tokens count too
    sel = (mask > 0) & (lags == 1)
    assert got["logp_gap_mean_lag1"] == pytest.approx(float((prox - behav).clamp(-20, 20)[sel].abs().mean()))
    sel0 = (mask > 0) & (lags == 0)
    assert got["logp_gap_mean_lag0"] == pytest.approx(float((prox - behav).clamp(-20, 20)[sel0].abs().mean()))


def test_token_versions_count_tokens_and_spanning_samples() -> None:
    _, _, mask = ragged()
    versions = torch.full((4, 7), 5, dtype=torch.long)
    versions[2, 3:] = 6  # sample 2 spans an update at its fourth token
    versions[0, 0] = 1  # outside sample 0's response (mask 0 there): ignored
    got = token_versions(versions, mask, version=7)
    n = float(mask.sum())
    assert got["token_lag_mean"] == pytest.approx((2 * n - 4) / n)  # sample 2's last 4 tokens lag 1, the rest 2
    assert got["multi_version_frac"] == pytest.approx(1 / 4)


def test_an_old_preset_that_says_seq_tis_is_told_the_new_name(tmp_path: Path) -> None:
    """`seq-tis` was the geometric mean of the token weights, not sequence-level IS (their product): renamed
    `seq-geo-tis`, and the old name is an error that names the new one, in a service's settings and in a preset."""
    from learner.settings import LearnerSettings
    from mesh.config import PresetError, load_preset

    with pytest.raises(ValidationError, match="off_policy 'seq-tis' is now 'seq-geo-tis'"):
        LearnerSettings.model_validate({"off_policy": "seq-tis"})
    assert LearnerSettings.model_validate({"off_policy": "seq-geo-tis"}).off_policy == "seq-geo-tis"
    preset = tmp_path / "old.toml"
    preset.write_text('[learner]\noff_policy = "seq-tis"\n')
    with pytest.raises(PresetError, match=r"\[learner\] off_policy: .*is now 'seq-geo-tis'"):
        load_preset(preset)
