"""Data-parallel learner ranks (learner/parallel.py): N ranks take the step one rank takes.

Real DeepSpeed on CPU (gloo), real torchrun: the same recorded batches replayed with 1 and with 2 ranks give the
same weights within 1e-5 (fp32) at ZeRO 0, 1, 2 and 3. The batches are ragged (prompt and response lengths differ
by group), so the ranks' shares of a mini-batch differ in rows and in tokens, and one batch makes a rank run a
zero-weighted micro-batch: a rank normalising by its own tokens, not the mini-batch's (the count every rank has,
since each holds the whole batch), moves the weights ~1e-2 away (checked), and a missing x world size halves
every update."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from learner.record import load_batch, record_batch, record_settings, recorded
from learner.settings import LearnerSettings
from learner.tiny import group, tiny_llama
from services.child_process import ROOT, child_env
from services.redis_server import EmbeddedRedis, free_port
from services.schemas import ReplicaHeartbeat, TrainBatch, WeightVersion
from services.streams import REPLICA_KEY_PREFIX, STREAM_BATCHES, StreamProducer, connect, unpack
from services.weight_wire import KEY_WEIGHTS, Buckets, Manifest, checksum, total


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ranks")
    model = tiny_llama(root / "model", tokenizer=True)  # the replica needs one
    s = LearnerSettings(model_dir=model, run_dir=root / "run", minibatches=2, micro_batch_size=1, micro_batch_tokens=0,
                        lr=1e-3, warmup_batches=0, dtype="fp32", seed=3, off_policy="token-tis")  # fmt: skip
    record_settings(root / "run", s)
    # 4 groups x 4 samples, ragged; the last batch has 19 samples: one micro-batch per row, so its odd row counts
    # (19 in the proximal pass, 9 in a mini-batch) leave one rank a zero-weighted call forward and backward
    for b in range(3):
        n = [4, 4, 4, 4] if b < 2 else [6, 6, 7]
        rewards = [[1.0, -1.0, 1.0, -0.5, 0.5, -0.25, 1.0][:k] for k in n]
        groups = [group(b * 10 + i, r, prompt_len=3 + 2 * i, resp_len=4 + 5 * i) for i, r in enumerate(rewards)]
        record_batch(root / "run", b, TrainBatch.assemble(b, groups))
    return model, root / "run"


@pytest.fixture(scope="module")
def recorded_lora_run(recorded_run: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same batches, recorded as a LoRA learner's (rank 4): a replay trains an adapter."""
    model, run = recorded_run
    lora = tmp_path_factory.mktemp("ranks-lora") / "run"
    shutil.copytree(run, lora)
    s = LearnerSettings(model_dir=model, run_dir=lora, minibatches=2, micro_batch_size=1, micro_batch_tokens=0,
                        lr=1e-2, warmup_batches=0, dtype="fp32", seed=3, off_policy="token-tis",
                        lora_rank=4)  # fmt: skip
    record_settings(lora, s)
    return lora


def replay(model: Path, run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mesh", "replay", "--batches", str(run), "--model-dir", str(model),
           "--out", str(out), *extra]  # fmt: skip
    return subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "hf" / "v000003" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["0", "1", "2", "3"])
def test_two_ranks_take_the_step_of_one(recorded_run: tuple[Path, Path], tmp_path: Path, zero: str) -> None:
    model, run = recorded_run
    one = replay(model, run, tmp_path / "one", "--zero-stage", zero)
    two = replay(model, run, tmp_path / "two", "--zero-stage", zero, "--nproc", "2")
    assert one.returncode == 0, one.stdout + one.stderr
    assert two.returncode == 0, two.stdout + two.stderr
    assert "2 ranks" in two.stdout
    losses = [line.split("loss ")[1].split(",")[0] for line in one.stdout.splitlines() if "loss" in line]
    assert len(losses) == 3 and losses == [ln.split("loss ")[1].split(",")[0] for ln in two.stdout.splitlines()
                                           if "loss" in ln]  # fmt: skip  # the loss metric is the whole batch's
    a, b, base = weights(tmp_path / "one"), weights(tmp_path / "two"), load_file(model / "model.safetensors")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert max(float((a[k] - base[k]).abs().max()) for k in base) > 1e-3  # the updates moved the weights


