"""Learner: seconds per TrainBatch through our DeepSpeed trainer vs raw torch on the same tokens, and its model-FLOP
utilisation against the GEMM rate this machine reaches in the same run, in bf16 and in fp32.

Ours: `Trainer.train` (old log-probs pass, advantages, DAPO loss, token-budget micro-batches, chunked log-probs,
DeepSpeed AdamW steps with fp32 master weights in bf16). Limit: a plain torch loop in the same dtype over the same
micro-batches: one no-grad forward (the old log-probs), then forward, full-logits log-probs, a masked-mean loss,
backward and a `torch.optim.AdamW` step per mini-batch, the weights themselves in that dtype (no master copy).
MFU: model FLOPs of a step (6·N per trained token + 2·N per old-log-prob token, N the matmul parameters) ÷ seconds ÷
the rate of a 2048x576 @ 576x1536 matmul in the same dtype on the same threads.
The model: SmolLM2-135M's shapes (30 layers, hidden 576, vocab 49,152) with random weights (speed does not depend
on the values), or `--model DIR`. The batch: 4 groups x 8 samples, 40-token prompts, responses of 6-96 tokens
(mean ~30), as the learning run's.
Run: `python -m bench.learner [--model DIR] [--dtype bf16 fp32] [--minibatches 2 4]` (the optimizer steps per batch:
each is a DeepSpeed step over fp32 master weights, a fixed cost per step).
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from bench.common import Result, print_table

GROUPS, G, PROMPT = 4, 8, 40
GEMM = (2048, 576, 1536)


def gemm_rate(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """FLOP/s of the GEMM above on this process's threads (best of a few timed rounds)."""
    m, k, n = GEMM
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            a @ b
            reps += 1
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0))
    return best


def smollm2_shaped(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def batch(vocab: int):  # type: ignore[no-untyped-def]
    from services.schemas import PromptTask, Sample, Score, ScoredGroup, TrainBatch

    rng = random.Random(0)
    groups = []
    for gi in range(GROUPS):
        task = PromptTask(
            task_id=f"b{gi}",
            prompt_id=f"b{gi}",
            prompt_token_ids=[rng.randrange(3, vocab) for _ in range(PROMPT)],
            ground_truth="1",
            verifier="dapo_math",
            data_source="bench",
            n_samples=G,
        )
        samples, scores = [], []
        for j in range(G):
            n = min(96, max(6, int(rng.expovariate(1 / 30))))
            samples.append(
                Sample(
                    response_token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    response_text="x",
                    logprobs=[-2.0] * n,
                    finish_reason="stop",
                    policy_version=0,
                )
            )
            scores.append(Score(reward=1.0 if j % 2 else -1.0, acc=j % 2 == 1))
        groups.append(ScoredGroup(task=task, samples=samples, scores=scores, replica_id="bench"))
    return TrainBatch.assemble(0, groups)


def _raw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, t, minibatches, micro) -> None:  # type: ignore[no-untyped-def]
    from learner.loss import token_logprobs

    with torch.no_grad():  # the old log-probs: one no-grad forward
        for idx in micro(torch.arange(len(t))):
            part = t.select(idx)
            token_logprobs(model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits, part.input_ids)
    for mb in minibatches:
        tokens = t.response_mask[mb].sum()
        for idx in micro(mb):
            part = t.select(idx)
            logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits
            loss = -(token_logprobs(logits, part.input_ids) * part.response_mask).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def matmul_params(model: torch.nn.Module) -> int:
    """N of the 6·N rule: every weight used in a matmul (a tied embedding counted once, as the lm_head)."""
    total = sum(p.numel() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if emb is head else total - emb.numel()


def run(
    model_dir: Path | None = None,
    dtypes: tuple[str, ...] = ("bf16", "fp32"),
    repeats: int = 2,
    steps: tuple[int, ...] = (4,),
) -> list[Result]:
    from learner.batching import minibatches, to_tensors
    from learner.settings import LearnerSettings
    from learner.trainer import Trainer

    model_dir = model_dir or smollm2_shaped(Path(tempfile.mkdtemp(prefix="dapo-bench-")) / "m")
    results = []
    for dtype, mb in [(d, n) for d in dtypes for n in steps]:
        s = LearnerSettings(model_dir=model_dir, minibatches=mb, warmup_batches=0, dtype=dtype)  # type: ignore[arg-type]
        trainer = Trainer(s)
        if trainer.dtype != dtype:
            print(f"bench.learner: {dtype} is not supported here, skipped")
            continue
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        raw_model = copy.deepcopy(trainer.engine.module).to(tdt)
        raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
        b = batch(trainer.engine.module.config.vocab_size)
        t = to_tensors(b, trainer.pad_id)
        micro = partial(trainer.micro, t=t)  # the same micro-batches as ours
        trainer.train(b), _raw_step(raw_model, raw_opt, t, minibatches(len(t), mb), micro)  # warm-up
        ours, raw = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.train(b)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _raw_step(raw_model, raw_opt, t, minibatches(len(t), mb), micro)
            raw.append(time.perf_counter() - t0)
        tokens = int(t.attention_mask.sum())
        flops = 8 * matmul_params(trainer.engine.module) * tokens  # 6·N·tokens trained + 2·N·tokens old log-probs
        rate = gemm_rate(tdt)
        what = f"{dtype}, {len(t)} samples, {tokens} tokens, {mb} steps, {torch.get_num_threads()} threads"
        results += [
            Result(
                "learner",
                f"s/batch, {what}",
                min(ours),
                min(raw),
                "s",
                "raw torch, same dtype: old-logp fwd + fwd/bwd + AdamW, same micro-batches",
                "≤ 1.15",
            ),
            Result(
                "learner",
                f"model FLOP/s, {what}",
                flops / min(ours),
                rate,
                "FLOP/s",
                f"{dtype} GEMM {GEMM[0]}x{GEMM[1]} @ {GEMM[1]}x{GEMM[2]} (MFU)",
                "≥ 0.40",
            ),
        ]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--minibatches", nargs="+", type=int, default=[4], help="optimizer steps per batch (presets: 4)")
    args = ap.parse_args()
    print_table(run(args.model, tuple(args.dtype), steps=tuple(args.minibatches)))


if __name__ == "__main__":
    main()
