"""learner/record.py: the record of a run's batches, its order and its settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from learner.record import batches_dir, load_batch, read_settings, record_batch, record_settings, recorded
from learner.settings import LearnerSettings
from learner.tiny import tiny_batch


def test_batches_are_recorded_by_version_and_read_back_in_order(tmp_path: Path) -> None:
    batches = [tiny_batch(v) for v in range(3)]
    for v in (2, 0, 1):
        record_batch(tmp_path, v, batches[v])
    record_batch(tmp_path, 1, batches[1])  # retrained after a crash: the same record, once
    d = batches_dir(tmp_path)
    assert [v for v, _ in recorded(d)] == [0, 1, 2]
    assert [load_batch(p) for _, p in recorded(d)] == batches
    assert not list(d.glob(".*tmp"))  # written through a temporary file, renamed


def test_a_gap_in_the_record_is_named(tmp_path: Path) -> None:
    for v in (0, 1, 3):
        record_batch(tmp_path, v, tiny_batch(v))
    with pytest.raises(ValueError, match="version 2 is missing"):
        recorded(batches_dir(tmp_path))


def test_a_mesh_run_dir_finds_its_learners_record(tmp_path: Path) -> None:
    record_batch(tmp_path / "learner", 0, tiny_batch(0))
    assert batches_dir(tmp_path) == tmp_path / "learner" / "batches"
    with pytest.raises(FileNotFoundError, match="--record-batches"):
        batches_dir(tmp_path / "nothing")


def test_settings_keep_what_shapes_an_update_and_no_secret_or_place(tmp_path: Path) -> None:
    s = LearnerSettings(model_dir=tmp_path / "m", run_dir=tmp_path, lr=3e-4, seed=5, clip_high=0.3,
                        auth_token=SecretStr("s3cret-token"), sync_secret=SecretStr("s3cret-key"), redis_url="redis://x:6379",
                        threads=2)  # fmt: skip
    record_settings(tmp_path, s)
    got = read_settings(batches_dir(tmp_path))
    assert (got["lr"], got["seed"], got["clip_high"], got["off_policy"]) == (3e-4, 5, 0.3, "off")
    text = (tmp_path / "batches" / "settings.json").read_text()
    assert "s3cret" not in text and "redis://" not in text
    assert not {"model_dir", "run_dir", "threads", "port", "zero_stage"} & got.keys()
    assert LearnerSettings.model_validate(got | {"model_dir": tmp_path}).lr == 3e-4  # what replay builds from it


def test_a_run_with_a_capped_broadcast_group_replays(tmp_path: Path) -> None:
    """The weight sync's settings are the run's place, not its updates: replay (weight sync off, no HF export)
    must not meet a recorded sync_max_members its validator refuses without them."""
    record_settings(tmp_path, LearnerSettings(sync_max_members=8, sync_join_s=3.0))
    got = read_settings(batches_dir(tmp_path))
    assert not {"sync_max_members", "sync_join_s"} & got.keys()
    replayed = got | {"model_dir": tmp_path, "run_dir": tmp_path, "weight_sync": "none", "hf_export": False}
    assert LearnerSettings.model_validate(replayed).sync_max_members == 0
