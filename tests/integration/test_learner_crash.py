"""The learner as a process fed by Redis: SIGKILL after a checkpoint, restart, every batch exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from learner.tiny import tiny_batch
from services.child_process import ROOT, child_env
from services.ledger import read_ledger
from services.redis_server import EmbeddedRedis, free_port
from services.schemas import DroppedGroup, LedgerEntry, TrainBatch
from services.streams import (
    KEY_BATCH_ID,
    KEY_POLICY_VERSION,
    STREAM_BATCHES,
    STREAM_DROPPED,
    StreamProducer,
    connect,
    decode,
)


def start_learner(model: Path, run_dir: Path, url: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
    args = ["--model-dir", str(model), "--run-dir", str(run_dir), "--redis-url", url, "--port", str(port),
            "--checkpoint-every", "3", "--minibatches", "2", "--micro-batch-size", "4", "--lr", "1e-3",
            "--warmup-batches", "0", "--sync-port", "0", *extra]  # fmt: skip
    env = child_env(OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "learner", *args], env=env, cwd=ROOT)


def wait_for(predicate, timeout_s: float = 240, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def ledger(run_dir: Path) -> list[LedgerEntry]:
    return read_ledger(run_dir)


def state(run_dir: Path) -> dict:
    path = run_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigkill_after_checkpoint_then_restart_trains_each_batch_once(
    tiny_model: Path, tmp_path: Path, lora: bool
) -> None:
    """LoRA (issue 31): the checkpoint holds the adapter and its optimizer state only; the resume is the same."""
    model = tiny_model
    run_dir = tmp_path / "run"
    extra = ("--lora-rank", "4") if lora else ()
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url)
        producer = StreamProducer(client, STREAM_BATCHES)
        producer.publish_many(tiny_batch(i) for i in range(5))

        port = free_port()
        first = start_learner(model, run_dir, server.url, port, *extra)
        try:
            wait_for(lambda: int(client.get(KEY_POLICY_VERSION) or 0) == 5, what="five batches trained")
            wait_for(lambda: state(run_dir).get("version") == 3, what="the checkpoint after batch 2")
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert "dapo_learner_policy_version 5.0" in metrics and "dapo_learner_batches_trained_total 5.0" in metrics
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(30)
        assert [e.batch_id for e in ledger(run_dir)] == [0, 1, 2, 3, 4]
        assert client.xpending(STREAM_BATCHES, "learner")["pending"] == 2  # 3 and 4: trained, never checkpointed

        producer.publish(tiny_batch(5))
        second = start_learner(model, run_dir, server.url, free_port(), "--max-batches", "6", *extra)
        assert second.wait(300) == 0
        second_pid = second.pid

        entries = ledger(run_dir)
        assert [e.batch_id for e in entries if e.pid == second_pid] == [3, 4, 5]  # exactly the missing ones
        assert all(len(e.task_ids) == 2 for e in entries)  # each line names the groups it trained
        final = state(run_dir)
        assert final["trained"] == [0, 1, 2, 3, 4, 5] and final["version"] == 6  # each batch once in the weights
        assert int(client.get(KEY_POLICY_VERSION)) == 6
        assert client.xpending(STREAM_BATCHES, "learner")["pending"] == 0
        assert (run_dir / "hf" / "latest").read_text() == "v000006"

    from transformers import AutoModelForCausalLM

    exported = run_dir / "hf" / "v000006"
    if lora:  # the adapter, and a checkpoint without the frozen base
        from services.adapters import read_adapter

        assert read_adapter(exported)[0].rank == 4
        base_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        ckpt = max((run_dir / "checkpoints").iterdir(), key=lambda p: p.name)
        assert sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) < base_bytes
        return
    assert AutoModelForCausalLM.from_pretrained(exported).config.vocab_size == 256  # loadable by transformers


@pytest.mark.slow
def test_a_batch_id_handed_out_again_is_trained_and_a_copy_is_not(tiny_model: Path, tmp_path: Path) -> None:
    """A Redis restored from an older append-only file hands batch ids out again: the learner, deduplicating by
    id, skipped the new batches silently. It tells batches apart by content now: a new batch under an old id is
    trained, a copy of a trained batch (a redelivery, a retried XADD) is not."""
    model = tiny_model
    run_dir = tmp_path / "run"
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url)
        producer = StreamProducer(client, STREAM_BATCHES)
        first = tiny_batch(0)
        producer.publish(first)
        again = tiny_batch(0)  # the same id, other groups: what a rolled-back counter produces
        assert again.batch_id == first.batch_id and again.digest() != first.digest()
        producer.publish(again)
        producer.publish(first)  # an exact copy of the first
        third = tiny_batch(1)
        producer.publish(third)
        client.set(KEY_BATCH_ID, 0)  # the buffer's counter, as a Redis that lost its writes has it
        proc = start_learner(model, run_dir, server.url, free_port(), "--max-batches", "3")
        assert proc.wait(300) == 0
        assert int(client.get(KEY_BATCH_ID)) == 2  # raised past every id the checkpoint holds
        entries = ledger(run_dir)
        expected = [(0, first.digest()), (0, again.digest()), (1, third.digest())]
        assert [(e.batch_id, e.digest) for e in entries] == expected
        final = state(run_dir)
        assert final["trained"] == [0, 0, 1] and final["version"] == 3
        assert final["digests"] == [e.digest for e in entries]
        assert client.xpending(STREAM_BATCHES, "learner")["pending"] == 0  # the copy was acknowledged, not trained


@pytest.mark.slow
def test_groups_too_stale_at_the_update_never_reach_it(tiny_model: Path, tmp_path: Path) -> None:
    """The buffer bounds staleness when it batches; the learner's version moves on while batches wait. With
    --max-staleness 1 the learner checks again at the update: a batch whose groups are all 2 versions behind is
    dropped whole (recorded, acknowledged, never trained), a mixed one is trained without its stale group."""
    from learner.tiny import group

    model = tiny_model
    run_dir = tmp_path / "run"
    rewards = [1.0, -1.0, 1.0, -1.0]
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url)
        fresh = group(301, rewards, version=2)
        mixed = TrainBatch.assemble(3, [group(300, rewards, version=0), fresh])
        StreamProducer(client, STREAM_BATCHES).publish_many([tiny_batch(0), tiny_batch(1), tiny_batch(2), mixed])
        # versions at the update: 0, 1, 2 (batch 2's samples are version 0: lag 2, dropped), 2 (mixed)
        proc = start_learner(model, run_dir, server.url, free_port(), "--max-staleness", "1", "--max-batches", "3")
        assert proc.wait(300) == 0
        entries = ledger(run_dir)
        assert [e.batch_id for e in entries] == [0, 1, 3]
        assert entries[2].task_ids == [fresh.group_id] and entries[2].lag == 0  # the stale group is not in it
        dropped = [decode(f, DroppedGroup) for _, f in client.xrange(STREAM_DROPPED)]
        stale_ids = {g.group_id for g in tiny_batch_groups(client, 2)} | {mixed.groups[0].group_id}
        assert {d.task_id for d in dropped} == stale_ids and {d.reason for d in dropped} == {"stale_at_update"}
        assert all(d.at_version - d.min_version == 2 for d in dropped)
        assert state(run_dir)["trained"] == [0, 1, 3]
        assert client.xpending(STREAM_BATCHES, "learner")["pending"] == 0


def tiny_batch_groups(client, batch_id: int):  # type: ignore[no-untyped-def]
    """The groups of a published batch, read back from the stream."""
    for _, f in client.xrange(STREAM_BATCHES):
        b = decode(f, TrainBatch)
        if b.batch_id == batch_id:
            return b.groups
    raise AssertionError(f"no batch {batch_id}")
