"""Recorded batches: what the learner trained, in order, to replay offline (`dapo-mesh replay`).

    learner --record-batches ...        # writes run_dir/batches/<version>.msgpack and batches/settings.json
    dapo-mesh replay --batches RUN_DIR --model-dir M --out OUT

A batch is recorded as it was trained (after the staleness cut at the update) under the policy version it was
trained at: `000000.msgpack` moved the weights from version 0 to 1. The name is the version, so a batch retrained
after a crash overwrites its own record with the same bytes, and a run's records are exactly its updates.
`settings.json` holds the learner settings that shape an update (learning rate and schedule, clip, loss,
mini-batches, off-policy correction, dtype, seed, ...), not where the run ran (paths, ports, Redis, secrets).
The batch is the wire format (msgpack, services/streams.py): no pickle.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from learner.settings import LearnerSettings
from services.schemas import TrainBatch
from services.settings import RedisSettings, ServiceSettings
from services.streams import pack, unpack

log = logging.getLogger(__name__)
BATCHES = "batches"
SETTINGS = "settings.json"
# where and how the learner runs, not what an update computes: not recorded, given again at replay
PLACE_FIELDS = (
    {
        "model_dir",
        "run_dir",
        "threads",
        "cpu_cores",
        "checkpoint_every",
        "keep_checkpoints",
        "hf_export",
        "weight_sync",
        "sync_host",
        "sync_bind_host",
        "sync_secret",
        "sync_port",
        "sync_timeout_s",
        "sync_join_s",
        "sync_max_members",
        "sync_bucket_mb",
        "keep_batches",
        "consumer_name",
        "claim_idle_ms",
        "max_deliveries",
        "hold_after_max",
        "dist_port",
        "dist_timeout_s",
        "ranks",
        "record_batches",
        "record_episodes",
        "record_episodes_mb",
        "zero_stage",
    }
    | set(ServiceSettings.model_fields)
    | set(RedisSettings.model_fields)
)


def batches_dir(run_dir: Path) -> Path:
    """A learner's run dir, or a mesh run dir (its learner/ below)."""
    for d in (run_dir / BATCHES, run_dir / "learner" / BATCHES):
        if d.is_dir():
            return d
    raise FileNotFoundError(f"no recorded batches in {run_dir} (run the learner with --record-batches)")


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def update_settings(s: LearnerSettings) -> dict[str, Any]:
    return s.model_dump(mode="json", exclude=PLACE_FIELDS)


def record_settings(run_dir: Path, s: LearnerSettings) -> None:
    """At start (again after a restart: the settings of the newest start win, with a warning if they changed)."""
    d = run_dir / BATCHES
    d.mkdir(parents=True, exist_ok=True)
    new = update_settings(s)
    if (d / SETTINGS).exists() and (old := read_settings(d)) != new:
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        log.warning(
            "the update settings changed since the last start (%s): a replay uses the new ones for every "
            "recorded batch",
            ", ".join(changed),
        )
    _write_durably(d / SETTINGS, json.dumps(new, indent=1, sort_keys=True).encode())


def record_batch(run_dir: Path, version: int, batch: TrainBatch) -> Path:
    """The batch trained at `version`, on disk (fsync'd) before the learner reports the update."""
    path = run_dir / BATCHES / f"{version:06d}.msgpack"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_durably(path, pack(batch))
    return path


def read_settings(d: Path) -> dict[str, Any]:
    path = d / SETTINGS
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the settings the batches were trained with")
    return dict(json.loads(path.read_text()))


def recorded(d: Path) -> list[tuple[int, Path]]:
    """(version, file) of every recorded batch, in order; an error if one is missing from the sequence."""
    found = sorted((int(p.stem), p) for p in d.glob("*.msgpack") if p.stem.isdigit())
    if not found:
        raise FileNotFoundError(f"no recorded batches in {d}")
    first = found[0][0]
    for i, (version, _) in enumerate(found):
        if version != first + i:
            raise ValueError(f"{d}: the batch trained at version {first + i} is missing (found {version} next)")
    return found


def load_batch(path: Path) -> TrainBatch:
    return unpack(path.read_bytes(), TrainBatch)
