"""Recorded batches and `dapo-mesh replay`: a run's updates trained again offline give the run's weights."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.record import load_batch
from learner.tiny import tiny_batch
from services.child_process import ROOT, child_env
from services.ledger import read_ledger
from services.redis_server import EmbeddedRedis, free_port
from services.streams import STREAM_BATCHES, StreamProducer, connect


def learner(model: Path, run_dir: Path, url: str, *extra: str) -> subprocess.Popen[bytes]:
    args = ["--model-dir", str(model), "--run-dir", str(run_dir), "--redis-url", url, "--port", str(free_port()),
            "--checkpoint-every", "1", "--minibatches", "3", "--micro-batch-size", "2", "--micro-batch-tokens", "0",
            "--lr", "1e-3", "--warmup-batches", "2", "--dtype", "fp32", "--seed", "7", "--sync-port", "0",
            "--weight-sync", "none", "--record-batches", *extra]  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "learner", *args], env=child_env(OMP_NUM_THREADS="1"), cwd=ROOT)


def state_version(run_dir: Path) -> int:
    path = run_dir / "state.json"
    return int(json.loads(path.read_text())["version"]) if path.exists() else 0


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh", "replay", *args], env=child_env(OMP_NUM_THREADS="1"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
def test_a_replay_of_a_killed_and_resumed_run_gives_its_weights_bit_for_bit(tiny_model: Path, tmp_path: Path) -> None:
    """The learner records each batch as it trains it; SIGKILL after two checkpointed batches, a restart trains the
    other two. Replaying the four records from the base model gives the run's final weights exactly: the LR
    schedule and the mini-batch shuffle are functions of the version, not of the process (a shuffle drawn from a
    generator seeded at start would restart its sequence with the learner, and this test fails)."""
    model = tiny_model
    run_dir = tmp_path / "run"
    with EmbeddedRedis(tmp_path / "redis") as server:
        producer = StreamProducer(connect(server.url), STREAM_BATCHES)
        producer.publish_many(tiny_batch(i) for i in range(2))
        first = learner(model, run_dir, server.url)
        try:
            deadline = time.monotonic() + 240
            while state_version(run_dir) < 2:
                assert time.monotonic() < deadline and first.poll() is None, "two batches checkpointed"
                time.sleep(0.1)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(30)
        producer.publish_many(tiny_batch(i) for i in range(2, 4))
        second = learner(model, run_dir, server.url, "--max-batches", "4")
        assert second.wait(300) == 0

    records = sorted((run_dir / "batches").glob("*.msgpack"))
    assert [r.name for r in records] == [f"{v:06d}.msgpack" for v in range(4)]
    assert [load_batch(r).digest() for r in records] == [e.digest for e in read_ledger(run_dir)]
    recorded = json.loads((run_dir / "batches" / "settings.json").read_text())
    assert (recorded["seed"], recorded["minibatches"], recorded["lr"], recorded["dtype"]) == (7, 3, 1e-3, "fp32")
    assert not {"model_dir", "run_dir", "redis_url", "auth_token", "sync_secret", "port"} & recorded.keys()

    done = replay("--batches", str(run_dir), "--model-dir", str(model), "--out", str(tmp_path / "replay"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "version 3 -> 4: loss" in done.stdout and "(in the run: " in done.stdout
    final, replayed = weights(run_dir / "hf" / "v000004"), weights(tmp_path / "replay" / "hf" / "v000004")
    base = weights(model)
    assert final.keys() == replayed.keys()
    assert all(torch.equal(final[k], replayed[k]) for k in final), "the replay's weights differ from the run's"
    assert any(not torch.equal(final[k], base[k]) for k in final)  # four updates happened

    # bisect: the first two batches alone give the run's version-2 weights
    half = replay("--batches", str(run_dir), "--model-dir", str(model), "--out", str(tmp_path / "half"),
                  "--until", "2")  # fmt: skip
    assert half.returncode == 0, half.stdout + half.stderr
    v2 = weights(tmp_path / "half" / "hf" / "v000002")
    assert all(torch.equal(weights(run_dir / "hf" / "v000002")[k], v2[k]) for k in v2)


def test_replay_without_records_is_a_clear_error(tmp_path: Path) -> None:
    done = replay("--batches", str(tmp_path), "--model-dir", str(tmp_path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "--record-batches" in done.stdout + done.stderr
