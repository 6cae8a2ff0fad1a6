"""Recording episodes for `dapo-mesh view`, and the viewer serving them, against the machine's limits.

Rows, all measured in one run:
- record: groups of the DAPO preset's shape (8 samples x 96 tokens) through group_record + EpisodeLog.write (JSON
  lines on disk), in samples per second, vs packing the same groups for the wire (msgpack, services/streams.py): what
  the mesh already pays per group, every group.
- bytes: bytes per recorded sample on disk vs the packed arrays it holds (int32 token ids, two float32 log-probs per
  token: 12 B per token) — the cost of JSON text over binary.
- share: recording one training batch of the preset (4 groups of 8), in milliseconds, vs the learner's step on the
  same batch size (the median `seconds` of docs/ablate/dapo-seed1: 2 cores, measured there) — the learner's share.
- view: a run of 45 steps written as the mesh writes it (each step's 4 trained groups and 12 dropped ones), served by
  the real viewer over HTTP: the first page (the index built), a later page, an episode opened — vs a GET /healthz
  of the same server (HTTP's floor here).
Run: `python -m bench.recording`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import Result, print_table
from services.episode_log import EpisodeLog, group_record, sample_record
from services.selfcheck import example_group
from services.streams import pack

SAMPLES, TOKENS, GROUPS_PER_STEP, DROPPED_PER_STEP, STEPS = 8, 96, 4, 12, 45
STEP_SECONDS_FROM = Path(__file__).resolve().parents[1] / "docs" / "ablate" / "dapo-seed1" / "metrics.jsonl"


def _trained(i: int, version: int) -> dict[str, object]:
    g = example_group(i, n_samples=SAMPLES, n_tokens=TOKENS, version=version - 1)
    samples = [
        sample_record(s, sc.reward, sc.acc, sc.pred, advantage=0.5, learner_logp=s.logprobs.tolist(), loss_mask=None)
        for s, sc in zip(g.samples, g.scores, strict=True)
    ]
    return group_record(g, "trained", version, batch_id=version - 1, samples=samples)


def _record_rates(tmp: Path, groups: int = 400) -> tuple[float, float, float]:
    """(samples/s recorded, samples/s the same groups are packed for the wire, bytes per sample)."""
    gs = [example_group(i, n_samples=SAMPLES, n_tokens=TOKENS, version=1) for i in range(groups)]
    log = EpisodeLog(tmp / "ours", fraction=1.0, max_mb=10_000)
    t0 = time.perf_counter()
    for k, g in enumerate(gs):
        log.write(f"dropped-v{k // 16:06d}.jsonl", [group_record(g, "dropped", 1, reason="all_correct")], version=1)
    ours = groups * SAMPLES / (time.perf_counter() - t0)
    data = [p.read_bytes() for p in sorted((tmp / "ours").glob("*.jsonl"))]
    t0 = time.perf_counter()
    for g in gs:
        pack(g)
    wire = groups * SAMPLES / (time.perf_counter() - t0)
    return ours, wire, sum(len(b) for b in data) / (groups * SAMPLES)


def _batch_ms(tmp: Path, repeats: int = 20) -> float:
    log = EpisodeLog(tmp / "batch", fraction=1.0, max_mb=10_000)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        records = [_trained(r * GROUPS_PER_STEP + i, r + 1) for i in range(GROUPS_PER_STEP)]
        log.write(f"v{r + 1:06d}.jsonl", records, version=r + 1, replace=True)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _learner_step_s() -> float:
    rows = [json.loads(x) for x in STEP_SECONDS_FROM.read_text().splitlines() if x.strip()]
    return statistics.median(r["seconds"] for r in rows if r.get("kind") == "train")


def _write_run(root: Path) -> int:
    learner = EpisodeLog(root / "learner" / "episodes", fraction=1.0, max_mb=10_000)
    buffer = EpisodeLog(root / "buffer" / "episodes", fraction=1.0, max_mb=10_000)
    for v in range(1, STEPS + 1):
        base = v * (GROUPS_PER_STEP + DROPPED_PER_STEP)
        learner.write(f"v{v:06d}.jsonl", [_trained(base + i, v) for i in range(GROUPS_PER_STEP)], version=v)
        dropped = [
            group_record(example_group(base + GROUPS_PER_STEP + i, SAMPLES, TOKENS, v - 1), "dropped", v, reason="x")
            for i in range(DROPPED_PER_STEP)
        ]
        buffer.write(f"dropped-v{v:06d}.jsonl", dropped, version=v)
    return STEPS * (GROUPS_PER_STEP + DROPPED_PER_STEP) * SAMPLES


def _view_times(root: Path) -> tuple[float, float, float, float]:
    """(first page s, later page s, episode s, /healthz s) of the real viewer over HTTP."""
    from mesh.viewer import ViewerSettings, create_viewer
    from services.redis_server import free_port
    from services.web import serve_in_thread

    s = ViewerSettings(run_dir=root, port=free_port())
    server = serve_in_thread(create_viewer(s), s)
    base = f"http://127.0.0.1:{s.port}"
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        with httpx.Client(base_url=base, timeout=30) as c:

            def took(path: str, **params: object) -> float:
                t0 = time.perf_counter()
                c.get(path, params=params).raise_for_status()
                return time.perf_counter() - t0

            first = took("/api/episodes", size=50)
            later = statistics.median(took("/api/episodes", size=50, page=p, outcome="dropped") for p in range(1, 8))
            row = c.get("/api/episodes", params={"size": 1, "outcome": "trained"}).json()["rows"][0]
            episode = statistics.median(took(f"/api/episodes/{row['id']}") for _ in range(5))
            health = statistics.median(took("/healthz") for _ in range(20))
        return first, later, episode, health
    finally:
        server.should_exit = True
        threading.Event().wait(0.2)


def run() -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="dapo-bench-rec-") as d:
        tmp = Path(d)
        ours, raw, per_sample = _record_rates(tmp)
        batch_ms = _batch_ms(tmp)
        step_s = _learner_step_s()
        samples = _write_run(tmp / "run")
        first, later, episode, health = _view_times(tmp / "run")
    wire = "msgpack of the same groups (the wire)"
    packed = "packed int32 + 2 float32 per token"
    step = "the learner's step (dapo-seed1 median)"
    return [
        Result("recording", "samples recorded (8 x 96 tokens)", ours, raw, "samples/s", wire),
        Result("recording", "bytes per sample on disk", per_sample, 12 * TOKENS, "B", packed, "≤ 5"),
        Result("recording", "one batch (4 x 8) recorded", batch_ms, 1000 * step_s, "ms", step, "≤ 0.01"),
        Result("viewer", f"first page of {samples:,} samples (index built)", first, 1.0, "s", "a second", "≤ 1"),
        Result("viewer", "a later page (filtered)", later, health, "s", "GET /healthz"),
        Result("viewer", "an episode opened (no tokenizer)", episode, health, "s", "GET /healthz"),
    ]


if __name__ == "__main__":
    print_table(run())
