"""Realistic example messages (for tests, benchmarks and `dapo-mesh up`) and a transport self-check."""

from __future__ import annotations

import random
import uuid

from services.schemas import (
    DroppedGroup,
    EvalResult,
    Message,
    PromptTask,
    ReplicaHeartbeat,
    Sample,
    Score,
    ScoredGroup,
    SyncGroup,
    TrainBatch,
    WeightVersion,
)


def example_task(i: int = 0, n_samples: int = 4) -> PromptTask:
    return PromptTask(
        task_id=f"task-{i}-{uuid.uuid4().hex[:8]}",
        prompt_id=f"chain_sum/{i}",
        prompt=f"What is {i} + {i + 1}? Reply with 'Answer: <number>'.",
        ground_truth=str(2 * i + 1),
        verifier="reasoning_gym:chain_sum",
        data_source="reasoning_gym/chain_sum",
        n_samples=n_samples,
    )


def example_group(
    i: int = 0, n_samples: int = 4, n_tokens: int = 16, version: int = 0, seed: int | None = None
) -> ScoredGroup:
    """A scored group whose samples have `n_tokens` tokens each, with varied correctness."""
    rng = random.Random(i if seed is None else seed)
    task = example_task(i, n_samples)
    samples, scores = [], []
    for j in range(n_samples):
        ids = [rng.randrange(49152) for _ in range(n_tokens)]
        samples.append(
            Sample(
                response_token_ids=ids,
                response_text=f"sample {j} of {i}: " + " ".join(map(str, ids[:8])),
                logprobs=[-rng.expovariate(2.0) for _ in ids],
                finish_reason="length" if j == n_samples - 1 else "stop",
                policy_version=version,
            )
        )
        acc = j % 2 == 0
        scores.append(Score(reward=1.0 if acc else -1.0, acc=acc, pred=str(2 * i + 1) if acc else "0"))
    return ScoredGroup(task=task, samples=samples, scores=scores, replica_id="rollout-0")


def example_messages() -> list[Message]:
    """One message of every wire type."""
    groups = [example_group(i, version=i) for i in range(2)]
    return [
        groups[0].task,
        groups[0].samples[0],
        groups[0].scores[0],
        groups[0],
        DroppedGroup(
            task_id="t0", prompt_id="p0", reason="all_correct", replica_id="rollout-0", min_version=0, at_version=1
        ),
        TrainBatch.assemble(0, groups),
        WeightVersion(
            version=1,
            step=1,
            batch_id=0,
            checkpoint_dir="/tmp/ckpt/v1",
            checksum=12345,
            replicas=["rollout-0"],
            sync_seconds=0.2,
        ),
        ReplicaHeartbeat(
            replica_id="rollout-0",
            host="127.0.0.1",
            port=8002,
            weight_version=1,
            state="ready",
            weight_checksum=12345,
            sync_broadcast=True,
        ),
        SyncGroup(
            generation=1,
            host="127.0.0.1",
            port=29600,
            candidates=["rollout-0"],
            timeout_s=60.0,
            incarnations=["3f2a9c0d1e7b"],
        ),
        EvalResult(
            version=9,
            replica_id="rollout-0",
            k=4,
            n_prompts=100,
            avg_at_k=0.2875,
            pass_at_k=0.54,
            mean_response_tokens=24.1,
            truncated_frac=0.0,
            seconds=62.8,
        ),
    ]


def transport_selfcheck(redis_url: str) -> dict[str, bool]:
    """Publish one message of each type to a scratch stream, read it back through a group, compare."""
    from services.streams import StreamConsumer, StreamProducer, connect

    client = connect(redis_url, retries=2)
    stream = f"dapo:selfcheck:{uuid.uuid4().hex[:8]}"
    result: dict[str, bool] = {}
    try:
        for msg in example_messages():
            producer = StreamProducer(client, stream)
            consumer = StreamConsumer(client, stream, "selfcheck", "c0", type(msg), claim_idle_ms=60_000)
            producer.publish(msg)
            got = consumer.read(count=1, block_ms=1000)
            result[type(msg).__name__] = len(got) == 1 and got[0].message == msg
            consumer.ack(*[d.entry_id for d in got])
            client.delete(stream)
    finally:
        client.delete(stream)
        client.close()
    return result
