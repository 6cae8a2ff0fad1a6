"""The control-plane simulation (bench/simulate.py) at small N: real Redis, buffer, reward server and weight sync
against simulated replicas running the real replica code. What the cost curve relies on: groups flow through the
buffer into batches the learner consumes, every replica serves each new version, and the audit accounts for every
dispatched prompt."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.simulate import run_n

pytestmark = pytest.mark.slow


def settings(**kw: object) -> argparse.Namespace:
    base = dict(seconds=12.0, warmup_s=12.0, groups_per_s=16.0, batch_size=8, max_staleness=4, step_s=0.5,
                prompts=500, length_scale=1.0, procs=2, broadcast=True, weight_numel=1 << 16, churn=0.0,
                churn_every_s=60.0, redis_server=None, sync_max_members=0, loop="continuous")  # fmt: skip
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize(
    ("broadcast", "cap", "loop"),
    [(True, 0, "continuous"), (True, 2, "continuous"), (False, 0, "continuous"), (True, 0, "chunked")],
    ids=["broadcast", "broadcast-capped", "snapshots", "broadcast-chunked"],
)
def test_four_simulated_replicas_train_and_every_prompt_is_accounted(
    tmp_path, broadcast: bool, cap: int, loop: str
) -> None:
    """capped: the learner's group holds 2 of the 4 (--sync-max-members); the other 2 must take the snapshots. The
    replicas run the continuous-batching loop (vLLM's, the default) or the chunked one."""
    row = run_n(4, settings(broadcast=broadcast, sync_max_members=cap, loop=loop), tmp_path)
    assert row["all_alive"] and not row["replica_errors"], row
    assert row["groups"] > 50 and row["versions"] >= 3, row  # groups flowed, batches were trained
    assert row["audit_balanced"] and row["audit_vanished"] == 0 and row["trained_twice"] == 0, row["audit_places"]
    assert row["audit_places"]["trained"] >= 8 * row["versions"]
    # every replica took every version announced in the window within the bound (bench/simulate.py: pickup_bound)
    assert row["pickups"] >= 4 * (row["versions"] - 1), row
    assert row["pickups_missed"] == 0 and row["pickups_late"] == 0, row
    assert math.isfinite(row["pickup_max_s"]) and row["pickup_max_s"] <= row["pickup_bound_s"], row
    for key in ("cpu_buffer_per_1k", "cpu_redis_per_1k", "cpu_reward_per_1k"):
        assert 0 < row[key] < math.inf, (key, row)
    if broadcast:
        assert row["rebuilds"] == 0, row  # steady membership: the group formed before the window, never again
        assert row["group_max"] == (cap or 4), row  # the group reached its size (the cap), and no further


def test_churn_replaces_replicas_and_loses_nothing(tmp_path) -> None:
    row = run_n(6, settings(churn=0.17, churn_every_s=8.0, seconds=20.0), tmp_path)
    assert row["all_alive"] and not row["replica_errors"], row
    assert row["replicas_started"] >= 6 + 3, row  # one replica replaced at each of >= 3 churns (warm-up included)
    assert row["rebuilds"] >= 1, row  # the broadcast group followed the membership
    assert row["sync_max_s"] < 60, row  # no version waited past one membership timeout (the learner's default)
    assert row["pickups_missed"] == 0, row
    assert row["audit_balanced"] and row["audit_vanished"] == 0, row["audit_places"]
