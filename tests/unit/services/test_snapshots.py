"""The snapshot-folder contract (services/snapshots.py): the learner writes hf/v000123/ and then `latest`; a reader
sees no snapshot before the first, the newest complete one after, never a half-written folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.snapshots import latest_snapshot, snapshot_dir, snapshot_folders, snapshot_version, write_latest


def test_names_and_versions_round_trip() -> None:
    assert snapshot_dir(Path("hf"), 123) == Path("hf/v000123")
    assert snapshot_version("v000123") == 123 and snapshot_version(snapshot_dir(Path("x"), 7).name) == 7
    for bad in ("latest", "v12a", ".tmp-v000001", "000001"):
        with pytest.raises(ValueError, match="snapshot folder"):
            snapshot_version(bad)


def test_latest_names_the_newest_complete_folder(tmp_path: Path) -> None:
    assert latest_snapshot(tmp_path) is None  # before the first export
    (tmp_path / ".tmp-v000002").mkdir()  # an export under way is not a snapshot
    for v in (1, 3):
        snapshot_dir(tmp_path, v).mkdir()
    write_latest(tmp_path, snapshot_dir(tmp_path, 3))
    newest = latest_snapshot(tmp_path)
    assert newest is not None and (newest.path, newest.version) == (tmp_path / "v000003", 3)
    assert newest.written == (tmp_path / "latest").stat().st_mtime
    assert snapshot_folders(tmp_path) == ["v000001", "v000003"]
    assert not list(tmp_path.glob("*.tmp"))  # `latest` was replaced atomically, its temporary file is gone
