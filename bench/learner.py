"""Learner: seconds per TrainBatch through our DeepSpeed trainer vs raw torch on the same tokens.

Ours: `Trainer.train` (old log-probs pass, advantages, DAPO loss, DeepSpeed ZeRO-0 AdamW steps).
Limit: a plain torch loop over the same micro-batches: forward, token log-probs, a masked mean
loss, backward, `torch.optim.AdamW` step per mini-batch. Same model, same tokens, same run.
Run: `python -m bench.learner [--model DIR]` (default: a random Llama with SmolLM2's vocabulary).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Result, print_table

GROUPS, G, PROMPT, RESPONSE, MINIBATCHES, MICRO = 4, 4, 32, 96, 4, 4


def _batch():  # type: ignore[no-untyped-def]
    from learner.tiny import group
    from services.common.schemas import TrainBatch

    rewards = [1.0, -1.0, 1.0, -1.0]
    return TrainBatch.assemble(0, [group(i, rewards, prompt_len=PROMPT, resp_len=RESPONSE) for i in range(GROUPS)])


def _raw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, t, minibatches, old_pass: bool = False) -> None:  # type: ignore[no-untyped-def]
    from learner.batching import microbatches
    from learner.loss import token_logprobs

    if old_pass:  # what the algorithm itself adds: one no-grad forward for the old log-probs
        with torch.no_grad():
            for idx in microbatches(torch.arange(len(t)), MICRO):
                part = t.select(idx)
                token_logprobs(
                    model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits, part.input_ids
                )

    for mb in minibatches:
        tokens = t.response_mask[mb].sum()
        for idx in microbatches(mb, MICRO):
            part = t.select(idx)
            logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits
            loss = -(token_logprobs(logits, part.input_ids) * part.response_mask).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def run(model_dir: Path | None = None, repeats: int = 3) -> list[Result]:
    from learner.batching import minibatches, to_tensors
    from learner.settings import LearnerSettings
    from learner.trainer import Trainer

    if model_dir is None:
        from learner.tiny import tiny_llama

        model_dir = tiny_llama(Path(tempfile.mkdtemp(prefix="dapo-bench-")) / "m", layers=4, hidden=256, vocab=49152)
    s = LearnerSettings(model_dir=model_dir, minibatches=MINIBATCHES, micro_batch_size=MICRO, warmup_batches=0)
    trainer = Trainer(s)
    raw_model = copy.deepcopy(trainer.engine.module)
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    batch = _batch()
    t = to_tensors(batch, trainer.pad_id)
    trainer.train(batch), _raw_step(raw_model, raw_opt, t, minibatches(len(t), MINIBATCHES))  # warm-up
    ours, raw, raw_old = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        trainer.train(batch)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _raw_step(raw_model, raw_opt, t, minibatches(len(t), MINIBATCHES))
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _raw_step(raw_model, raw_opt, t, minibatches(len(t), MINIBATCHES), old_pass=True)
        raw_old.append(time.perf_counter() - t0)
    what = f"s/batch, {GROUPS * G} samples x {PROMPT}+{RESPONSE} tok, {MINIBATCHES} steps"
    return [
        Result("learner", what, min(ours), min(raw), "s", "raw torch fwd+bwd+AdamW, same micro-batches", "≤ 1.15"),
        Result("learner", what, min(ours), min(raw_old), "s", "the same + one no-grad fwd (old log-probs)", "≤ 1.15"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None)
    print_table(run(ap.parse_args().model))


if __name__ == "__main__":
    main()
