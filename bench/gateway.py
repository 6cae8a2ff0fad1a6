"""The OpenAI-compatible gateway against calling the engine directly: the same multi-turn conversations, the same
engine (vLLM's continuous batching, SmolLM2-135M), the same concurrency. Through the gateway: 16 agents, each with
the official `openai` client, open a session for a task the mesh hands out, take TURNS turns of TOKENS tokens
(ignore_eos: lengths as set), the conversation growing by the answer and a user turn, and end the session (captured,
published as an episode into Redis). Directly: 16 conversations driven on the engine in-process (rendered with the
chat template, submitted, stepped), no HTTP, no capture. Tokens per second through the gateway ÷ directly, and the
latency of a call (p50, p99) both ways: what the gateway adds per call. And the router: the same agents through the
router in front of the replica ÷ straight to the replica's gateway, the two runs taken turn about in one run (what
the one endpoint for N replicas costs: a hop on the same machine).

    python -m bench.gateway
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Result, engine_script, print_table

CONF = {"agents": 16, "rounds": 2, "turns": 4, "tokens": 48}

DIRECT = """
import json, sys, time
if __name__ == "__main__":
    from rollout.engines import SamplingParams, load_engine
    from services.dtype import resolve_dtype
    model, agents, rounds, turns, tokens = sys.argv[1], *map(int, sys.argv[2:6])
    engine = load_engine(model, "vllm", dtype=resolve_dtype("auto"), batching="continuous", kv_cache_gib=2)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    def ids(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False).input_ids)
    def run(tag):
        convs = {f"{tag}{a}/{r}": [{"role": "user", "content": f"Tell me about the number {a * 100 + r}."}]
                 for a in range(agents) for r in range(rounds)}
        waiting = {a: [f"{tag}{a}/{r}" for r in range(rounds)] for a in range(agents)}
        turn, lat, done_tokens, started = {}, [], 0, {}
        def submit(c):
            key = f"{c}#{turn.get(c, 0)}"
            started[key] = time.perf_counter()
            engine.submit(key, ids(convs[c]), 1, params)
        for a in range(agents):
            submit(waiting[a].pop(0))
        t0 = time.perf_counter()
        while engine.in_flight():
            for key, outs in engine.step():
                lat.append(time.perf_counter() - started.pop(key))
                c = key.split("#")[0]
                done_tokens += len(outs[0].token_ids)
                turn[c] = turn.get(c, 0) + 1
                convs[c] += [{"role": "assistant", "content": outs[0].text}, {"role": "user", "content": "Go on."}]
                a = int(c[len(tag):].split("/")[0])
                if turn[c] < turns:
                    submit(c)
                elif waiting[a]:
                    submit(waiting[a].pop(0))
        return done_tokens / (time.perf_counter() - t0), lat
    run("warm")
    rate, lat = run("t")
    print("RESULT " + json.dumps({"dtype": engine.dtype, "rate": rate, "lat": lat}))
"""


def direct(model: Path) -> dict[str, Any]:
    args = [str(CONF[k]) for k in ("agents", "rounds", "turns", "tokens")]
    return engine_script("gateway-direct", DIRECT, [str(model), *args])


def agent(base: str, a: int, lat: list[float], tokens: list[int]) -> None:
    import httpx
    import openai

    for r in range(CONF["rounds"]):
        s = httpx.post(f"{base}/v1/sessions", timeout=60).json()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=s["api_key"], max_retries=0, timeout=600)
        messages = [{"role": "user", "content": f"Tell me about the number {a * 100 + r}."}]
        for _ in range(CONF["turns"]):
            t0 = time.perf_counter()
            r = client.chat.completions.create(
                model="policy",
                messages=messages,
                max_tokens=CONF["tokens"],  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )
            lat.append(time.perf_counter() - t0)
            tokens.append(r.usage.completion_tokens if r.usage else 0)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": "Go on."},
            ]
        httpx.post(f"{base}/v1/sessions/{s['session_id']}/end", json={"reward": 1.0}, timeout=60).raise_for_status()


def through_gateway(model: Path, tmp: Path) -> dict[str, Any]:
    from services.child_process import running
    from services.redis_server import EmbeddedRedis, free_port
    from services.schemas import PromptTask
    from services.streams import STREAM_PROMPTS, StreamProducer, connect

    def run(base: str) -> tuple[float, list[float]]:
        lat: list[float] = []
        tokens: list[int] = []
        t0 = time.perf_counter()
        threads = [threading.Thread(target=agent, args=(base, a, lat, tokens)) for a in range(CONF["agents"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(tokens) / (time.perf_counter() - t0), lat

    with EmbeddedRedis(tmp / "redis") as server:
        tasks = [
            PromptTask(
                task_id=f"b{i}",
                prompt_id=f"p{i}",
                prompt="x",
                ground_truth="1",
                verifier="client",  # scored by their client: the agent ends each session with a reward
                data_source="bench",
                n_samples=1,
            )
            for i in range(6 * CONF["agents"] * CONF["rounds"])
        ]
        StreamProducer(connect(server.url), STREAM_PROMPTS).publish_many(tasks)
        gport = free_port()
        args = [
            "--engine",
            "vllm",
            "--model-dir",
            str(model),
            "--redis-url",
            server.url,
            "--gateway-port",
            str(gport),
            "--gateway-only",
            "--gateway-max-tokens",
            str(CONF["tokens"]),
        ]
        env = {"DAPO_REDIS_URL": server.url}
        with (
            running("rollout", *args, ready_path="/readyz", timeout_s=600, log=tmp / "rollout.log"),
            running("router", env=env, ready_path="/readyz", log=tmp / "router.log") as (router, _),
        ):
            base = f"http://127.0.0.1:{gport}"
            run(base)  # warm-up: the engine's first batches of each size
            rate, lat = run(base)
            routed, direct = [], []
            for _ in range(2):  # turn about: the engine's state drifts between runs, not the comparison
                routed.append(run(router)[0])
                direct.append(run(base)[0])
    return {"rate": rate, "lat": lat, "routed": max(routed), "direct": max(direct)}


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]


def run(model_dir: Path | None = None) -> list[Result]:
    from bench.rollout import smollm2

    model = model_dir or smollm2()
    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-gw-"))
    d = direct(model)
    g = through_gateway(model, tmp)
    what = (
        f"vllm SmolLM2-135M {d['dtype']}, {CONF['agents']} agents x {CONF['rounds']} sessions x {CONF['turns']} "
        f"turns x {CONF['tokens']} tokens"
    )
    rows = [
        Result(
            "gateway",
            f"{what}: tokens/s through the gateway (openai client, sessions captured)",
            g["rate"],
            d["rate"],
            "tokens/s",
            "the engine driven directly",
            "≥ 0.8",
        )
    ]
    rows.append(
        Result(
            "gateway",
            f"{what}: tokens/s through the router in front of the replica",
            g["routed"],
            g["direct"],
            "tokens/s",
            "the same agents straight to the replica's gateway",
            "≥ 0.9",
        )
    )
    for q in (50, 99):
        rows.append(
            Result(
                "gateway",
                f"{what}: call latency p{q}",
                pct(g["lat"], q),
                pct(d["lat"], q),
                "s",
                "the engine driven directly",
                "≤ 1.25",
            )
        )
    return rows


if __name__ == "__main__":
    print_table(run())
