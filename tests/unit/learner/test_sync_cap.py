"""The broadcast group's cap (`sync_max_members`): who is in it, and the settings it needs."""

from __future__ import annotations

import pytest

from learner.settings import LearnerSettings
from learner.weight_sync import capped


def test_no_cap_or_room_for_all_keeps_every_live_replica() -> None:
    live = ["r0", "r1", "r2"]
    assert capped(live, [], 0) == live
    assert capped(live, ["r1"], 3) == live


def test_the_cap_fills_by_id_at_first() -> None:
    assert capped(["r0", "r1", "r2", "r3"], [], 2) == ["r0", "r1"]


def test_current_members_keep_their_places_so_a_newcomer_does_not_rebuild_the_group() -> None:
    # r0 joined after r2 and r3 formed the group: the group stays r2, r3 (no rebuild)
    assert capped(["r0", "r2", "r3"], ["r2", "r3"], 2) == ["r2", "r3"]
    # r3 left: r2 stays, the free place goes to the first by id
    assert capped(["r0", "r1", "r2"], ["r2", "r3"], 2) == ["r0", "r2"]


def test_a_cap_needs_the_snapshots_the_others_load() -> None:
    assert LearnerSettings(sync_max_members=8).sync_max_members == 8
    with pytest.raises(ValueError, match="hf_export"):
        LearnerSettings(sync_max_members=8, hf_export=False)
    with pytest.raises(ValueError, match="weight_sync broadcast"):
        LearnerSettings(sync_max_members=8, weight_sync="none")
    with pytest.raises(ValueError):
        LearnerSettings(sync_max_members=-1)
