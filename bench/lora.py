"""LoRA (issue 31): what an adapter saves and costs, full weights vs adapters of rank 8, 32 and 128, same run.

sync      bytes and seconds per weight-sync round (`WeightSender.publish`: pack, checksum, gloo broadcast, the
          receiver verifies and acknowledges) to one replica process running the real `WeightReceiver`, which checks
          the adapter against its base model; limit: the full model's round (ratio = LoRA / full).
learner   seconds per TrainBatch (`Trainer.train`, bf16 where the CPU has it) and the process's peak RSS, full
          fine-tuning vs a rank-32 adapter, each in a fresh process; limit: full fine-tuning.
replica   tokens/s of the vLLM engine serving an adapter (rank 32, the seven projections) ÷ the same engine without
          one: served by vLLM's LoRA layers (what its CPU kernels cost here), and merged into the weights; on
          SmolLM2-135M-Instruct itself (vLLM needs its tokenizer).

The model: SmolLM2-135M's shapes with random weights (bench/learner.py; speed does not depend on the values).
Run: `python -m bench.lora` (about 6 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Result, print_table
from bench.learner import batch, smollm2_shaped

RANKS = (8, 32, 128)
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _module(model_dir: Path, rank: int | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from learner.lora import wrap
    from learner.settings import LearnerSettings

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if rank is None:
        return model
    return wrap(model, LearnerSettings(model_dir=model_dir, lora_rank=rank, lora_targets=TARGETS))  # type: ignore[no-any-return]


def sync_rows(model_dir: Path, repeats: int = 5) -> list[Result]:
    from prometheus_client import CollectorRegistry

    from learner.settings import LearnerSettings
    from learner.weight_sync import WeightSender
    from services.redis_server import EmbeddedRedis
    from services.streams import REPLICA_KEY_PREFIX, connect

    timed: dict[int | None, tuple[float, int]] = {}
    with EmbeddedRedis(Path(tempfile.mkdtemp(prefix="dapo-bench-"))) as server:
        client = connect(server.url)
        for rank in (None, *RANKS):
            s = LearnerSettings(model_dir=model_dir, sync_port=0, sync_timeout_s=120, lora_rank=rank)
            sender = WeightSender(s, client, _module(model_dir, rank), CollectorRegistry())
            name = f"lora-{rank or 'full'}"
            args = ["--receiver", name, server.url, str(model_dir), str(rank or 0)]
            proc = subprocess.Popen([sys.executable, "-m", "bench.lora", *args], env=ENV)
            try:
                while not client.exists(REPLICA_KEY_PREFIX + name):
                    time.sleep(0.1)
                sender.publish(0)  # forms the group and allocates the receiver's buckets
                times = []
                for v in range(1, repeats + 1):
                    t0 = time.perf_counter()
                    wv = sender.publish(v)
                    times.append(time.perf_counter() - t0)
                    assert wv.replicas == [name], wv
                timed[rank] = (statistics.median(times), sender.manifest.nbytes)
            finally:
                sender.close()
                proc.kill()
                proc.wait()
                client.delete(REPLICA_KEY_PREFIX + name)
    full_s, full_b = timed[None]
    rows = []
    for rank in RANKS:
        sec, nbytes = timed[rank]
        rows += [
            Result(
                "lora",
                f"sync bytes, rank {rank} (fp32: peft keeps adapters in fp32)",
                nbytes,
                full_b,
                "B",
                "the full model's round, bf16",
            ),
            Result("lora", f"sync s/round, rank {rank} → 1 replica", sec, full_s, "s", "the full model's round"),
        ]
    return rows


def learner_once(model_dir: Path, rank: int | None, repeats: int = 1) -> dict[str, float]:
    """In this process: seconds per batch (best of `repeats` after a warm-up) and the peak RSS."""
    from learner.settings import LearnerSettings
    from learner.trainer import Trainer

    s = LearnerSettings(
        model_dir=model_dir, minibatches=4, warmup_batches=0, dtype="bf16", lora_rank=rank, lora_targets=TARGETS
    )
    trainer = Trainer(s)
    b = batch(trainer.engine.module.config.vocab_size)
    trainer.train(b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        trainer.train(b)
        best = min(best, time.perf_counter() - t0)
    trainable = sum(p.numel() for p in trainer.engine.module.parameters() if p.requires_grad)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": best, "peak_bytes": float(peak), "trainable": float(trainable), "dtype": trainer.dtype}


def learner_rows(model_dir: Path) -> list[Result]:
    got = {}
    for rank in (None, 32):
        cmd = [sys.executable, "-m", "bench.lora", "--learner", str(model_dir), str(rank or 0)]
        out = subprocess.run(cmd, env=ENV | {"OMP_NUM_THREADS": "2"}, capture_output=True, text=True, check=True)
        got[rank] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lora = got[None], got[32]
    return [
        Result(
            "lora",
            f"learner s/batch, rank 32 ({lora['dtype']}, 32 samples)",
            lora["seconds"],
            full["seconds"],
            "s",
            "full fine-tuning, same batch",
        ),
        Result(
            "lora",
            "learner peak RSS, rank 32",
            lora["peak_bytes"] / 2**20,
            full["peak_bytes"] / 2**20,
            "MiB",
            "full fine-tuning (fp32 master weights + AdamW state of every weight)",
        ),
        Result(
            "lora", "trainable parameters, rank 32", lora["trainable"], full["trainable"], "params", "full fine-tuning"
        ),
    ]


REPLICA = """
import json, sys, time
if __name__ == "__main__":
    from rollout.engines import SamplingParams
    from rollout.engines.vllm_chunked import VllmEngine
    from services.adapters import AdapterInfo, fingerprint
    from services.dtype import resolve_dtype
    model, adapter, rank, serving = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    engine = VllmEngine(model, kv_cache_gib=1, max_model_len=512, dtype=resolve_dtype("auto"),
                        lora_max_rank=rank or None, lora_serving=serving)
    if rank:
        from safetensors.torch import load_file
        info = AdapterInfo(fingerprint(model), rank, 2.0 * rank, tuple("%TARGETS%".split(",")))
        engine.load_tensors(iter(load_file(adapter + "/adapter_model.safetensors").items()), 1, adapter=info)
    prompts = [[5 + i, 17, 99, 3, 200, 41, 7, 8] for i in range(16)]
    params = SamplingParams(max_tokens=64, seed=1, ignore_eos=True)
    engine.generate(prompts, 1, params)
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, 1, params)
        best = max(best, sum(len(c.token_ids) for o in outs for c in o) / (time.perf_counter() - t0))
    print("RESULT " + json.dumps([best, engine.dtype]))
