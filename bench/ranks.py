"""Learner ranks: does splitting the learner over processes pay on this machine, and what ZeRO-3 costs the weight
sync.

Rows (the same batch as bench.learner: 4 groups x 8 samples on SmolLM2-135M's shapes, bf16 where the CPU has it):
- s/batch of 2 ranks x 1 thread (ZeRO-0) against 1 rank x 2 threads: the same cores, split by process or by thread.
- s/batch of 2 ranks x 1 thread against half of 1 rank x 1 thread: the scaling efficiency is 1 / ratio.
- ZeRO-3 on 2 ranks against ZeRO-0 on 1: s/batch, and the weight sync's gather + pack of every bucket (the send
  itself is the same bytes either way: bench.weight_sync).
Each configuration runs under torchrun (gloo); rank 0 times it after a warm-up batch, between barriers.
Run: `python -m bench.ranks [--dtype bf16] [--repeats 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Result, print_table
from bench.learner import batch, smollm2_shaped

CONFIGS = {  # name: (ranks, threads per rank, ZeRO stage)
    "1x2": (1, 2, 0),
    "1x1": (1, 1, 0),
    "2x1": (2, 1, 0),
    "2x1-zero3": (2, 1, 3),
}


def worker(model_dir: Path, dtype: str, stage: int, repeats: int, out: Path) -> None:
    """One rank: time `repeats` batches and the weight-sync packing; rank 0 writes the seconds to `out`."""
    import deepspeed
    import torch.distributed as dist

    from learner.parallel import barrier
    from learner.settings import LearnerSettings
    from learner.trainer import Trainer
    from services.weight_wire import Manifest

    s = LearnerSettings(model_dir=model_dir, minibatches=4, warmup_batches=0, dtype=dtype, zero_stage=stage)  # type: ignore[arg-type]
    trainer = Trainer(s)
    b = batch(trainer.engine.module.config.vocab_size)
    trainer.train(b, version=0)  # warm-up
    seconds = []
    for v in range(repeats):
        barrier()
        t0 = time.perf_counter()
        trainer.train(b, version=v + 1)
        barrier()
        seconds.append(time.perf_counter() - t0)
    named = list(trainer.engine.module.named_parameters())
    specs = [(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape))) for n, p in named]
    manifest = Manifest.plan(specs, 64 * 2**20)
    barrier()
    t0 = time.perf_counter()
    for _, idx in manifest.buckets:  # what WeightSender._pack does for every bucket of a round
        params = [named[i][1] for i in idx]
        buf = torch.empty(sum(p.ds_numel if stage == 3 else p.numel() for p in params), dtype=params[0].dtype)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3), torch.no_grad():
            off = 0
            for p in params:
                buf[off : off + p.numel()].copy_(p.data.reshape(-1))
                off += p.numel()
    barrier()
    pack = time.perf_counter() - t0
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"batch_s": min(seconds), "pack_s": pack, "threads": torch.get_num_threads()}))


def measure(name: str, model_dir: Path, dtype: str, repeats: int) -> dict[str, float]:
    ranks, threads, stage = CONFIGS[name]
    out = Path(tempfile.mkdtemp(prefix="dapo-bench-ranks-")) / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "bench.ranks",
        "--worker",
        "--model",
        str(model_dir),
        "--dtype",
        dtype,
        "--stage",
        str(stage),
        "--repeats",
        str(repeats),
        "--out",
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    subprocess.run(cmd, check=True, env=env | {"OMP_NUM_THREADS": str(threads)}, timeout=1800)
    return dict(json.loads(out.read_text()))


def run(model_dir: Path | None = None, dtype: str = "bf16", repeats: int = 2) -> list[Result]:
    model_dir = model_dir or smollm2_shaped(Path(tempfile.mkdtemp(prefix="dapo-bench-")) / "m")
    m = {name: measure(name, model_dir, dtype, repeats) for name in CONFIGS}
    what = f"{dtype}, 32 samples, 4 steps"
    return [
        Result(
            "ranks",
            f"s/batch, 2 ranks x 1 thread, {what}",
            m["2x1"]["batch_s"],
            m["1x2"]["batch_s"],
            "s",
            "1 rank x 2 threads, same cores",
            "≤ 1.0",
        ),
        Result(
            "ranks",
            f"s/batch, 2 ranks x 1 thread, {what}",
            m["2x1"]["batch_s"],
            m["1x1"]["batch_s"] / 2,
            "s",
            "1 rank x 1 thread / 2 (perfect scaling; efficiency = 1 / ratio)",
            "≤ 1.25",
        ),
        Result(
            "ranks",
            f"s/batch, ZeRO-3 on 2 ranks x 1 thread, {what}",
            m["2x1-zero3"]["batch_s"],
            m["2x1"]["batch_s"],
            "s",
            "ZeRO-0 on 2 ranks x 1 thread",
            "",
        ),
        Result(
            "ranks",
            f"weight-sync gather + pack, ZeRO-3 on 2 ranks, {dtype}",
            m["2x1-zero3"]["pack_s"],
            m["2x1"]["pack_s"],
            "s",
            "ZeRO-0 on 2 ranks (no gather)",
            "",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from learner.parallel import shutdown

        try:
            worker(args.model, args.dtype, args.stage, args.repeats, args.out)
        finally:
            shutdown()
        return
    print_table(run(args.model, args.dtype, args.repeats))


if __name__ == "__main__":
    main()
