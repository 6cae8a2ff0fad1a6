"""Reward: dapo_math items scored over HTTP (batch 64, 4 concurrent clients) vs in-process.

Ours: POST /v1/score to a real `python -m reward_server` (cache off, every item unique), items/s
and request latency p50/p99. Limit: `dapo_math()` called in-process on the same items, same run.
Run: `python -m bench.reward [--batches N]`.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

from bench.common import Result, print_table
from reward_server.verifiers.dapo_math import dapo_math
from services.child_process import running

BATCH, CLIENTS = 64, 4


def make_items(n: int) -> list[dict[str, str]]:
    return [
        {
            "id": str(i),
            "response": f"Let me add {i} and {i + 1} step by step: {i} + {i + 1} = {2 * i + 1}.\nAnswer: {2 * i + 1}",
            "ground_truth": str(2 * i + 1 if i % 3 else 2 * i),
            "verifier": "dapo_math",
        }
        for i in range(n)
    ]


def _client(base: str, batches: list[list[dict[str, str]]], latencies: list[float]) -> None:
    with httpx.Client(base_url=base, timeout=60) as c:
        for b in batches:
            t0 = time.perf_counter()
            r = c.post("/v1/score", json={"items": b})
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200 and len(r.json()["results"]) == len(b), r.text


def run(batches_per_client: int = 60) -> list[Result]:
    items = make_items(BATCH * CLIENTS * batches_per_client)
    t0 = time.perf_counter()
    for it in items:
        dapo_math(it["response"], it["ground_truth"])
    in_process = len(items) / (time.perf_counter() - t0)

    batches = [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
    latencies: list[float] = []
    with running("reward_server", "--cache-size", "0", "--workers", "1", "--log-level", "WARNING") as (base, _):
        _client(base, batches[:4], [])  # warm-up
        threads = [
            threading.Thread(target=_client, args=(base, batches[k::CLIENTS], latencies)) for k in range(CLIENTS)
        ]
        t0 = time.perf_counter()
        [t.start() for t in threads]
        [t.join() for t in threads]
        http = len(items) / (time.perf_counter() - t0)
    q = statistics.quantiles(latencies, n=100)
    batch_ms = BATCH / in_process * 1e3
    return [
        Result(
            "reward",
            f"dapo_math over HTTP, batch {BATCH}, {CLIENTS} clients",
            http,
            in_process,
            "items/s",
            "dapo_math() in-process, same items",
            "≥ 0.5",
        ),
        Result(
            "reward",
            f"request latency p99 (p50 {q[49] * 1e3:.1f} ms)",
            q[98] * 1e3,
            batch_ms,
            "ms",
            f"in-process time of one batch of {BATCH}",
            "p99 < 50 ms",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=60, help="batches per client")
    print_table(run(ap.parse_args().batches))


if __name__ == "__main__":
    main()