""".replace("%TARGETS%", TARGETS)


def replica_rows(model_dir: Path) -> list[Result]:
    from services.adapters import ADAPTER_WEIGHTS

    scratch = Path(tempfile.mkdtemp(prefix="dapo-bench-"))
    adapter = scratch / "adapter"
    wrapped = _module(model_dir, 32)
    with torch.no_grad():  # a non-zero adapter: B = 0 might be skipped by a kernel
        for n, p in wrapped.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.01)
    wrapped.save_pretrained(adapter)
    assert (adapter / ADAPTER_WEIGHTS).exists()
    script = scratch / "replica.py"
    script.write_text(REPLICA)
    env = os.environ | {"PYTHONPATH": ENV["PYTHONPATH"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    rates, dtype = {}, ""
    for rank, serving in ((0, "vllm"), (32, "vllm"), (32, "merge")):
        cmd = [sys.executable, str(script), str(model_dir), str(adapter), str(rank), serving]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        rate, dtype = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        rates[(rank, serving)] = rate
    base = rates[(0, "vllm")]
    return [
        Result(
            "lora",
            f"replica tokens/s, rank 32 served by vLLM's LoRA ({dtype}, 16 x 64 tokens)",
            rates[(32, "vllm")],
            base,
            "tok/s",
            "the same engine without LoRA",
            "≥ 0.7",
        ),
        Result(
            "lora",
            f"replica tokens/s, rank 32 merged into the weights ({dtype})",
            rates[(32, "merge")],
            base,
            "tok/s",
            "the same engine without LoRA",
            "≥ 0.95",
        ),
    ]


def run() -> list[Result]:
    from mesh.layout import RunLayout
    from services.model_prep import prepare_smollm2

    model_dir = smollm2_shaped(Path(tempfile.mkdtemp(prefix="dapo-bench-")) / "m")
    rows = sync_rows(model_dir) + learner_rows(model_dir)
    print_table(rows)  # before the engines start: a failure there loses nothing measured
    return rows + replica_rows(prepare_smollm2(RunLayout(Path(".dapo")).smollm2))  # vLLM needs its tokenizer


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--receiver":
        from bench.weight_sync import receiver

        rank = int(sys.argv[5])
        receiver(sys.argv[2], sys.argv[3], model_dir=sys.argv[4], lora_max_rank=rank or None)
    elif len(sys.argv) == 4 and sys.argv[1] == "--learner":
        print(json.dumps(learner_once(Path(sys.argv[2]), int(sys.argv[3]) or None)))
    else:
        print_table(run())
