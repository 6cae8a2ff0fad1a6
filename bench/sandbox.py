"""Sandbox: a trivial program run through the sandbox service vs a bare `subprocess.run` of the same program.

Ours: POST /v1/run to a real `python -m sandbox` (1 worker and 1 client, then 2 and 2), runs/s and latency p50/p99;
and the sandbox without HTTP (`Jail.run` from as many threads) to tell the isolation's cost from the service's.
Limit: the same interpreter running the same main.py with `subprocess.run` from as many threads, same run, the
three interleaved. Then a batch: one POST /v1/batch of 64 inputs vs 64 bare runs.
Run: `python -m bench.sandbox [--runs N]`.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import Result, best_rates, print_table
from sandbox.jail import Jail, Limits, find_bwrap, find_python
from services.child_process import running

SOURCE = "print(sum(map(int, input().split())))"
LIMITS = Limits(wall_s=10, cpu_s=10, memory_mb=512, processes=32, open_files=64, file_size_mb=16, output_bytes=1 << 20)


def _parallel(threads: int, n: int, one: Callable[[int], None]) -> int:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    return n


def _rows(workers: int, runs: int, python: str, tmp: str) -> list[Result]:
    """`workers` sandbox workers and as many clients; the bare runs from as many threads."""
    jail = Jail(find_bwrap(None), python, 60100, 64)  # uids apart from the service's
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(workers):
        slots.put(slot)
    latencies: list[float] = []

    def bare(i: int) -> None:
        p = subprocess.run([python, "-E", "-s", "main.py"], cwd=tmp, input=f"{i} 1", capture_output=True, text=True)
        assert p.stdout == f"{i + 1}\n", p.stderr

    def jailed(i: int) -> None:
        slot = slots.get()  # a slot's uid is its run's alone: the sweep after a run kills whatever has it
        try:
            r = jail.run(slot, SOURCE, f"{i} 1", {}, LIMITS)
        finally:
            slots.put(slot)
        assert r.stdout == f"{i + 1}\n", r

    args = ["--workers", str(workers), "--log-level", "WARNING"]
    with running("sandbox", *args, ready_path="/readyz") as (base, _):
        client = httpx.Client(base_url=base, timeout=60, limits=httpx.Limits(max_keepalive_connections=workers))

        def served(i: int) -> None:
            t0 = time.perf_counter()
            r = client.post("/v1/run", json={"language": "python", "source": SOURCE, "stdin": f"{i} 1"})
            latencies.append(time.perf_counter() - t0)
            assert r.json()["stdout"] == f"{i + 1}\n", r.text

        _parallel(workers, 8, served)  # warm-up: connections, the page cache
        latencies.clear()
        service, sandboxed, plain = best_rates(
            [
                lambda: _parallel(workers, runs, served),
                lambda: _parallel(workers, runs, jailed),
                lambda: _parallel(workers, runs, bare),
            ],
            repeats=3,
        )
        rows = [
            Result(
                "sandbox",
                f"trivial program through the service, {workers} worker(s), as many clients",
                service,
                plain,
                "runs/s",
                f"bare subprocess.run of the same main.py, {workers} thread(s)",
                "≥ 0.5",
            ),
            Result(
                "sandbox",
                f"the same in the sandbox without HTTP (Jail.run, {workers} thread(s))",
                sandboxed,
                plain,
                "runs/s",
                "bare subprocess.run, same",
                "—",
            ),
        ]
        q = statistics.quantiles(latencies, n=100)
        rows.append(
            Result(
                "sandbox",
                f"latency p99 through the service, {workers} worker(s) (p50 {q[49] * 1e3:.1f} ms)",
                q[98] * 1e3,
                workers / plain * 1e3,
                "ms",
                "bare run's time per run",
                "—",
            )
        )
        if workers > 1:
            rows.append(_batch_row(client, workers, bare))
        client.close()
    return rows


def _batch_row(client: httpx.Client, workers: int, bare: Callable[[int], None]) -> Result:
    """One POST /v1/batch of 64 inputs against 64 bare runs from `workers` threads."""
    stdins = [f"{i} 1" for i in range(64)]
    t0 = time.perf_counter()
    batch = client.post("/v1/batch", json={"language": "python", "source": SOURCE, "stdins": stdins})
    batch_s = time.perf_counter() - t0
    assert [r["stdout"] for r in batch.json()["results"]] == [f"{i + 1}\n" for i in range(64)]
    t0 = time.perf_counter()
    _parallel(workers, 64, bare)
    return Result(
        "sandbox",
        f"one /v1/batch of 64 inputs, {workers} workers",
        64 / batch_s,
        64 / (time.perf_counter() - t0),
        "runs/s",
        f"64 bare runs, {workers} threads",
        "≥ 0.5",
    )


def verifier_row(python: str, tmp: str, answers: int = 64, tests: int = 10) -> Result:
    """The reward server's `code` verifier: `answers` right answers x `tests` stdin/stdout tests in one score request
    (the sandbox at 2 workers) against the same programs on the same inputs run bare from 2 threads."""

    def truth(i: int) -> str:
        return json.dumps(
            {"inputs": [f"{i} {t}\n" for t in range(tests)], "outputs": [f"{i + t}\n" for t in range(tests)]}
        )

    answer = f"```python\n{SOURCE}\n```"
    items = [{"id": str(i), "response": answer, "ground_truth": truth(i), "verifier": "code"} for i in range(answers)]
    with running("sandbox", "--workers", "2", "--log-level", "WARNING", ready_path="/readyz") as (sandbox, _):
        args = ["--workers", "1", "--sandbox-url", sandbox, "--cache-size", "0", "--log-level", "WARNING"]
        with running("reward_server", *args, ready_path="/readyz") as (base, _):
            t0 = time.perf_counter()
            r = httpx.post(f"{base}/v1/score", json={"items": items}, timeout=600)
            served = answers / (time.perf_counter() - t0)
    assert all(x["acc"] for x in r.json()["results"]), r.text[:500]

    def bare(k: int) -> None:
        i, t = divmod(k, tests)
        p = subprocess.run([python, "-E", "-s", "main.py"], cwd=tmp, input=f"{i} {t}", capture_output=True, text=True)
        assert p.stdout == f"{i + t}\n", p.stderr

    t0 = time.perf_counter()
    _parallel(2, answers * tests, bare)
    plain = answers / (time.perf_counter() - t0)
    return Result(
        "sandbox",
        f"code verifier: {answers} answers x {tests} tests in one /v1/score (sandbox 2 workers)",
        served,
        plain,
        "answers/s",
        f"the {answers * tests} programs run bare, 2 threads",
        "≥ 0.5",
    )


def run(runs: int = 200) -> list[Result]:
    python = find_python(None)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "main.py").write_text(SOURCE)
        return _rows(1, runs // 2, python, tmp) + _rows(2, runs, python, tmp) + [verifier_row(python, tmp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=200, help="runs per round at 2 workers (3 rounds of each kind)")
    print_table(run(ap.parse_args().runs))


if __name__ == "__main__":
    main()
