"""Weight sync: seconds per broadcast round of a 135M-parameter model to 1 and 2 replicas.

Ours: `WeightSender.publish` (pack into buckets, checksum, gloo broadcast, receivers verify and
acknowledge) to replicas that are separate processes running the real `WeightReceiver`.
Limit: an in-process `copy_` of the same parameters into preallocated tensors (the same bytes moved
once, no network, no checksum). fp32 and bf16, same run. Goal: ours / copy ≤ 2.0.
Second reference (1 replica): a bare gloo broadcast of one flat buffer of the same bytes between two
processes, nothing else: what the transport itself costs on this machine.
Run: `python -m bench.weight_sync` (a random Llama with SmolLM2-135M's shapes: 135M parameters).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Result, print_table

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
)


def receiver(name: str, url: str, **settings: object) -> None:
    """A replica's sync side only: heartbeat + WeightReceiver, loading into nothing (`settings`: the replica's, e.g.
    model_dir and lora_max_rank for an adapter: bench/lora.py)."""
    from prometheus_client import CollectorRegistry

    from rollout.metrics import RolloutMetrics
    from rollout.settings import RolloutSettings
    from rollout.weight_receiver import WeightReceiver
    from services.schemas import ReplicaHeartbeat
    from services.streams import REPLICA_KEY_PREFIX, connect, pack

    s = RolloutSettings(replica_id=name, redis_url=url, sync_device="cpu", **settings)  # type: ignore[arg-type]
    client = connect(url)
    r = WeightReceiver(s, client, RolloutMetrics(CollectorRegistry()))
    stop = threading.Event()
    threading.Thread(target=r.run, args=(stop,), daemon=True).start()
    version = 0
    while True:
        got = r.take(lambda named, v, adapter=None: None)
        version = got.version if got else version
        hb = ReplicaHeartbeat(
            replica_id=name,
            host="127.0.0.1",
            port=1,
            weight_version=version,
            state="ready",
            sync_broadcast=True,
            incarnation=r.incarnation,
        )
        client.set(REPLICA_KEY_PREFIX + name, pack(hb), px=5000)
        time.sleep(0.05)


def start_receiver(
    name: str, url: str, env: dict[str, str], client: Any, model_dir: Path | None = None
) -> subprocess.Popen[bytes]:
    """A `receiver` process, returned once its heartbeat is in Redis (so the next publish invites it)."""
    from services.streams import REPLICA_KEY_PREFIX

    extra = [str(model_dir)] if model_dir is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "bench.weight_sync", "--receiver", name, url, *extra], env=env)
    while not client.exists(REPLICA_KEY_PREFIX + name):
        time.sleep(0.1)
    return proc


def round_seconds(sender: Any, n: int, repeats: int) -> float:
    """Median seconds of `repeats` rounds to the `n` receivers, after one that forms the group and allocates their
    buckets; every round must reach all n."""
    sender.publish(0)
    times = []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        wv = sender.publish(v)
        times.append(time.perf_counter() - t0)
        assert len(wv.replicas) == n, wv
    return statistics.median(times)


def raw_receiver(port: int, numel: int, dtype: str, rounds: int) -> None:
    from services.weight_wire import broadcast, dtype_of, make_group, store_client

    pg = make_group(store_client("127.0.0.1", port, 60), 1, 2, 60, torch.device("cpu"))
    buf = torch.empty(numel, dtype=dtype_of(dtype))
    for _ in range(rounds):
        broadcast(pg, buf, 60)
    pg.abort()


def raw_broadcast(numel: int, dtype: torch.dtype, repeats: int, env: dict[str, str]) -> float:
    """Median seconds of a bare gloo broadcast of `numel` elements to one other process."""
    from datetime import timedelta

    import torch.distributed as dist

    from services.weight_wire import broadcast, make_group

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.weight_sync",
            "--raw",
            str(store.port),
            str(numel),
            str(dtype).removeprefix("torch."),
            str(repeats + 1),
        ],
        env=env,
    )
    try:
        pg = make_group(store, 0, 2, 60, torch.device("cpu"))
        buf = torch.randn(numel).to(dtype)
        broadcast(pg, buf, 60)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            broadcast(pg, buf, 60)
            times.append(time.perf_counter() - t0)
        p.wait(60)
        pg.abort()
        return statistics.median(times)
    finally:
        p.kill()


def _model(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(dtype)  # type: ignore[arg-type]


def run(repeats: int = 5) -> list[Result]:
    from prometheus_client import CollectorRegistry

    from learner.settings import LearnerSettings
    from learner.weight_sync import WeightSender
    from services.redis_server import EmbeddedRedis
    from services.streams import REPLICA_KEY_PREFIX, connect

    results = []
    with EmbeddedRedis(Path(tempfile.mkdtemp(prefix="dapo-bench-"))) as server:
        client = connect(server.url)
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        for dtype in (torch.float32, torch.bfloat16):
            model = _model(dtype)
            params = [p.detach() for p in model.parameters()]
            mb = sum(p.numel() * p.element_size() for p in params) / 1e6
            dst = [torch.empty_like(p) for p in params]
            copies = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for d, p in zip(dst, params, strict=True):
                    d.copy_(p)
                copies.append(time.perf_counter() - t0)
            copy_s = statistics.median(copies)
            s = LearnerSettings(sync_port=0, sync_timeout_s=120)
            sender = WeightSender(s, client, model, CollectorRegistry())
            procs: list[subprocess.Popen[bytes]] = []
            try:
                for n in (1, 2):
                    procs.append(start_receiver(f"bench-{n}", server.url, env, client))
                    seconds = round_seconds(sender, n, repeats)
                    what = f"{str(dtype).removeprefix('torch.')} {mb:.0f} MB → {n} replica{'s' * (n > 1)}"
                    results.append(
                        Result(
                            "weight_sync",
                            what,
                            seconds,
                            copy_s,
                            "s/sync",
                            "in-process copy_ of the same bytes",
                            "≤ 2.0",
                        )
                    )
                    if n == 1:
                        numel = sum(p.numel() for p in params)
                        raw = raw_broadcast(numel, dtype, repeats, env)
                        results.append(
                            Result("weight_sync", what, seconds, raw, "s/sync", "bare gloo broadcast, same bytes")
                        )
            finally:
                sender.close()
                for p in procs:
                    p.kill()
                    p.wait()
                client.delete(*[REPLICA_KEY_PREFIX + f"bench-{n}" for n in (1, 2)])
    return results


def fanout(counts: tuple[int, ...] = (1, 2, 4, 8, 16), repeats: int = 3) -> list[Result]:
    """Seconds per round of the same bytes (the bf16 135M model, 269 MB) to 1, 2, 4, ... receivers, each a process
    running the real WeightReceiver; the limit is the round to one receiver (the ratio is the fan-out's growth)."""
    from prometheus_client import CollectorRegistry

    from learner.settings import LearnerSettings
    from learner.weight_sync import WeightSender
    from services.redis_server import EmbeddedRedis
    from services.streams import connect

    rows: list[tuple[int, float]] = []
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    model = _model(torch.bfloat16)
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    model_dir = Path(tempfile.mkdtemp(prefix="dapo-bench-model-"))
    model.save_pretrained(model_dir)  # the receivers check the manifest against these shapes
    with EmbeddedRedis(Path(tempfile.mkdtemp(prefix="dapo-bench-"))) as server:
        client = connect(server.url)
        sender = WeightSender(LearnerSettings(sync_port=0, sync_timeout_s=300), client, model, CollectorRegistry())
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for n in counts:
                while len(procs) < n:
                    procs.append(start_receiver(f"fanout-{len(procs)}", server.url, env, client, model_dir))
                rows.append((n, round_seconds(sender, n, repeats)))
        finally:
            sender.close()
            for p in procs:
                p.kill()
                p.wait()
    one = rows[0][1]
    return [
        Result("weight_sync", f"bf16 {mb:.0f} MB → {n} receivers", t, one, "s/sync", "the same round to 1")
        for n, t in rows
    ]


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--fanout":
        print_table(fanout())
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "--receiver":
        receiver(sys.argv[2], sys.argv[3], **({"model_dir": Path(sys.argv[4])} if len(sys.argv) == 5 else {}))
    elif len(sys.argv) == 6 and sys.argv[1] == "--raw":
        raw_receiver(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        print_table(run())
