"""The snapshot-folder contract: how the learner names the HF weight folders it exports and which one is newest.
Written by the learner (learner/checkpoint.py), read by the rollout replicas (late joiners, the filesystem
transport), replay and the tests; so, like a stream message, it lives in the ground.

    hf/v000123/        one version: model.safetensors, config.json, tokenizer files (transformers' layout)
    hf/latest          a text file naming the newest complete folder ("v000123"), replaced atomically

    out = snapshot_dir(hf, 123)                  # hf/v000123
    write_latest(hf, out)                        # after the folder is complete
    newest = latest_snapshot(hf)                 # Snapshot(path, version, written) or None
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"


@dataclass(frozen=True)
class Snapshot:
    path: Path
    version: int
    written: float  # mtime of `latest` when it named this folder (seconds since the epoch)


def snapshot_name(version: int) -> str:
    return f"v{version:06d}"


def snapshot_dir(hf_dir: Path, version: int) -> Path:
    return hf_dir / snapshot_name(version)


def snapshot_version(name: str) -> int:
    """`v000123` -> 123; a name that is not a snapshot folder raises ValueError."""
    if not name.startswith("v") or not name[1:].isdigit():
        raise ValueError(f"{name!r} is not a snapshot folder name (v + 6 digits)")
    return int(name[1:])


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old content or the new one, never a part."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_latest(hf_dir: Path, folder: Path) -> None:
    write_atomic(hf_dir / LATEST, folder.name)


def latest_snapshot(hf_dir: Path) -> Snapshot | None:
    """The folder `latest` names, or None before the first export."""
    latest = hf_dir / LATEST
    try:
        name, written = latest.read_text().strip(), latest.stat().st_mtime
    except FileNotFoundError:
        return None
    return Snapshot(hf_dir / name, snapshot_version(name), written)


def snapshot_folders(hf_dir: Path) -> list[str]:
    """The complete snapshot folders' names, oldest first (a half-written `.tmp-…` folder is not one)."""
    return sorted(p.name for p in hf_dir.iterdir() if p.is_dir() and p.name.startswith("v"))
