"""Episodes per second against an environment that takes 100 ms and 1 s per step: continuous batching across
turns (rollout/episode_runner.py as the replica's continuous loop drives it: an episode waiting for its environment
leaves the engine, the others generate) against the loop that waits for every episode of a batch to finish a turn
before the next turn (`run_turn_by_turn`, batches of as many episodes as the engine's bound). The same engine
(vLLM, SmolLM2-135M), the same bound on sequences in the engine, the same episodes: 4 model turns of 16 tokens
each (ignore_eos: lengths as set), the real environment service over HTTP (bench/envs.py's Latency).

    python -m bench.episodes
"""

from __future__ import annotations

from pathlib import Path

from bench.common import Result, engine_script, print_table

EPISODES = {"episodes": 64, "turns": 4, "tokens": 16, "bound": 16, "latencies": "0.1,1.0"}

SCRIPT = """
import json, sys, time
if __name__ == "__main__":
    from prometheus_client import CollectorRegistry
    from rollout.engines import SamplingParams, load_engine
    from rollout.episode_runner import EpisodeRunner, run_turn_by_turn
    from rollout.metrics import RolloutMetrics
    from rollout.settings import RolloutSettings
    from services.child_process import running
    from services.dtype import resolve_dtype
    from services.schemas import PromptTask
    from services.streams import Delivery
    model, n, turns, tokens, bound, latencies = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
    engine = load_engine(model, "vllm", dtype=resolve_dtype("auto"), batching="continuous", kv_cache_gib=2,
                         max_model_len=2048)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.chunked.generate([[1, 2, 3]], 1, SamplingParams(max_tokens=8))  # warm-up
    out = {"dtype": engine.dtype}
    env_args = ("--workers", "256", "--env-classes", "bench.envs:Latency")
    with running("env_server", *env_args, ready_path="/readyz") as (url, _):
        s = RolloutSettings(env_url=url, env_concurrency=256, max_episode_tokens=4096)
        def runner(seconds, tag, first, count):
            r = EpisodeRunner(s, engine.tokenizer, RolloutMetrics(CollectorRegistry()))
            body = json.dumps({"task": {"seconds": seconds, "turns": turns}})
            for i in range(first, first + count):
                t = PromptTask(task_id=f"{tag}-{i}", prompt_id=f"p{i}", prompt="x", ground_truth=body,
                               verifier="env:latency", data_source="env/latency", n_samples=1)
                r.start(Delivery(str(i), t, 1), params)
            return r
        def continuous(r):
            while r.pending():
                r.advance(engine, bound - engine.in_flight())
                for key, outs in engine.step():
                    r.engine_done(key, outs[0], engine.version)
                if not engine.in_flight() and not r.ready:
                    r.wait(0.01)
            return len(r.take_finished())
        continuous(runner(0.0, "warm", 0, bound))  # the engine's first batches of each size compile: not timed
        run_turn_by_turn(engine.chunked, runner(0.0, "warm-t", 0, bound))
        for seconds in map(float, latencies.split(",")):
            t0 = time.perf_counter()
            r = runner(seconds, f"c{seconds}", 0, n)
            cont = (continuous(r), time.perf_counter() - t0)
            t0, done = time.perf_counter(), 0
            for first in range(0, n, bound):
                r = runner(seconds, f"s{seconds}", first, min(bound, n - first))
                run_turn_by_turn(engine.chunked, r)
                done += len(r.take_finished())
            sync = (done, time.perf_counter() - t0)
            out[str(seconds)] = {"continuous": cont, "turn_by_turn": sync}
    print("RESULT " + json.dumps(out))
"""


def run(model_dir: Path | None = None) -> list[Result]:
    from bench.rollout import smollm2

    model_dir = model_dir or smollm2()
    args = [str(EPISODES[k]) for k in ("episodes", "turns", "tokens", "bound", "latencies")]
    data = engine_script("episodes", SCRIPT, [str(model_dir), *args])
    rows = []
    for seconds in EPISODES["latencies"].split(","):  # type: ignore[union-attr]
        (nc, tc), (ns, ts) = data[str(float(seconds))]["continuous"], data[str(float(seconds))]["turn_by_turn"]
        what = (
            f"vllm SmolLM2-135M {data['dtype']}, {nc} episodes x {EPISODES['turns']} turns x {EPISODES['tokens']} "
            f"tokens, {seconds} s per environment step, {EPISODES['bound']} in the engine: continuous across turns"
        )
        goal = "≥ 2" if float(seconds) >= 1 else "—"
        rows.append(Result("episodes", what, nc / tc, ns / ts, "episodes/s", "turn by turn, same bound", goal))
    return rows


if __name__ == "__main__":
    print_table(run())
