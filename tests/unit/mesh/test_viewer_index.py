"""The viewer's index over a run's recorded files: what it lists, that it reads only what a file added, that a
file replaced whole is read again, and that an id never opens a file the index does not hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import HTTPException

from mesh.layout import RunLayout
from mesh.viewer import Index
from services.episode_log import EpisodeLog, group_record
from tests.unit.services.test_episode_log import group


def run_dir(tmp_path: Path) -> Path:
    layout = RunLayout(tmp_path)
    learner, buffer = layout.episodes
    EpisodeLog(learner, fraction=1, max_mb=8).write(
        "v000001.jsonl", [group_record(group("a"), "trained", 1)], version=1
    )
    dropped = group_record(group("b"), "dropped", 1, reason="no_variance")
    EpisodeLog(buffer, fraction=1, max_mb=8).write("dropped-v000001.jsonl", [dropped], version=1)
    layout.evals.mkdir()
    held = {
        "prompt_id": "p9",
        "task": "arith",
        "prompt": "1+1=",
        "sample": 0,
        "response": "2",
        "response_tokens": 1,
        "finish_reason": "stop",
        "acc": True,
        "score": 1.0,
        "pred": "2",
        "version": 0,
    }
    (layout.evals / "v000000.jsonl").write_text(json.dumps(held) + "\n")
    return tmp_path


def test_every_recorded_sample_is_listed_with_its_outcome(tmp_path: Path) -> None:
    index = Index(run_dir(tmp_path))
    index.refresh(force=True)
    got = sorted((e.outcome, e.reason, e.version, e.acc) for e in index.entries())
    assert got == [
        ("dropped", "no_variance", 1, False),
        ("dropped", "no_variance", 1, True),
        ("held-out", None, 0, True),
        ("trained", None, 1, False),
        ("trained", None, 1, True),
    ]
    e = next(e for e in index.entries() if e.outcome == "trained")
    rec, j = index.record(e.id)
    assert rec["group_id"] == "a" and rec["samples"][j]["text"] == "four"


def test_an_appended_line_is_read_and_a_half_written_one_waits(tmp_path: Path) -> None:
    root = run_dir(tmp_path)
    index = Index(root)
    index.refresh(force=True)
    path = RunLayout(root).episodes[1] / "dropped-v000001.jsonl"
    line = json.dumps(group_record(group("c"), "dropped", 1, reason="all_wrong"))
    with path.open("a") as f:
        f.write(line[:50])  # the buffer is writing it
    index.refresh(force=True)
    assert sum(e.reason == "all_wrong" for e in index.entries()) == 0
    with path.open("a") as f:
        f.write(line[50:] + "\n")
    index.refresh(force=True)
    assert sum(e.reason == "all_wrong" for e in index.entries()) == 2
    assert len(index.entries()) == 7


def test_a_file_replaced_whole_is_read_again(tmp_path: Path) -> None:
    root = run_dir(tmp_path)
    index = Index(root)
    index.refresh(force=True)
    log = EpisodeLog(RunLayout(root).episodes[0], fraction=1, max_mb=8)
    old = [e.id for e in index.entries() if e.outcome == "trained"]
    bigger = [group_record(group("z", n=1), "trained", 1), group_record(group("y", n=2), "trained", 1)]
    log.write("v000001.jsonl", bigger, version=1, replace=True)  # larger than before: read again by its inode
    index.refresh(force=True)
    trained = [e for e in index.entries() if e.outcome == "trained"]
    assert len(trained) == 3 and index.record(trained[0].id)[0]["group_id"] == "z"
    with pytest.raises(HTTPException):
        index.record(old[1])  # an id of the file it replaced: its line now holds one sample


@pytest.mark.parametrize("bad", ["../../etc/passwd:0:0", "learner/../../x.jsonl:0:0", "learner/v9.jsonl:0:0", "x"])
def test_an_id_opens_only_a_file_the_index_holds(tmp_path: Path, bad: str) -> None:
    index = Index(run_dir(tmp_path))
    index.refresh(force=True)
    with pytest.raises(HTTPException) as e:
        index.record(bad)
    assert e.value.status_code in (400, 404)
