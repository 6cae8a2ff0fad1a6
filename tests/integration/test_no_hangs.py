"""No hangs: a peer stopped with SIGSTOP (alive, silent: the worst case for timeouts) makes each waiting side
give up within its configured limit, and recover once the peer is back (SIGCONT).
Redis (a stream consumer), HTTP (the rollout's reward client), torch.distributed (a weight broadcast)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from rollout.engines.base import Completion
from rollout.metrics import RolloutMetrics
from rollout.publisher import Generated, Publisher
from rollout.reward_client import RewardClient, RewardUnavailable
from rollout.settings import RolloutSettings
from services.child_process import child_env, running
from services.redis_server import EmbeddedRedis
from services.schemas import PromptTask, ScoreItem
from services.selfcheck import example_task
from services.streams import RedisUnavailable, StreamConsumer, StreamProducer, connect
from services.weight_wire import SyncTimeout, broadcast, make_group


def seconds(fn) -> tuple[float, BaseException | None]:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 -- returned to the test
        return time.monotonic() - t0, e
    return time.monotonic() - t0, None


@pytest.fixture
def stopped_later() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:  # never leave a stopped process behind
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_redis_stopped_consumer_gives_up_then_recovers(tmp_path: Path, stopped_later: list[int]) -> None:
    timeout_s, retries = 1.0, 2
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url, timeout_s=timeout_s, retries=retries)
        consumer = StreamConsumer(client, "s", "g", "c", PromptTask, claim_idle_ms=60_000)
        StreamProducer(client, "s").publish(example_task(0))
        assert len(consumer.read(count=1, block_ms=100)) == 1
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        stopped_later.append(server.proc.pid)
        took, err = seconds(lambda: consumer.read(count=1, block_ms=100))
        # each try waits at most the socket timeout; the backoff between tries is capped at 2 s
        limit = (retries + 1) * (timeout_s + 0.1) + retries * 2.0 + 1.0
        assert isinstance(err, RedisUnavailable) and took <= limit, (took, err)
        os.kill(server.proc.pid, signal.SIGCONT)
        later = example_task(1)
        StreamProducer(client, "s").publish(later)
        assert [d.message.task_id for d in consumer.read(count=1, block_ms=100)] == [later.task_id]  # back


@pytest.mark.slow
def test_reward_server_stopped_client_gives_up_then_recovers(stopped_later: list[int]) -> None:
    item = ScoreItem(id="a", response="Answer: 4", ground_truth="4", verifier="dapo_math")
    with running("reward_server", "--workers", "1", ready_path="/readyz") as (base, proc):
        client = RewardClient(base, timeout_s=1.0, retries=1)
        assert client.score([item])[0].acc
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_later.append(proc.pid)
        took, err = seconds(lambda: client.score([item]))
        assert isinstance(err, RewardUnavailable) and took <= 2 * 1.0 + 5.0, (took, err)  # 2 tries + backoff
        os.kill(proc.pid, signal.SIGCONT)
        assert client.score([item])[0].acc
        client.close()


@pytest.mark.slow
def test_a_hung_reward_server_does_not_let_the_held_prompts_be_reclaimed(
    tmp_path: Path, stopped_later: list[int]
) -> None:
    """The publisher's scoring tries take longer than the claim time (a server that takes the request and never
    answers): between tries the replica keeps its prompts alive, so no other replica reclaims them (which would
    grow their delivery count towards a dead letter); the prompts are held, not lost."""
    with EmbeddedRedis(tmp_path / "redis") as server, running("reward_server", ready_path="/readyz") as (base, proc):
        client = connect(server.url)
        ours = StreamConsumer(client, "s", "g", "r0", PromptTask, claim_idle_ms=3000)
        theirs = StreamConsumer(client, "s", "g", "r1", PromptTask, claim_idle_ms=3000, create_group=False)
        StreamProducer(client, "s").publish_many([example_task(i) for i in range(2)])
        held = ours.read(count=2, block_ms=100)
        assert len(held) == 2
        s = RolloutSettings(model_dir="/nonexistent")  # type: ignore[call-arg]
        publisher = Publisher(
            s, ours, RewardClient(base, timeout_s=0.6, retries=3), RolloutMetrics(CollectorRegistry())
        )
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_later.append(proc.pid)
        out = [Completion([5, 6], "Answer: 4", [-0.1, -0.1], "stop")]
        took, err = seconds(lambda: publisher.publish(Generated(held, [[1, 2], [1, 2]], [out, out], [0, 0])))
        assert err is None and publisher.held is not None and took > 3.0, took  # tried past the claim time
        # (each gap between tries, the timeout and a backoff of at most 0.8 s + jitter, is within the claim time)
        assert theirs.read(count=2, block_ms=100) == []  # still r0's: kept alive between the tries
        pending = client.xpending_range("s", "g", "-", "+", 10)
        assert {p["consumer"] for p in pending} == {b"r0"} and {p["times_delivered"] for p in pending} == {1}


SILENT_RANK0 = """
import sys, time, torch
from services.weight_wire import make_group, store_client
group = make_group(store_client("127.0.0.1", int(sys.argv[1]), 30), 0, 2, 30, torch.device("cpu"))
time.sleep(60)  # in the group, and never sends
"""


def test_a_broadcast_whose_sender_is_silent_times_out() -> None:
    """The receiving side of a weight broadcast: rank 0 (another process) is in the group but never sends;
    rank 1 gives up at its timeout instead of waiting forever."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    rank0 = subprocess.Popen([sys.executable, "-c", SILENT_RANK0, str(store.port)], env=child_env())
    try:
        group = make_group(store, 1, 2, 30, torch.device("cpu"))
        took, err = seconds(lambda: broadcast(group, torch.zeros(10), timeout_s=1.0))
        assert isinstance(err, SyncTimeout) and took < 5, (took, err)
        group.abort()
    finally:
        rank0.kill()
        rank0.wait(30)
