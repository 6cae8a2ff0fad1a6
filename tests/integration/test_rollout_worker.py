"""Rollout replicas as processes, against real Redis and a real reward server (HF engine, tiny model)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from services.child_process import ROOT, child_env
from services.redis_server import EmbeddedRedis, free_port
from services.schemas import PromptTask, ReplicaHeartbeat, ScoredGroup
from services.streams import (
    DEAD_LETTER_STREAM,
    REPLICA_KEY_PREFIX,
    STREAM_PROMPTS,
    STREAM_ROLLOUTS,
    StreamProducer,
    connect,
    decode,
    ensure_group,
    unpack,
)


def tasks(n: int, g: int = 3) -> list[PromptTask]:
    # dapo_math with ground truth "[INVALID]": a response without an Answer: line scores +1, otherwise -1
    return [PromptTask(task_id=f"t{i}", prompt_id=f"p{i}", prompt=f"Say something about {i}.",
                       ground_truth="[INVALID]", verifier="dapo_math", data_source="test", n_samples=g)
            for i in range(n)]  # fmt: skip


def start(
    model_dir: Path, url: str, reward: str, name: str, *extra: str, engine: str = "hf"
) -> subprocess.Popen[bytes]:
    args = ["--engine", engine, "--model-dir", str(model_dir), "--redis-url", url, "--reward-url", reward,
            "--port", str(free_port()), "--replica-id", name, "--max-response-tokens", "16",
            "--prompts-per-call", "2", *extra]  # fmt: skip
    env = child_env(OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "rollout", *args], env=env, cwd=ROOT)


def groups(client: redis.Redis) -> list[ScoredGroup]:
    return [decode(f, ScoredGroup) for _, f in client.xrange(STREAM_ROLLOUTS)]


def wait_groups(client: redis.Redis, n: int, timeout_s: float = 180) -> list[ScoredGroup]:
    deadline = time.monotonic() + timeout_s
    while len(got := groups(client)) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} groups after {timeout_s} s"
        time.sleep(0.2)
    return got


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(60)


VLLM = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.parametrize(
    "engine", ["hf", pytest.param("vllm", marks=VLLM), pytest.param("vllm --no-stream", marks=VLLM)]
)  # vllm: continuous batching; --no-stream: the chunked loop
def test_prompts_in_scored_groups_out(model_dir: Path, reward_url: str, server: EmbeddedRedis, engine: str) -> None:
    client = connect(server.url)
    StreamProducer(client, STREAM_PROMPTS).publish_many(tasks(4))
    kind, *extra = engine.split()
    proc = start(model_dir, server.url, reward_url, "r0", "--temperature", "0.9", *extra, engine=kind)
    try:
        got = wait_groups(client, 4)
        hb = unpack(client.get(REPLICA_KEY_PREFIX + "r0"), ReplicaHeartbeat)
        assert hb.replica_id == "r0" and hb.state == "ready" and hb.weight_version == 0
        assert client.pttl(REPLICA_KEY_PREFIX + "r0") > 0
    finally:
        stop(proc)
    assert sorted(g.task.task_id for g in got) == ["t0", "t1", "t2", "t3"]
    for g in got:
        assert len(g.samples) == 3 and g.replica_id == "r0"
        assert all(s.policy_version == 0 and len(s.logprobs) == len(s.response_token_ids) for s in g.samples)
        assert all((s.temperature, s.top_p) == (0.9, 1.0) for s in g.samples)  # how they were sampled travels along
        for s in g.samples:  # continuous batching says which version sampled each token; the others need not
            assert s.version_runs == ([(0, len(s.response_token_ids))] if engine == "vllm" else None)
        assert g.task.prompt_token_ids is not None  # the exact tokens the learner must train on
        for s, sc in zip(g.samples, g.scores, strict=True):
            assert sc.acc == ("answer" not in s.response_text[-300:].lower())  # the reward server's verdict
            assert sc.reward == (1.0 if sc.acc else -1.0) + sc.overlong_penalty
            # L_max 16 (sent per item): the reward server's buffer share (4096 of 20480, 20%) gives L_cache 3,
            # so no penalty up to 13 tokens, then (13 - L) / 3 down to -1 at 16
            n = len(s.response_token_ids)
            assert sc.overlong_penalty == pytest.approx(0.0 if n <= 13 else (13 - n) / 3)
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 0
    assert client.get(REPLICA_KEY_PREFIX + "r0") is None  # a clean stop removes the heartbeat


N = 24


def frozen_pending(client: redis.Redis, proc: subprocess.Popen[bytes], consumer: str) -> list[dict[str, object]]:
    """Stop the process (SIGSTOP), let what it had already sent reach Redis, then read the entries it holds: a
    reading taken while it runs can be stale by the time a signal lands (it may finish and acknowledge them)."""
    proc.send_signal(signal.SIGSTOP)
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.005)
    time.sleep(0.2)  # a command written just before the stop is executed by Redis by now
    return client.xpending_range(STREAM_PROMPTS, "rollout", "-", "+", 100, consumername=consumer)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_two_replicas_share_and_a_killed_one_loses_nothing(model_dir: Path, reward_url: str,
                                                           server: EmbeddedRedis) -> None:  # fmt: skip
    client = connect(server.url)
    ensure_group(client, STREAM_PROMPTS, "rollout")
    a = start(model_dir, server.url, reward_url, "a", "--claim-idle-ms", "3000")
    b = start(model_dir, server.url, reward_url, "b", "--claim-idle-ms", "3000")
    try:
        deadline = time.monotonic() + 180
        while not (client.exists(REPLICA_KEY_PREFIX + "a") and client.exists(REPLICA_KEY_PREFIX + "b")):
            assert time.monotonic() < deadline, "the replicas did not start"
            time.sleep(0.1)  # both ready before any prompt exists: they will share the work
        StreamProducer(client, STREAM_PROMPTS).publish_many(tasks(N))
        while True:  # both replicas have published work, and "a" is holding prompts when it dies
            if {g.replica_id for g in groups(client)} == {"a", "b"}:
                held = frozen_pending(client, a, "a")  # what it holds now cannot change: it is stopped
                if held:
                    break
                a.send_signal(signal.SIGCONT)  # it was between two calls, holding nothing: let it read more
            assert time.monotonic() < deadline, "the replicas did not both take work"
            time.sleep(0.02)
        a.send_signal(signal.SIGKILL)  # mid-batch: it holds prompts it has not finished
        a.wait(30)
        got = wait_groups(client, N)
    finally:
        stop(b)
    ids = [g.task.task_id for g in got]
    assert sorted(ids) == sorted(f"t{i}" for i in range(N))  # none lost, none twice
    held_ids = {e["message_id"] for e in held}
    held_tasks = {decode(f, PromptTask).task_id for i, f in client.xrange(STREAM_PROMPTS) if i in held_ids}
    by_task = {g.task.task_id: g.replica_id for g in got}
    assert held_tasks and all(by_task[t] == "b" for t in held_tasks), by_task  # the dead replica's prompts: "b"
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine",
    ["hf", pytest.param("vllm", marks=pytest.mark.vllm)],
)  # fmt: skip
def test_a_reward_outage_holds_the_prompts_and_dead_letters_none(model_dir: Path, server: EmbeddedRedis,
                                                                 engine: str) -> None:  # fmt: skip
    """A reward server down for longer than the retries used to leave the prompts to be reclaimed; after 5
    deliveries they went to the dead-letter stream. Now the replica holds them (delivered once, never reclaimed)
    and scores them again with backoff until the server is back."""
    client = connect(server.url)
    port = free_port()
    ensure_group(client, STREAM_PROMPTS, "rollout")
    StreamProducer(client, STREAM_PROMPTS).publish_many(tasks(2))
    proc = start(
        model_dir,
        server.url,
        f"http://127.0.0.1:{port}",
        "r0",
        "--reward-retries",
        "0",
        "--claim-idle-ms",
        "300",
        engine=engine,
    )  # fmt: skip  (vllm: continuous batching)
    reward = None
    try:
        deadline = time.monotonic() + 180
        while len(client.xpending_range(STREAM_PROMPTS, "rollout", "-", "+", 10)) < 2:
            assert time.monotonic() < deadline, "the replica took no prompt"
            time.sleep(0.1)
        time.sleep(8)  # > 25 claim times, several scoring attempts
        pending = client.xpending_range(STREAM_PROMPTS, "rollout", "-", "+", 10)
        assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"r0", 1)] * 2
        assert client.xlen(DEAD_LETTER_STREAM) == 0 and groups(client) == []
        reward = subprocess.Popen([sys.executable, "-m", "reward_server", "--port", str(port), "--workers", "1"],
                                  env=child_env(), cwd=ROOT)  # fmt: skip
        got = wait_groups(client, 2, timeout_s=120)  # the next attempt finds it (backoff at most 30 s)
    finally:
        stop(proc, *([reward] if reward else []))
    assert sorted(g.task.task_id for g in got) == ["t0", "t1"]
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 0 and client.xlen(DEAD_LETTER_STREAM) == 0
