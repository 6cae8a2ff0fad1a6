"""Rollout: generated tokens/s through the replica's loop (Redis in and out, reward round trip) vs raw generate, and
the weight-update modes of continuous batching.

Ours: the replica's loop (`ContinuousLoop.step()` for vLLM, `ChunkedLoop.step()` for HF) over PromptTasks from a real
Redis, scoring on a real reward server and publishing ScoredGroups. Limit: the same engine's `generate` on the
same prompts, same run. Run: `python -m bench.rollout [--engine vllm|hf] [--model DIR]` (default: a random Llama,
byte tokenizer); `--inflight`: the weight-update modes on SmolLM2-135M (`inflight_rows`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Result, print_table

PROMPTS, G, MAX_TOKENS, PER_CALL = 16, 4, 48, 8


def bench_tasks(texts: list[str]) -> list[Any]:
    """One task of G samples per text, under ids no round has used."""
    from services.schemas import PromptTask

    stamp = time.time_ns()
    return [
        PromptTask(
            task_id=f"{stamp}-{i}",
            prompt_id=str(i),
            prompt=t,
            ground_truth="1",
            verifier="dapo_math",
            data_source="bench",
            n_samples=G,
        )
        for i, t in enumerate(texts)
    ]


def run(engine_kind: str = "vllm", model_dir: Path | None = None) -> list[Result]:
    from prometheus_client import CollectorRegistry

    from learner.tiny import tiny_llama
    from rollout.engines import SamplingParams, encode_prompt
    from rollout.metrics import RolloutMetrics
    from rollout.reward_client import RewardClient
    from rollout.runner import build
    from rollout.settings import RolloutSettings
    from services.child_process import running
    from services.redis_server import EmbeddedRedis
    from services.streams import STREAM_PROMPTS, StreamProducer, connect

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as in a replica
    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-"))
    model_dir = model_dir or tiny_llama(tmp / "m", hidden=256, layers=4, tokenizer=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=0)
    texts = [f"Question {i}: what is {i} + {2 * i}?" for i in range(PROMPTS)]

    with (
        EmbeddedRedis(tmp / "redis") as server,
        running("reward_server", "--workers", "1", "--log-level", "WARNING") as (reward_url, _),
    ):
        client = connect(server.url)
        s = RolloutSettings(
            model_dir=model_dir,
            engine=engine_kind,
            redis_url=server.url,
            reward_url=reward_url,  # type: ignore[arg-type]
            prompts_per_call=PER_CALL,
            max_response_tokens=MAX_TOKENS,
            seed=0,
            replica_id="bench",
            dtype="fp32",
            vllm_kv_cache_gib=1,
        )
        # the replica's own loop: continuous batching for vLLM, engine calls for HF (rollout/runner.py)
        replica, loop = build(s, client, RewardClient(reward_url), RolloutMetrics(CollectorRegistry()), None)
        # the limit: the engine called in chunks (continuous batching steps the same vLLM engine)
        engine = getattr(replica.membership.engine, "chunked", replica.membership.engine)
        prompts = [encode_prompt(engine.tokenizer, t) for t in texts]
        engine.generate(prompts[:2], G, params)  # warm-up

        # the limit runs as many sequences at once as the loop can: every prompt in one call under continuous
        # batching (64 sequences <= --max-in-flight), `prompts_per_call` per call for the chunked loop
        per_call = PROMPTS if engine is not replica.membership.engine else PER_CALL

        def raw_round() -> float:
            t0 = time.perf_counter()
            n = 0
            for k in range(0, PROMPTS, per_call):
                n += sum(len(c.token_ids) for o in engine.generate(prompts[k : k + per_call], G, params) for c in o)
            return n / (time.perf_counter() - t0)

        def loop_round() -> float:
            StreamProducer(client, STREAM_PROMPTS).publish_many(bench_tasks(texts))
            before = replica.metrics.tokens._value.get()
            t0 = time.perf_counter()
            done = 0
            while done < PROMPTS:
                done += loop.step()
            return (replica.metrics.tokens._value.get() - before) / (time.perf_counter() - t0)

        loop_round()  # warm-up
        raw, ours = [], []
        for _ in range(3):
            raw.append(raw_round())
            ours.append(loop_round())
    name = "random 4x256 Llama" if model_dir.name == "m" else model_dir.name
    what = f"{engine_kind} {name}: {PROMPTS} prompts x {G} samples, <= {MAX_TOKENS} tokens, fp32, through the loop"
    return [Result("rollout", what, max(ours), max(raw), "tokens/s", "raw engine.generate, same prompts", "≥ 0.9")]


DTYPE_SCRIPT = """
import json, sys, time
if __name__ == "__main__":
    from rollout.engines.vllm_chunked import VllmEngine
    from rollout.engines import SamplingParams, encode_prompt
    e = VllmEngine(sys.argv[1], kv_cache_gib=2, max_model_len=1024, dtype=sys.argv[2])
    ask = "What is {} + {}? Reply with 'Answer: <number>'."
    prompts = [encode_prompt(e.tokenizer, ask.format(i, 3 * i + 1)) for i in range(32)]
    e.generate(prompts[:4], 2, SamplingParams(max_tokens=16, seed=1))  # warm-up
    rates, outs = [], None
    for r in range(2):
        t0 = time.perf_counter()
        outs = e.generate(prompts, 8, SamplingParams(max_tokens=96, seed=r))
        rates.append(sum(len(c.token_ids) for o in outs for c in o) / (time.perf_counter() - t0))
    samples = [{"prompt": p, "tokens": c.token_ids, "logprobs": c.logprobs}
               for p, o in zip(prompts, outs) for c in o[:2]]
    print("RESULT " + json.dumps({"tokens_per_s": max(rates), "samples": samples}))