@pytest.mark.slow
def test_two_ranks_train_the_adapter_one_rank_trains(recorded_run: tuple[Path, Path], recorded_lora_run: Path,
                                                     tmp_path: Path) -> None:  # fmt: skip
    """LoRA (issue 31) at ZeRO-2: parity as for full weights, on the adapter's tensors (all the replay exports)."""
    model, _ = recorded_run
    one = replay(model, recorded_lora_run, tmp_path / "one", "--zero-stage", "2")
    two = replay(model, recorded_lora_run, tmp_path / "two", "--zero-stage", "2", "--nproc", "2")
    assert one.returncode == 0, one.stdout + one.stderr
    assert two.returncode == 0, two.stdout + two.stderr
    a = load_file(tmp_path / "one" / "hf" / "v000003" / "adapter_model.safetensors")
    b = load_file(tmp_path / "two" / "hf" / "v000003" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(".lora_" in k for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert max(float(a[k].abs().max()) for k in a if ".lora_B." in k) > 1e-3  # B started at 0: the updates moved it


def test_more_ranks_than_samples_per_minibatch_is_a_clear_error(recorded_run: tuple[Path, Path],
                                                                tmp_path: Path) -> None:  # fmt: skip
    model, run = recorded_run
    done = replay(model, run, tmp_path / "out", "--nproc", "9")
    assert done.returncode == 2, done.stdout + done.stderr
    text = " ".join((done.stdout + done.stderr).split())
    assert "9 learner ranks but 8 samples per mini-batch" in text and "minibatches" in text
    assert not (tmp_path / "out").exists()  # refused before any rank started


def start_replica(model: Path, url: str) -> subprocess.Popen[bytes]:
    args = ["--engine", "hf", "--dtype", "fp32", "--model-dir", str(model), "--redis-url", url, "--port",
            str(free_port()), "--reward-url", "http://127.0.0.1:9", "--replica-id", "r", "--sync-broadcast",
            "--heartbeat-ttl-s", "3"]  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "rollout", *args], env=child_env(OMP_NUM_THREADS="1"), cwd=ROOT)


