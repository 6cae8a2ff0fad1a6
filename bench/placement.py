"""Placement: the learner's seconds per TrainBatch alone and beside a generating vLLM replica, per core placement,
and what the replica generates meanwhile. The real SmolLM2-135M-Instruct in the dtype `dapo-mesh up` runs (bf16
where the CPU has it).

    shared     the replica's OpenMP pool bound to every core, the learner on 1 thread (OMP_NUM_THREADS=1), unpinned
    shared-2t  the same, the learner on every core's thread too: both pools oversubscribe every core
    split      the learner pinned to the first half of the cores, the replica's pool to the other half

Limit: the learner alone on the same cores it gets in each placement (no replica running). The replica's rate
alone is the limit of its column. Run: `python -m bench.placement` (needs vllm; ~5 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Result, print_table

GEN = """
import json, sys, time
if __name__ == "__main__":
    from rollout.engines.vllm_chunked import VllmEngine
    from rollout.engines import SamplingParams, encode_prompt
    e = VllmEngine(sys.argv[1], kv_cache_gib=1, max_model_len=512, dtype=sys.argv[2], cpu_cores=sys.argv[3])
    prompts = [encode_prompt(e.tokenizer, f"What is {i} + {2 * i}?") for i in range(8)]
    while True:
        t0 = time.perf_counter()
        outs = e.generate(prompts, 8, SamplingParams(max_tokens=64))
        n = sum(len(c.token_ids) for o in outs for c in o)
        print(json.dumps({"t": time.time(), "tokens_per_s": n / (time.perf_counter() - t0)}), flush=True)
"""


class Generator:
    """A vLLM replica generating in a loop in its own process; its tokens/s over a time window."""

    def __init__(self, model_dir: Path, dtype: str, cores: str, tmp: Path):
        script = tmp / "gen.py"
        script.write_text(GEN)
        self.log = tmp / f"gen-{cores}.jsonl"
        env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "VLLM_CACHE_ROOT": str(tmp / "v")}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(model_dir), dtype, cores],
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.time() + 300
            while not self.rates(0):  # the engine is up and generating
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the vLLM generator did not start (exit code {self.proc.poll()})")
                time.sleep(1)
        except BaseException:
            self.stop()
            raise

    def rates(self, since: float) -> list[float]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        rows = [json.loads(x) for x in lines if x.startswith('{"t"')]  # vLLM logs to stdout too
        return [r["tokens_per_s"] for r in rows if r["t"] >= since]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def run(repeats: int = 1) -> list[Result]:
    from bench.learner import batch
    from learner.settings import LearnerSettings
    from learner.trainer import Trainer
    from mesh.commands import split_cores
    from mesh.layout import RunLayout
    from services.model_prep import prepare_smollm2

    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-"))
    model_dir = prepare_smollm2(RunLayout(Path(".dapo")).smollm2)
    trainer = Trainer(LearnerSettings(model_dir=model_dir, minibatches=2, warmup_batches=0))
    b = batch(trainer.engine.module.config.vocab_size)
    everything = os.sched_getaffinity(0)
    learner_cores, replica_cores = split_cores() or ("0", "0")
    all_cores = ",".join(str(c) for c in sorted(everything))

    def learner_seconds(cores: set[int], threads: int) -> float:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.train(b)
            best = min(best, time.perf_counter() - t0)
        os.sched_setaffinity(0, everything)
        return best

    mine = {int(c) for c in learner_cores.split(",")}
    trainer.train(b)  # warm-up
    alone = {"1t": learner_seconds(everything, 1), "all": learner_seconds(everything, len(everything))}
    alone["split"] = alone["1t"] if len(mine) == 1 else learner_seconds(mine, len(mine))
    print(f"bench.placement: the learner alone: {alone}", flush=True)
    results = []
    for name, gen_cores, cores, threads, limit in (
        ("shared", all_cores, everything, 1, alone["1t"]),
        ("shared-2t", all_cores, everything, len(everything), alone["all"]),
        ("split", replica_cores, mine, len(mine), alone["split"]),
    ):
        gen = Generator(model_dir, trainer.dtype, gen_cores, tmp)
        try:
            gen_alone = max(gen.rates(0)[-2:])
            time.sleep(15)
            gen_alone = max([gen_alone, *gen.rates(time.time() - 15)])
            t0 = time.time()
            seconds = learner_seconds(cores, threads)
            gen_during = gen.rates(t0)
        finally:
            gen.stop()
        during = sum(gen_during) / len(gen_during) if gen_during else float("nan")
        what = f"{name}: learner {threads} thr, replica on cores {gen_cores} ({trainer.dtype})"
        results += [
            Result(
                "placement",
                f"learner s/batch, {what}",
                seconds,
                limit,
                "s",
                "the learner alone, same threads",
                "≤ 1.15",
            ),
            Result(
                "placement",
                f"replica tokens/s, {what}",
                during,
                gen_alone,
                "tokens/s",
                "the replica alone, same cores",
                "—",
            ),
        ]
    return results


if __name__ == "__main__":
    print_table(run())