"""


def dtype_rows(model_dir: Path | None = None) -> list[Result]:
    """vLLM bf16 vs fp32 tokens/s on SmolLM2-135M (32 prompts x 8 samples, <= 96 tokens), and the gap between the
    replica's behaviour log-probs and the learner's (chunked, eager attention) in each dtype, per token."""
    import json
    import subprocess
    import sys

    import torch

    from learner.logprobs import chunked_logprobs
    from mesh.layout import RunLayout
    from services.dtype import resolve_dtype, torch_dtype
    from services.model_prep import prepare_smollm2

    if resolve_dtype("auto") != "bf16":
        print("bench.rollout: no bf16 on this machine; the dtype rows are skipped")
        return []
    from transformers import AutoModelForCausalLM

    model_dir = model_dir or prepare_smollm2(RunLayout(Path(".dapo")).smollm2)
    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-"))
    (tmp / "gen.py").write_text(DTYPE_SCRIPT)
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "VLLM_CACHE_ROOT": str(tmp / "v")}
    rate, gap = {}, {}
    for dtype in ("fp32", "bf16"):
        r = subprocess.run(
            [sys.executable, str(tmp / "gen.py"), str(model_dir), dtype],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode:
            raise RuntimeError(f"vLLM {dtype}: {r.stderr[-2000:]}")
        data = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
        rate[dtype] = data["tokens_per_s"]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype), attn_implementation="eager")
        diffs = []
        with torch.no_grad():
            for smp in data["samples"]:
                ids = torch.tensor([smp["prompt"] + smp["tokens"]])
                hidden = model.get_decoder()(input_ids=ids)[0]
                lp, _ = chunked_logprobs(hidden, model.get_output_embeddings(), ids)
                diffs += (lp[0, len(smp["prompt"]) :] - torch.tensor(smp["logprobs"])).abs().tolist()
        d = torch.tensor(diffs)
        gap[dtype] = (float(d.mean()), float(d.quantile(0.99)), len(diffs))
    what = "vllm SmolLM2-135M, 32 prompts x 8 samples, <= 96 tokens"
    rows = [
        Result("rollout", f"{what}, bf16", rate["bf16"], rate["fp32"], "tokens/s", "the same engine in fp32", "≥ 1")
    ]
    for dtype, (mean, p99, n) in gap.items():
        rows.append(
            Result(
                "rollout",
                f"|Δ log p| replica vs learner, {dtype}, mean ({n} tokens)",
                mean,
                p99,
                "nats",
                "p99 of the same",
                "—",
            )
        )
    return rows


INFLIGHT_SCRIPT = """
import json, math, random, sys, time
if __name__ == "__main__":
    from pathlib import Path
    import torch
    from safetensors.torch import load_file
    from rollout.engines import SamplingParams, encode_prompt
    from rollout.engines.continuous import ContinuousEngine
    from rollout.engines.vllm_chunked import VllmEngine
    model, n, lo, hi, bound, every = sys.argv[1], *map(int, sys.argv[2:7])
    engine = VllmEngine(model, kv_cache_gib=2, max_model_len=1024, dtype="bf16")
    files = sorted(Path(model).glob("*.safetensors"))
    state = {k: v for f in files for k, v in load_file(f).items()}
    g = torch.Generator().manual_seed(0)
    other = {k: v + 1e-3 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state.items()}
    rng = random.Random(0)  # the same prompts and lengths for every mode: log-uniform in [lo, hi]
    lengths = [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]
    prompts = [encode_prompt(engine.tokenizer, f"What is {i} + {3 * i + 1}? Explain.") for i in range(n)]
    out = {}
    for mode in ("none", "keep", "recompute", "drain"):
        batching = ContinuousEngine(engine, update="keep" if mode == "none" else mode, seed=1)
        batching.generate(prompts[:2], 1, SamplingParams(max_tokens=8))  # warm-up
        t0 = last = time.perf_counter()
        nxt, tokens, loads, version = 0, 0, 0, engine.version
        while nxt < n or batching.in_flight():
            due = mode != "none" and time.perf_counter() - last >= every
            if due and not batching.draining:
                version += 1
                batching.load_tensors(iter((other if version % 2 else state).items()), version)
                last, loads = time.perf_counter(), loads + 1
            while nxt < n and batching.in_flight() < bound and not (due and mode == "drain"):
                batching.submit(str(nxt), prompts[nxt], 1, SamplingParams(max_tokens=lengths[nxt], ignore_eos=True))
                nxt += 1
            tokens += sum(len(c.token_ids) for _, o in batching.step() for c in o)
        out[mode] = {"tokens_per_s": tokens / (time.perf_counter() - t0), "loads": loads, "tokens": tokens}
    print("RESULT " + json.dumps(out))