def wait_ready(client: redis.Redis, replica: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while (raw := client.get(REPLICA_KEY_PREFIX + "r")) is None or unpack(raw, ReplicaHeartbeat).state != "ready":
        assert time.monotonic() < deadline and replica.poll() is None, "the replica did not start"
        time.sleep(0.2)


def learner_args(model: Path, run_dir: Path, url: str) -> list[str]:
    """The recorded run's update settings (recorded_run), a learner fed by Redis, sending weights to replicas."""
    return ["--model-dir", str(model), "--run-dir", str(run_dir), "--redis-url", url, "--port", str(free_port()),
            "--minibatches", "2", "--micro-batch-size", "1", "--micro-batch-tokens", "0", "--lr", "1e-3",
            "--warmup-batches", "0", "--dtype", "fp32", "--seed", "3", "--off-policy", "token-tis", "--sync-port",
            "0"]  # fmt: skip


def snapshot_checksum(folder: Path, bucket_mb: float) -> int:
    """The weight-sync checksum of an HF snapshot, packed as the learner packs its parameters (independent of it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    named = dict(model.named_parameters())
    manifest = Manifest.plan([(n, p.dtype, tuple(p.shape)) for n, p in named.items()], int(bucket_mb * 2**20))
    b = Buckets(manifest)
    with torch.no_grad():
        for name, view in b.named():
            view.copy_(named[name])
    return total([checksum(buf) for buf in b.buffers])


@pytest.mark.slow
def test_a_two_rank_zero3_learner_sends_its_gathered_weights_to_a_replica(recorded_run: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """Rank 0 sends; under ZeRO-3 it holds a shard only, so every bucket is gathered with rank 1 taking part (a
    rank that did not join would hang the gather: the learner would time out). The replica serves what a separate
    gather, the HF snapshot, holds: the same checksum."""
    model, run = recorded_run
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url)
        StreamProducer(client, STREAM_BATCHES).publish_many(load_batch(p) for _, p in recorded(run / "batches"))
        replica = start_replica(model, server.url)
        try:
            wait_ready(client, replica)
            args = [*learner_args(model, tmp_path / "learner", server.url), "--zero-stage", "3", "--sync-bucket-mb",
                    "0.05", "--max-batches", "3", "--ranks", "2"]  # fmt: skip
            done = subprocess.run([sys.executable, "-m", "learner", *args], env=child_env(OMP_NUM_THREADS="1"),
                                  cwd=ROOT, timeout=300, capture_output=True, text=True)  # fmt: skip
            assert done.returncode == 0, done.stderr[-4000:]
            wv = unpack(client.get(KEY_WEIGHTS), WeightVersion)
            # the replica acknowledged version 3 once verified; it loads it at its next step, then says so
            deadline = time.monotonic() + 60
            while (hb := unpack(client.get(REPLICA_KEY_PREFIX + "r"), ReplicaHeartbeat)).weight_version < 3:
                assert time.monotonic() < deadline, f"the replica still serves version {hb.weight_version}"
                time.sleep(0.2)
        finally:
            replica.terminate()
            replica.wait(60)
    assert "rank 1 of 2: following rank 0" in done.stderr
    assert (wv.version, wv.replicas) == (3, ["r"])
    assert (hb.weight_version, hb.weight_checksum) == (3, wv.checksum)  # the replica verified and serves version 3
    assert wv.checksum == snapshot_checksum(tmp_path / "learner" / "hf" / "v000003", 0.05)
    assert wv.checksum != snapshot_checksum(model, 0.05)  # the weights moved


@pytest.fixture
def two_nodes() -> Iterator[tuple[str, str, str]]:
    """A second "node": a network namespace joined to this one by a veth pair, nothing else reachable from it.
    Yields (namespace, this side's interface and address, the namespace's interface)."""
    if (os.geteuid() != 0 or shutil.which("ip") is None) and not os.environ.get("DAPO_REQUIRE_TOOLS"):
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"dapo-n1-{tag}", f"dv0-{tag}", f"dv1-{tag}"
    cmds = [["ip", "netns", "add", ns], ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
            ["ip", "link", "set", there, "netns", ns], ["ip", "addr", "add", f"{NODE0}/30", "dev", here],
            ["ip", "-n", ns, "addr", "add", f"{NODE1}/30", "dev", there], ["ip", "link", "set", here, "up"],
            ["ip", "-n", ns, "link", "set", there, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]  # fmt: skip
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        yield ns, here, there
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


NODE0, NODE1 = "10.231.77.1", "10.231.77.2"


@pytest.mark.slow
def test_two_nodes_over_a_veth_link_train_as_one_and_send_the_weights(recorded_run: tuple[Path, Path],
                                                                      two_nodes: tuple[str, str, str],
                                                                      tmp_path: Path) -> None:  # fmt: skip
    """`--nnodes 2`: node 0 here (Redis, a replica), node 1 in its own network namespace, which reaches only node 0
    over the veth link: the rendezvous and every collective go over it. The two-node learner's weights equal one
    rank's replay within 1e-5, and the replica serves them."""
    model, run = recorded_run
    ns, here, there = two_nodes
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url)
        StreamProducer(client, STREAM_BATCHES).publish_many(load_batch(p) for _, p in recorded(run / "batches"))
        replica = start_replica(model, server.url)
        nodes: list[subprocess.Popen[bytes]] = []
        try:
            wait_ready(client, replica)
            args = [*learner_args(model, tmp_path / "learner", server.url), "--max-batches", "3",
                    "--sync-bucket-mb", "0.5"]  # fmt: skip
            port = str(free_port())

            def node(rank: int, ifname: str, *netns: str) -> subprocess.Popen[bytes]:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                       f"--node-rank={rank}", "--rdzv-backend=static", f"--master-addr={NODE0}",
                       f"--master-port={port}", "-m", "learner", *args]  # fmt: skip
                env = child_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=ifname)  # gloo on the link, not the hostname
                return subprocess.Popen([*netns, *cmd], env=env, cwd=ROOT)

            nodes += [node(0, here), node(1, there, "ip", "netns", "exec", ns)]
            assert [p.wait(300) for p in nodes] == [0, 0]
            wv = unpack(client.get(KEY_WEIGHTS), WeightVersion)
            # the learner publishes a version once the replicas hold it (received, verified); a replica loads it at its
            # loop's next step and says so in its heartbeat then: wait for that, do not race it
            deadline = time.monotonic() + 60
            while (hb := unpack(client.get(REPLICA_KEY_PREFIX + "r"), ReplicaHeartbeat)).weight_version < wv.version:
                assert time.monotonic() < deadline, f"the replica still serves version {hb.weight_version}"
                time.sleep(0.2)
        finally:
            for p in [replica, *nodes]:
                if p.poll() is None:
                    p.terminate()
                    p.wait(60)
    one = replay(model, run, tmp_path / "one")
    assert one.returncode == 0, one.stdout + one.stderr
    a, b = weights(tmp_path / "one"), weights(tmp_path / "learner")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert (wv.version, wv.replicas) == (3, ["r"]) and (hb.weight_version, hb.weight_checksum) == (3, wv.checksum)
    assert wv.checksum == snapshot_checksum(tmp_path / "learner" / "hf" / "v000003", 0.5)
