"""The control plane at N replicas: the real Redis, buffer, reward server and weight sync against N simulated
replicas, and what each part costs per group as N grows (docs/results/scale.md).

    python -m bench.simulate --replicas 1,4,16,64,256 --seconds 60 [--churn 0.1] [--broadcast] [--out DIR]

Per N, a fresh mesh: an embedded Redis (AOF on, as `dapo-mesh up` runs it), `python -m reward_server`,
`python -m buffer` (a synthetic dataset in the verl file schema, verified by the real dapo_math rule), the rate
learner (bench/sim_learner.py: the learner's protocol, its training step replaced by a wait) and the replicas:
N threads in `--procs` processes running the real replica code — its continuous-batching loop, or `--loop chunked`
— with a simulated engine (bench/sim_replicas.py).
The total offered load is held constant (`--groups-per-s`; each replica generates at that ÷ N), so a cost that
grows with N is a cost of N itself, not of more work. A continuous replica runs one group at a time (max_in_flight
= G), as the chunked loop calls the engine with one prompt: the simulated engine's throughput does not grow with its
batch as a real one's does, so a replica holding 8 of the window's prompts while others idle (max_in_flight 64: 8-11
of the 32 groups/s at N = 64) would measure the simulation. After `--warmup-s`, a window of `--seconds`:

    groups/s          scored groups published by the replicas (dapo:rollouts entries added) per second
    dispatch p50/p99  a prompt's wait in dapo:prompts: its entry's time to a replica's read
    backlog           prompts dispatched and not taken (the rollout group's lag + pending), mean of 1 s samples
    CPU per 1k groups buffer, Redis, reward server (process trees' user+system seconds), per 1,000 groups
    Redis memory      used_memory at the end
    pickup p50/p99    a version's announcement (the learner sets it) -> each live replica loading it (or a newer)
    sync              seconds the learner spent per version (broadcast rounds, or writing a snapshot), its max
    rebuilds          broadcast groups rebuilt, and the seconds they took
    audit             `dapo-mesh audit` over the run: every dispatched prompt accounted, none trained twice
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from bench.sim_learner import write_model
from bench.sim_replicas import question
from services.child_process import ROOT, child_env, wait_ready
from services.redis_server import EmbeddedRedis, free_port

RECORDED_RUN = ROOT / "docs" / "learning-run-dapo.metrics.jsonl"  # the DAPO preset's run: B=8, G=8 (64 samples)
RECORDED_SAMPLES_PER_STEP = 64
G = 8


def recorded_lengths(scale: float = 1.0) -> list[int]:
    """Response lengths to draw from: the mean sample length of each step of the recorded run (× scale)."""
    rows = [json.loads(x) for x in RECORDED_RUN.read_text().splitlines() if x.strip()]
    means = [r["response_tokens"] / RECORDED_SAMPLES_PER_STEP for r in rows if r.get("kind") == "train"]
    return [max(1, round(m * scale)) for m in means]


def write_dataset(path: Path, n: int, seed: int = 0) -> Path:
    """n prompts in the verl schema whose pass rates are spread as a base model's are over a task: 40% nearly
    never solved, 30% nearly always, 30% in between (with G = 8, about 60% of groups agree and are dropped)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        u = rng.random()
        p = 0.02 if u < 0.4 else 0.97 if u < 0.7 else rng.uniform(0.1, 0.9)
        answer = rng.randrange(1, 10_000)
        rows.append(
            {
                "data_source": "sim",
                "prompt": [{"role": "user", "content": question(i, answer, p)}],
                "reward_model": {"ground_truth": str(answer)},
                "verifier": "dapo_math",
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cpu_seconds(pid: int) -> float:
    """User + system seconds of a process and its children (live ones, and those it has waited for)."""
    try:
        proc = psutil.Process(pid)
        total = sum(proc.cpu_times()[:4])
        for child in proc.children(recursive=True):
            total += sum(child.cpu_times()[:2])
        return total
    except psutil.NoSuchProcess:
        return float("nan")


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"] + info["used_cpu_sys"])


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Mesh:
    """One simulated mesh's processes; stopped in reverse order, each by its PID."""

    def __init__(self, work: Path, args: argparse.Namespace, n: int):
        self.work, self.a, self.n = work, args, n
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.tokens_per_s = 0.0  # each replica's, set at the start
        self.lengths = recorded_lengths(args.length_scale)  # what the replicas draw from
        self.env = child_env(OMP_NUM_THREADS="1", DAPO_LOG_LEVEL=os.environ.get("DAPO_LOG_LEVEL", "WARNING"))

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.work / f"{name}.log").open("wb")
        p = subprocess.Popen([sys.executable, "-m", *argv], env=self.env, cwd=ROOT, stderr=log, stdout=log)
        self.procs[name] = p
        return p

    def service(self, name: str, package: str, *args: str) -> str:
        port = free_port()
        p = self.spawn(name, [package, "--port", str(port), *args])
        base = f"http://127.0.0.1:{port}"
        wait_ready(p, base + "/readyz", name=name, timeout_s=180, log_hint=f" (log: {self.work / name}.log)")
        return base

    def start(self, redis_url: str) -> None:
        from mesh.config import to_flags

        a, work = self.a, self.work
        model = write_model(work / "model", a.weight_numel)
        reward = self.service("reward", "reward_server", "--workers", "1")
        dataset = f"file:{write_dataset(work / 'data.jsonl', a.prompts)}"
        keep = {"keep_prompts": 10_000_000, "keep_rollouts": 10_000_000, "keep_dropped": 10_000_000}
        buffer = {"redis_url": redis_url, "run_dir": work / "run" / "buffer", "dataset": dataset, "eval_size": 0}
        buffer |= {"prompt_template": "none", "n_samples": G, "batch_size": a.batch_size}
        self.service("buffer", "buffer", *to_flags(buffer | {"max_staleness": a.max_staleness} | keep))
        sync = ["--broadcast", "--sync-max-members", str(a.sync_max_members)] if a.broadcast else []
        learner = {"redis_url": redis_url, "run_dir": work / "run", "model_dir": model, "step_s": a.step_s}
        self.spawn("learner", ["bench.sim_learner", *to_flags(learner | {"out": work / "learner.json"}), *sync])
        lengths = work / "lengths.json"
        lengths.write_text(json.dumps(self.lengths))
        self.tokens_per_s = tokens_per_s = a.groups_per_s * G * statistics.mean(self.lengths) / self.n
        sync = ["--weights-dir", str(work / "run" / "learner" / "hf")] + (["--broadcast"] if a.broadcast else [])
        procs = min(a.procs, self.n)
        for i in range(procs):
            count = self.n // procs + (i < self.n % procs)
            replicas = {"redis_url": redis_url, "reward_url": reward, "prefix": f"sim{i}", "count": count}
            replicas |= {"tokens_per_s": tokens_per_s, "lengths": lengths, "out": work / f"replicas-{i}.json"}
            replicas |= {"model_dir": model, "churn": a.churn, "churn_every_s": a.churn_every_s, "loop": a.loop}
            replicas |= {"max_in_flight": G}  # one group at a time, as the chunked loop's one prompt per call
            self.spawn(f"replicas-{i}", ["bench.sim_replicas", *to_flags(replicas), *sync])

    def stop(self) -> None:
        order = [k for k in self.procs if k.startswith("replicas")] + ["learner", "buffer", "reward"]
        for name in order:  # the replicas first: what they hold goes back to the stream, accounted
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def pid(self, name: str) -> int:
        return self.procs[name].pid


class Sampler:
    """Counters read at the window's start and end, and the backlog sampled every second in between."""

    def __init__(self, client: Any, mesh: Mesh):
        self.client, self.mesh = client, mesh
        self.backlog: list[int] = []

    def read(self) -> dict[str, float]:
        from services.stream_admin import stream_stats
        from services.streams import STREAM_BATCHES, STREAM_ROLLOUTS

        def added(stream: str) -> int:
            return int(self.client.xlen(stream))  # nothing trimmed here (keep_* above the run); 6.2: no entries-added

        stats = stream_stats(self.client, STREAM_ROLLOUTS)
        return {
            "t": time.monotonic(),
            "groups": added(STREAM_ROLLOUTS),
            "batches": added(STREAM_BATCHES),
            "redis": redis_cpu(self.client),
            "buffer": cpu_seconds(self.mesh.pid("buffer")),
            "reward": cpu_seconds(self.mesh.pid("reward")),
            "learner": cpu_seconds(self.mesh.pid("learner")),
            "rollouts_backlog": sum((g.lag or 0) + g.pending for g in stats.groups),
        }

    def sample_backlog(self, stop: threading.Event) -> None:
        from services.stream_admin import stream_stats
        from services.streams import GROUP_ROLLOUT, STREAM_PROMPTS

        while not stop.wait(1.0):
            for g in stream_stats(self.client, STREAM_PROMPTS).groups:
                if g.name == GROUP_ROLLOUT:
                    self.backlog.append((g.lag or 0) + g.pending)


def pickups(
    rounds: list[dict[str, Any]], replicas: list[dict[str, Any]], t0: float, t1: float, bound_s: float
) -> tuple[list[float], int]:
    """For each version announced in [t0, t1] and each replica that was loading weights then: seconds from the
    announcement to the replica's first load of that version or a newer one; and how many of those replicas that
    stayed `bound_s` longer never loaded it (missed)."""
    out, missed = [], 0
    for r in rounds:
        if not t0 <= r["announced"] <= t1:
            continue
        for rep in replicas:
            if not rep["loads"] or rep["loads"][0][1] > r["announced"]:  # not there yet, or not loading yet
                continue
            loads = [t for v, t in rep["loads"] if v >= r["version"]]
            if loads:
                out.append(min(loads) - r["announced"])
            elif (rep["left"] or float("inf")) - r["announced"] > bound_s:
                missed += 1
    return out, missed


def pickup_bound(mesh: Mesh, rounds: list[dict[str, Any]]) -> float:
    """The documented bound on a version's pickup: a replica loads between engine calls (the chunked loop), so one
    call at the longest drawn length, one read block (1 s) while idle, and the slowest sync round."""
    call_s = G * max(mesh.lengths) / mesh.tokens_per_s
    return call_s + 1.0 + max((r["sync_s"] for r in rounds), default=0.0)


def run_n(n: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from mesh.audit import audit
    from services.streams import connect

    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedRedis(work / "redis", binary=a.redis_server))
        client = connect(server.url)
        mesh = Mesh(work, a, n)
        stack.callback(mesh.stop)
        mesh.start(server.url)
        sampler, stop = Sampler(client, mesh), threading.Event()
        time.sleep(a.warmup_s)
        wall0, before = time.time(), sampler.read()
        watcher = threading.Thread(target=sampler.sample_backlog, args=(stop,), daemon=True)
        watcher.start()
        time.sleep(a.seconds)
        wall1, after = time.time(), sampler.read()
        stop.set()
        alive = {k: p.poll() is None for k, p in mesh.procs.items()}
        mesh.stop()
        report = audit(client, work / "run")
        redis_mb = client.info("memory")["used_memory"] / 2**20
        redis_version = client.info("server")["redis_version"]
    rounds = json.loads((work / "learner.json").read_text())["rounds"]
    replicas = [r for f in sorted(work.glob("replicas-*.json")) for r in json.loads(f.read_text())["replicas"]]
    waits = [w for r in replicas for t, w in r["waits"] if wall0 <= t <= wall1]
    bound = pickup_bound(mesh, rounds)
    ups, missed = pickups(rounds, replicas, wall0, wall1, bound)
    in_window = [r for r in rounds if wall0 <= r["announced"] <= wall1]
    groups = after["groups"] - before["groups"]
    per_k = 1000 / groups if groups else float("nan")
    return {
        "replicas": n,
        "redis": redis_version,
        "seconds": round(after["t"] - before["t"], 1),
        "groups": groups,
        "groups_per_s": groups / (after["t"] - before["t"]),
        "versions": len(in_window),
        "dispatch_p50_ms": percentile(waits, 0.5) * 1000,
        "dispatch_p99_ms": percentile(waits, 0.99) * 1000,
        "backlog_prompts": statistics.mean(sampler.backlog) if sampler.backlog else float("nan"),
        "backlog_groups": after["rollouts_backlog"],
        **{f"cpu_{k}_per_1k": (after[k] - before[k]) * per_k for k in ("buffer", "redis", "reward", "learner")},
        "redis_mb": redis_mb,
        "pickup_p50_s": percentile(ups, 0.5),
        "pickup_p99_s": percentile(ups, 0.99),
        "pickup_max_s": max(ups, default=float("nan")),
        "pickups": len(ups),
        "pickup_bound_s": bound,
        "pickups_late": sum(u > bound for u in ups),
        "pickups_missed": missed,
        "replicas_started": len(replicas),
        "sync_mean_s": statistics.mean([r["sync_s"] for r in in_window]) if in_window else float("nan"),
        "sync_max_s": max((r["sync_s"] for r in in_window), default=float("nan")),
        "group_max": max((r["replicas"] for r in in_window), default=0),  # members that took a round
        "rebuilds": sum(1 for r in in_window if r["rebuild_s"] > 0),
        "rebuild_max_s": max((r["rebuild_s"] for r in in_window), default=0.0),
        "replica_errors": sorted({r["error"] for r in replicas if r["error"]}),
        "all_alive": all(alive.values()),
        "audit_balanced": report.balanced,
        "audit_vanished": len(report.vanished),
        "trained_twice": len(report.batches_trained_twice),
        "audit_places": report.places,
    }


COLUMNS = [
    ("replicas", "N", "d"),
    ("groups_per_s", "groups/s", ".1f"),
    ("dispatch_p50_ms", "disp p50 ms", ".0f"),
    ("dispatch_p99_ms", "disp p99 ms", ".0f"),
    ("backlog_prompts", "backlog", ".0f"),
    ("cpu_buffer_per_1k", "buffer s/1k", ".2f"),
    ("cpu_redis_per_1k", "redis s/1k", ".2f"),
    ("cpu_reward_per_1k", "reward s/1k", ".2f"),
    ("redis_mb", "redis MB", ".0f"),
    ("pickup_p50_s", "pickup p50 s", ".2f"),
    ("pickup_p99_s", "pickup p99 s", ".2f"),
    ("sync_max_s", "sync max s", ".2f"),
    ("rebuilds", "rebuilds", "d"),
    ("rebuild_max_s", "rebuild max s", ".2f"),
    ("audit_balanced", "audit", ""),
]


def print_rows(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*[title for _, title, _ in COLUMNS])
    for r in rows:
        table.add_row(*[format(r[k], f) if f else str(r[k]) for k, _, f in COLUMNS])
    Console(width=240).print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,4,16,64,256", help="comma-separated N")
    p.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--groups-per-s", type=float, default=32.0, help="total offered load, the same at every N")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-staleness", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.5, help="the rate learner's seconds per step")
    p.add_argument("--prompts", type=int, default=10_000)
    p.add_argument("--length-scale", type=float, default=1.0, help="× the recorded run's response lengths")
    p.add_argument("--procs", type=int, default=4, help="processes the replicas run in")
    p.add_argument("--broadcast", action="store_true", help="replicas join the broadcast group (else snapshots)")
    p.add_argument("--sync-max-members", type=int, default=0, help="cap the broadcast group (the rest: snapshots)")
    p.add_argument("--weight-numel", type=int, default=1 << 20, help="fp32 elements of the simulated weights")
    p.add_argument("--churn", type=float, default=0.0, help="fraction of replicas replaced every --churn-every-s")
    p.add_argument("--churn-every-s", type=float, default=60.0)
    p.add_argument(
        "--loop",
        choices=("continuous", "chunked"),
        default="continuous",
        help="the replicas' loop (vLLM's: continuous)",
    )
    p.add_argument("--redis-server", type=Path, default=None, help="a redis-server binary (Redis 7, as deployed)")
    p.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    a = p.parse_args(argv)
    rows = []
    for n in [int(x) for x in a.replicas.split(",")]:
        rows.append(run_n(n, a, Path(tempfile.mkdtemp(prefix=f"dapo-sim-{n}-"))))
        print(json.dumps(rows[-1]), flush=True)
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1))
    print_rows(rows)


if __name__ == "__main__":
    main()
