"""`dapo-mesh audit` on streams built by the real transport in a real Redis: a group the buffer dropped as a
"duplicate" of itself (what reclaiming a held entry led to) is a loss, not a drop; a prompt whose pass-rate state
counts a group twice, or lost one, is named."""

from __future__ import annotations

from pathlib import Path

from buffer.curriculum import KEY_PROMPT_STATE, PromptStates
from mesh.audit import audit
from services.redis_server import EmbeddedRedis
from services.schemas import DroppedGroup, PromptTask, ScoredGroup
from services.selfcheck import example_group
from services.streams import (
    GROUP_BUFFER,
    GROUP_ROLLOUT,
    STREAM_DROPPED,
    STREAM_PROMPTS,
    STREAM_ROLLOUTS,
    StreamConsumer,
    StreamProducer,
    connect,
)


def dropped(g: ScoredGroup, reason: str) -> DroppedGroup:
    return DroppedGroup(task_id=g.group_id, prompt_id=g.task.prompt_id, reason=reason, replica_id=g.replica_id,
                        min_version=0, at_version=0)  # fmt: skip


def test_a_group_dropped_as_a_duplicate_of_itself_is_lost(server: EmbeddedRedis, tmp_path: Path) -> None:
    client = connect(server.url)
    groups = [example_group(i) for i in range(3)]
    prompts = StreamConsumer(client, STREAM_PROMPTS, GROUP_ROLLOUT, "rollout-0", PromptTask)
    StreamProducer(client, STREAM_PROMPTS).publish_many(g.task for g in groups)
    tasks = prompts.read(count=3)
    prompts.ack_and_publish([d.entry_id for d in tasks], [(STREAM_ROLLOUTS, g) for g in groups])
    buffer = StreamConsumer(client, STREAM_ROLLOUTS, GROUP_BUFFER, "buffer-0", ScoredGroup)
    lost, filtered, copied = buffer.read(count=3)
    buffer.ack_and_publish([lost.entry_id], [(STREAM_DROPPED, dropped(lost.message, "duplicate"))])  # no copy
    buffer.ack_and_publish([filtered.entry_id], [(STREAM_DROPPED, dropped(filtered.message, "all_correct"))])
    # the third was delivered twice: one copy dropped as a duplicate, the other still waiting for a batch
    StreamProducer(client, STREAM_DROPPED).publish(dropped(copied.message, "duplicate"))

    report = audit(client, tmp_path)
    assert report.vanished == [lost.message.group_id]
    assert report.places["vanished"] == 1 and report.places["dropped"] == 1 and report.places["at_buffer"] == 1
    assert report.dropped_by_reason == {"duplicate": 2, "all_correct": 1} and not report.balanced


def on_prompt(g: ScoredGroup, prompt_id: str, task_id: str | None = None) -> ScoredGroup:
    task = g.task.model_copy(update={"prompt_id": prompt_id, "task_id": task_id or g.task.task_id})
    return g.model_copy(update={"task": task})


def test_the_audit_names_a_prompt_whose_state_counts_a_group_twice_or_lost_one(
    server: EmbeddedRedis, tmp_path: Path
) -> None:
    client = connect(server.url)
    groups = [on_prompt(example_group(i), "p0" if i < 2 else "p1") for i in range(4)]
    prompts = StreamConsumer(client, STREAM_PROMPTS, GROUP_ROLLOUT, "rollout-0", PromptTask)
    StreamProducer(client, STREAM_PROMPTS).publish_many(g.task for g in groups)
    prompts.ack_and_publish([d.entry_id for d in prompts.read(count=4)], [(STREAM_ROLLOUTS, g) for g in groups])
    buffer = StreamConsumer(client, STREAM_ROLLOUTS, GROUP_BUFFER, "buffer-0", ScoredGroup)
    read = buffer.read(count=4)
    states = PromptStates(client)
    for d in read[:3]:  # the 4th was read and not counted yet: the buffer died in between
        assert states.record(d.message, zero_variance=True, version=0).counted
    assert not states.record(read[0].message, zero_variance=True, version=0).counted  # a redelivery: once
    drops = [(STREAM_DROPPED, dropped(d.message, "all_correct")) for d in read[:3:2]]
    buffer.ack_and_publish([read[0].entry_id, read[2].entry_id], drops)  # p0's 2nd and p1's 2nd still held

    report = audit(client, tmp_path)
    assert (report.state_checked, report.state_miscounted, report.balanced) == (2, [], True)

    states.record(on_prompt(groups[0], "p0", "p0-again"), zero_variance=True, version=0)  # counted twice
    client.hdel(KEY_PROMPT_STATE, "p1")  # p1's dropped group no longer counted
    report = audit(client, tmp_path)
    assert report.state_miscounted == ["p0", "p1"] and not report.balanced
    assert report.vanished == []


def test_token_lags_count_every_trained_token_by_the_version_that_sampled_it() -> None:
    from mesh.audit import AuditReport, token_lags
    from services.schemas import TrainBatch

    g = example_group(0)
    n = len(g.samples[0].response_token_ids)
    spanning = g.samples[0].model_copy(update={"policy_version": 3, "version_runs": [(3, 2), (5, n - 2)]})
    plain = [s.model_copy(update={"policy_version": 4}) for s in g.samples[1:]]
    group = g.model_copy(update={"samples": [spanning, *plain]})
    batch = TrainBatch(batch_id=0, groups=[group], min_version=group.min_version, max_version=group.max_version)
    assert (batch.min_version, batch.max_version) == (3, 5)  # the oldest and the newest token
    r = AuditReport()
    token_lags(r, {"d": (5, batch)})  # trained at version 5
    others = sum(len(s.response_token_ids) for s in plain)
    assert r.token_lag == {0: n - 2, 1: others, 2: 2}
    assert (r.samples_trained, r.samples_spanning) == (len(g.samples), 1)
