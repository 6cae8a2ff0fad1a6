"""The whole mesh: trained tokens/s vs raw vLLM generate tokens/s; the async mesh vs a synchronous alternation.

Every run is `dapo-mesh up` as a user starts it (Mesh: Redis, reward server, buffer, learner, one vLLM replica,
weights broadcast), on the random tiny Llama of the other benchmarks, B prompts x G samples per step, no
dynamic sampling (a random model is never right, so every group would be filtered). Timed: from every service
ready to the last batch trained and held by the replica.

- async: the buffer dispatches up to (S+1)*B prompts ahead with S = 1, so the replica generates batch v+1
  while the learner trains batch v.
- sync: S = 0: the buffer dispatches the next B prompts only once the last batch is trained and broadcast;
  generate, then train, then generate: the same work, one stage at a time.
- limit of trained tokens/s: the same engine's raw `generate` tokens/s on the same prompts and cores.

Run: `python -m bench.mesh [--steps N]`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import Result, print_table
from mesh.layout import RunLayout
from services.ledger import read_ledger

STEPS, B, G, MAX_TOKENS = 8, 4, 4, 48


def mesh_run(run_dir: Path, staleness: int, steps: int) -> tuple[float, float]:
    """(seconds from ready to the last step held by the replica, response tokens trained)."""
    from mesh.config import MeshConfig
    from mesh.up import Mesh

    cfg = MeshConfig(
        run_dir=run_dir,
        steps=steps,
        tiny=True,
        engine="vllm",
        n_samples=G,
        batch_size=B,
        max_response_tokens=MAX_TOKENS,
        minibatches=1,
        lr=1e-4,
        max_restarts=0,
        max_staleness=staleness,
        buffer={"dynamic_sampling": False},
    )
    mesh = Mesh(cfg, say=lambda _: None)
    try:
        mesh.start()
        t0 = time.perf_counter()
        mesh.run()
        seconds = time.perf_counter() - t0
    finally:
        mesh.stop()
    return seconds, sum(e.metrics["response_tokens"] for e in read_ledger(RunLayout(run_dir).learner))


def raw_generate(model_dir: Path, steps: int) -> float:
    """Tokens/s of the engine alone on the mesh's prompts: B prompts x G samples per call, as the replica does."""
    from rollout.engines import SamplingParams, encode_prompt, load_engine
    from services.datasets import DEFAULT_DATASET_CONFIG, load_source

    engine = load_engine(model_dir, "vllm", kv_cache_gib=2)
    source = load_source("reasoning_gym:chain_sum", size=steps * B, eval_size=0, config=DEFAULT_DATASET_CONFIG)
    prompts = [encode_prompt(engine.tokenizer, source.train[i].prompt) for i in range(steps * B)]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    engine.generate(prompts[:B], G, params)  # warm-up
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        n = sum(
            len(c.token_ids)
            for k in range(0, len(prompts), B)
            for o in engine.generate(prompts[k : k + B], G, params)
            for c in o
        )
        best = max(best, n / (time.perf_counter() - t0))
    return best


def run(steps: int = STEPS) -> list[Result]:
    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-mesh-"))
    async_s, async_tokens = mesh_run(tmp / "async", 1, steps)
    sync_s, _ = mesh_run(tmp / "sync", 0, steps)
    raw = raw_generate(RunLayout(tmp / "async").tiny_model, steps)
    what = f"tiny Llama, vLLM, {steps} steps x {B} prompts x {G} samples, <= {MAX_TOKENS} tokens"
    return [
        Result(
            "mesh",
            f"trained tokens/s through the async mesh ({what})",
            async_tokens / async_s,
            raw,
            "tokens/s",
            "raw vLLM generate, same prompts and cores",
            "≥ 0.9",
        ),
        Result(
            "mesh",
            f"wall time of the async mesh (S=1) vs sync alternation (S=0) ({what})",
            async_s,
            sync_s,
            "s",
            "generate, then train, same work",
            "≤ 0.6",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    print_table(run(args.steps))


if __name__ == "__main__":
    main()
