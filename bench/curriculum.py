"""Curriculum state: the per-prompt pass-rate state of a 100,000-prompt dataset in Redis, and its update rate.

Memory: used_memory before and after every prompt has a state (8 groups recorded each, so each holds its full list
of recent group tags), per prompt; the limit is a bare HSET of a 1-byte value per prompt (what the hash's keys
alone cost). Rate: PromptStates.record (the Lua script: read, decay, write) vs a raw HSET of the same JSON, one
round trip each, on the same Redis in the same run. Run: `python -m bench.curriculum [--prompts N]`.
"""

from __future__ import annotations

import argparse
import tempfile

import redis

from bench.common import Result, best_rates, print_table
from buffer.curriculum import KEY_PROMPT_STATE, PromptStates
from services.schemas import ScoredGroup
from services.selfcheck import example_group
from services.streams import connect


def _prompt_id(i: int) -> str:
    return f"rg/basic_arithmetic/42/{i}"  # the length of a real reasoning-gym prompt id


def _groups(n: int) -> list[ScoredGroup]:
    g = example_group(0, n_samples=8, n_tokens=4)
    out = []
    for i in range(n):
        task = g.task.model_copy(update={"prompt_id": _prompt_id(i % 5000), "task_id": f"{_prompt_id(i)}#e0p{i}"})
        out.append(g.model_copy(update={"task": task}))
    return out


def _memory(client: redis.Redis, prompts: int, states: PromptStates) -> tuple[float, float]:
    """Bytes per prompt: (the curriculum's state, a 1-byte HSET per prompt)."""
    g = example_group(0, n_samples=8, n_tokens=4)
    client.delete(KEY_PROMPT_STATE, "bench:bare")
    base = int(client.info("memory")["used_memory"])
    pipe = client.pipeline(transaction=False)
    for i in range(prompts):
        pipe.hset("bench:bare", _prompt_id(i), "x")
        if len(pipe) >= 5000:
            pipe.execute()
    pipe.execute()
    bare = int(client.info("memory")["used_memory"]) - base
    client.delete("bench:bare")
    base = int(client.info("memory")["used_memory"])
    for rnd in range(8):  # 8 groups each: the full list of recent tags (RECENT_TAGS)
        for i in range(prompts):
            task = g.task.model_copy(update={"prompt_id": _prompt_id(i), "task_id": f"{_prompt_id(i)}#e{rnd}p{i}"})
            states.record(g.model_copy(update={"task": task}), zero_variance=rnd % 2 == 0, version=rnd)
    ours = int(client.info("memory")["used_memory"]) - base
    client.delete(KEY_PROMPT_STATE)
    return ours / prompts, bare / prompts


def run(redis_url: str | None = None, prompts: int = 100_000) -> list[Result]:
    from services.redis_server import EmbeddedRedis

    server = None if redis_url else EmbeddedRedis(tempfile.mkdtemp(prefix="dapo-bench-"), appendfsync="no")
    url = redis_url or server.start()  # type: ignore[union-attr]
    try:
        client = connect(url)
        states = PromptStates(client, decay=0.5)
        per_prompt, bare = _memory(client, prompts, states)
        groups = _groups(2000)
        raw = states.record(groups[0], zero_variance=False, version=0).after
        payload = f'[{raw.correct},{raw.samples},{raw.groups},0,0,["0a1b2c3d","0a1b2c3d"]]'

        rounds = iter(range(10**6))

        def ours() -> int:  # new group ids every round: each update is counted (not a duplicate's early return)
            r = next(rounds)
            for g in groups:
                task = g.task.model_copy(update={"task_id": f"{g.task.task_id}r{r}"})
                states.record(g.model_copy(update={"task": task}), zero_variance=False, version=1)
            return len(groups)

        def limit() -> int:  # the same model_copy per group as ours, then a bare HSET
            for g in groups:
                g.model_copy(update={"task": g.task.model_copy(update={"task_id": g.task.task_id})})
                client.hset("bench:raw", g.task.prompt_id, payload)
            return len(groups)

        rate_raw, rate_ours = best_rates([limit, ours], repeats=3)
        client.delete(KEY_PROMPT_STATE, "bench:raw")
    finally:
        if server:
            server.stop()
    mib = per_prompt * prompts / 2**20
    return [
        Result(
            "curriculum",
            f"prompt state, {prompts:,} prompts ({mib:.1f} MiB)",
            per_prompt,
            bare,
            "B/prompt",
            "a 1-byte HSET per prompt id (the keys alone)",
            "≤ 4",
        ),
        Result(
            "curriculum",
            "state update per scored group (Lua: read, decay, write)",
            rate_ours,
            rate_raw,
            "updates/s",
            "raw HSET of the same JSON, one round trip",
            "≥ 0.5",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--redis-url", default=None, help="default: an embedded Redis")
    ap.add_argument("--prompts", type=int, default=100_000)
    args = ap.parse_args()
    print_table(run(args.redis_url, args.prompts))


if __name__ == "__main__":
    main()