"""
INFLIGHT = {"requests": 256, "lo": 16, "hi": 512, "bound": 32, "every_s": 3}


def inflight_rows(model_dir: Path | None = None) -> list[Result]:
    """The weight-update modes of continuous batching (rollout/engines/continuous.py) on SmolLM2-135M bf16: tokens/s
    with new weights every few seconds, long-tailed lengths (log-uniform 16-512 tokens), 32 sequences in flight,
    the same prompts and lengths for each mode, one engine. Limit: the same run with no update at all."""
    import json
    import subprocess
    import sys

    from mesh.layout import RunLayout
    from services.model_prep import prepare_smollm2

    model_dir = model_dir or prepare_smollm2(RunLayout(Path(".dapo")).smollm2)
    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-"))
    (tmp / "inflight.py").write_text(INFLIGHT_SCRIPT)
    env = os.environ | {
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "VLLM_CACHE_ROOT": str(tmp / "v"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    args = [str(INFLIGHT[k]) for k in ("requests", "lo", "hi", "bound", "every_s")]
    r = subprocess.run(
        [sys.executable, str(tmp / "inflight.py"), str(model_dir), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode:
        raise RuntimeError(f"bench.rollout in-flight updates: {r.stderr[-2000:]}")
    data = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    none = data["none"]["tokens_per_s"]
    what = (
        f"vllm SmolLM2-135M bf16, {INFLIGHT['requests']} requests of {INFLIGHT['lo']}-{INFLIGHT['hi']} tokens, "
        f"{INFLIGHT['bound']} in flight, new weights every {INFLIGHT['every_s']} s"
    )
    rows = [
        Result(
            "rollout",
            f"{what}: {mode} ({data[mode]['loads']} loads)",
            data[mode]["tokens_per_s"],
            none,
            "tokens/s",
            "the same stream, no weight update",
            "≥ 0.9" if mode == "keep" else "—",
        )
        for mode in ("keep", "recompute", "drain")
    ]
    keep, drain = data["keep"]["tokens_per_s"], data["drain"]["tokens_per_s"]
    rows.append(
        Result(
            "rollout",
            "in-flight updates: keep vs drain",
            keep,
            drain,
            "tokens/s",
            "drain: no admission, load when empty",
            "≥ 1.3",
        )
    )
    return rows


def smollm2() -> Path:
    from mesh.layout import RunLayout
    from services.model_prep import prepare_smollm2

    return prepare_smollm2(RunLayout(Path(".dapo")).smollm2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--dtypes", action="store_true", help="Only the bf16 vs fp32 rows, on SmolLM2-135M.")
    ap.add_argument("--inflight", action="store_true", help="Only the weight-update modes, on SmolLM2-135M.")
    args = ap.parse_args()
    if args.dtypes or args.inflight:
        print_table((dtype_rows() if args.dtypes else []) + (inflight_rows() if args.inflight else []))
    else:
        rows = run(args.engine, args.model)
        if args.model is None:  # the engine step is milliseconds on the random Llama (a GPU's case), longer here
            rows += run(args.engine, smollm2())
        print_table(rows + dtype_rows() + inflight_rows())


if __name__ == "__main__":
    main()
