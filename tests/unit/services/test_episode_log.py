"""The episode log: what a writer records, how much, and that a restarted writer makes the same choice."""

from __future__ import annotations

import json
from pathlib import Path

from services.episode_log import EpisodeLog, expand, group_record, runs, sample_record
from services.schemas import PromptTask, Sample, Score, ScoredGroup, Turn


def group(gid: str = "g1", n: int = 2) -> ScoredGroup:
    task = PromptTask(
        task_id=gid, prompt_id="p1", prompt="2+2=", ground_truth="4", verifier="math", data_source="arith", n_samples=n
    )
    samples = [
        Sample(
            response_token_ids=[5, 6, 7, 8],
            response_text="four",
            logprobs=[-0.1, -0.2, -0.3, -0.123456],
            finish_reason="stop",
            policy_version=3,
            version_runs=[(3, 1), (4, 3)],
            turns=[Turn(role="model", tokens=2), Turn(role="env", tokens=1), Turn(role="model", tokens=1)],
        )
        for _ in range(n)
    ]
    scores = [Score(reward=1.0, acc=True, pred="4"), Score(reward=-1.0, acc=False)][:n]
    return ScoredGroup(task=task, samples=samples, scores=scores, replica_id="rollout-0")


def test_runs_and_expand_are_inverse() -> None:
    labels = [3, 3, 4, 4, 4, 7]
    assert runs(labels) == [[3, 2], [4, 3], [7, 1]]
    assert expand(runs(labels), 6, None) == labels
    assert expand(None, 3, "model") == ["model"] * 3


def test_a_sample_keeps_its_tokens_versions_turns_and_mask() -> None:
    g = group()
    rec = sample_record(
        g.samples[0], 1.0, True, "4", advantage=0.7071, learner_logp=[-0.11, -0.21, 0.0, -0.12], loss_mask=[1, 1, 0, 0]
    )
    assert rec["ids"] == [5, 6, 7, 8]
    assert rec["logp"] == [-0.1, -0.2, -0.3, -0.1235]  # 4 decimals
    assert rec["versions"] == [[3, 1], [4, 3]]
    assert rec["turns"] == [["model", 2], ["env", 1], ["model", 1]]
    assert rec["mask"] == [[1, 2], [0, 2]]  # the learner's mask (the last model token filtered), not the turns'
    own = sample_record(g.samples[0], 1.0, True, "4")
    assert own["mask"] == [[1, 2], [0, 1], [1, 1]] and own["learner_logp"] is None  # the environment's token: 0


def test_a_fraction_chooses_by_group_id_the_same_after_a_restart(tmp_path: Path) -> None:
    a = EpisodeLog(tmp_path / "a", fraction=0.25, max_mb=1)
    b = EpisodeLog(tmp_path / "b", fraction=0.25, max_mb=1)
    ids = [f"task-{i}" for i in range(4000)]
    chosen = [i for i in ids if a.wants(i)]
    assert chosen == [i for i in ids if b.wants(i)]
    assert 0.22 < len(chosen) / len(ids) < 0.28
    assert not EpisodeLog(tmp_path / "c", fraction=0.0, max_mb=1).wants("task-1")
    assert not (tmp_path / "c").exists()  # recording off: nothing on disk


def test_replace_records_a_version_once_and_append_adds(tmp_path: Path) -> None:
    log = EpisodeLog(tmp_path, fraction=1.0, max_mb=1, meta={"model_dir": "/m"})
    rec = group_record(group(), "trained", 5, batch_id=2)
    log.write("v000005.jsonl", [rec], version=5, replace=True)
    log.write("v000005.jsonl", [rec], version=5, replace=True)  # the batch trained again after a crash
    assert len((tmp_path / "v000005.jsonl").read_text().splitlines()) == 1
    log.write("dropped-v000005.jsonl", [rec], version=5)
    log.write("dropped-v000005.jsonl", [rec], version=5)
    assert len((tmp_path / "dropped-v000005.jsonl").read_text().splitlines()) == 2
    assert json.loads((tmp_path / "meta.json").read_text())["model_dir"] == "/m"
    line = json.loads((tmp_path / "v000005.jsonl").read_text())
    assert line["outcome"] == "trained" and line["version"] == 5 and line["task"] == "arith"
    assert [s["acc"] for s in line["samples"]] == [True, False]


def test_recording_stops_at_its_bound_and_says_where(tmp_path: Path) -> None:
    rec = group_record(group(), "dropped", 1, reason="all_correct")
    size = len(json.dumps(rec, separators=(",", ":"))) + 1
    log = EpisodeLog(tmp_path, fraction=1.0, max_mb=(2.5 * size) / 2**20)
    assert log.write("a.jsonl", [rec], version=1) == size
    assert log.write("a.jsonl", [rec], version=2) == size
    assert log.write("a.jsonl", [rec], version=3) == 0  # the third would pass the bound
    assert not log.wants("anything")
    assert json.loads((tmp_path / "meta.json").read_text())["stopped_at"] == 3
    again = EpisodeLog(tmp_path, fraction=1.0, max_mb=(2.5 * size) / 2**20)  # a restart counts what is there
    assert again.bytes == 2 * size and again.write("a.jsonl", [rec], version=4) == 0
