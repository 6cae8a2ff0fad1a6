"""Rollout: generated tokens/s through the worker (Redis in and out, reward round trip) vs raw generate.

Ours: `Worker.step()` over PromptTasks from a real Redis, scoring every batch on a real reward server
and publishing ScoredGroups. Limit: the same engine's `generate` on the same prompts, same run.
Run: `python -m bench.rollout [--engine vllm|hf] [--model DIR]` (default: a random Llama, byte tokenizer).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.common import Result, print_table

PROMPTS, G, MAX_TOKENS, PER_CALL = 16, 4, 48, 8


def run(engine_kind: str = "vllm", model_dir: Path | None = None) -> list[Result]:
    from prometheus_client import CollectorRegistry

    from learner.tiny import tiny_llama
    from rollout.engine import SamplingParams, encode_prompt, load_engine
    from rollout.metrics import RolloutMetrics
    from rollout.reward_client import RewardClient
    from rollout.settings import RolloutSettings
    from rollout.worker import Worker
    from services.common.launch import running
    from services.common.redis_server import EmbeddedRedis
    from services.common.schemas import PromptTask
    from services.common.streams import STREAM_PROMPTS, StreamProducer, connect

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as in the worker
    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-"))
    model_dir = model_dir or tiny_llama(tmp / "m", hidden=256, layers=4, tokenizer=True)
    engine = load_engine(model_dir, engine_kind, kv_cache_gib=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=0)
    texts = [f"Question {i}: what is {i} + {2 * i}?" for i in range(PROMPTS)]
    prompts = [encode_prompt(engine.tokenizer, t) for t in texts]
    engine.generate(prompts[:2], G, params)  # warm-up

    def raw_round() -> float:
        t0 = time.perf_counter()
        n = 0
        for k in range(0, PROMPTS, PER_CALL):
            n += sum(len(c.token_ids) for o in engine.generate(prompts[k : k + PER_CALL], G, params) for c in o)
        return n / (time.perf_counter() - t0)

    with EmbeddedRedis(tmp / "redis") as server, running("reward_server", "--workers", "1", "--log-level",
                                                          "WARNING") as (reward_url, _):  # fmt: skip
        client = connect(server.url)
        s = RolloutSettings(
            model_dir=model_dir, engine=engine_kind, redis_url=server.url, reward_url=reward_url,  # type: ignore[arg-type]
            prompts_per_call=PER_CALL, max_response_tokens=MAX_TOKENS, seed=0, replica_id="bench",
        )  # fmt: skip
        worker = Worker(s, client, engine, RewardClient(reward_url), RolloutMetrics(CollectorRegistry()))

        def worker_round() -> float:
            tasks = [
                PromptTask(task_id=f"{time.time_ns()}-{i}", prompt_id=str(i), prompt=t, ground_truth="1",
                           verifier="dapo_math", data_source="bench", n_samples=G)
                for i, t in enumerate(texts)
            ]  # fmt: skip
            StreamProducer(client, STREAM_PROMPTS).publish_many(tasks)
            before = worker.m.tokens._value.get()
            t0 = time.perf_counter()
            done = 0
            while done < PROMPTS:
                done += worker.step()
            return (worker.m.tokens._value.get() - before) / (time.perf_counter() - t0)

        worker_round()  # warm-up
        raw, ours = [], []
        for _ in range(3):
            raw.append(raw_round())
            ours.append(worker_round())
    what = f"{engine_kind}: {PROMPTS} prompts x {G} samples, <= {MAX_TOKENS} tokens, {PER_CALL} prompts/call"
    return [Result("rollout", what, max(ours), max(raw), "tokens/s", "raw engine.generate, same prompts", "≥ 0.9")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    print_table(run(args.engine, args.model))


if __name__ == "__main__":
    main()
