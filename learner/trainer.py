"""The DAPO update on a DeepSpeed engine: one TrainBatch in, the weights moved, metrics out.

    trainer = Trainer(settings)              # loads the HF model, wraps it with deepspeed.initialize
    metrics = trainer.train(batch)           # old log-probs once, then `minibatches` optimizer steps

Per batch: advantages per group (Eq. 9), old log-probs with the current weights (no grad), then the
samples are shuffled into `minibatches` mini-batches, each one optimizer step over its micro-batches.
The loss of a micro-batch is normalised by the token count of its whole mini-batch (DAPO Eq. 8), so
DeepSpeed is told not to rescale by accumulation steps, and the mini-batch ends at `engine.step()`.

Speed (issue "fast on the hardware it has"): bf16 where the hardware has it (DeepSpeed bf16: bf16 weights and
matmuls, fp32 master weights and AdamW state; measured 1.5x faster than torch autocast over fp32 weights on
SmolLM2's shapes, which casts every weight at every forward); micro-batches by a token budget over length-sorted
samples (learner/batching.py), in both passes; log-probs from the hidden states, the lm_head applied a chunk of
positions at a time (learner/logprobs.py: no [B, T, V] tensor, fp32 log-softmax).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from learner import lora
from learner.advantages import group_advantages
from learner.batching import BatchTensors, episode_metrics, minibatches, to_tensors, token_microbatches
from learner.logprobs import chunked_logprobs, logits_transform
from learner.loss import LOSS_METRICS, loss_sequences, policy_loss, token_logprobs_and_entropy
from learner.offpolicy import gap_by_lag, gap_metrics, importance_weights, token_versions
from learner.parallel import all_sum, padded, split_rows, world
from learner.schedule import lr_factor
from learner.settings import LearnerSettings
from services.dtype import resolve_dtype
from services.redis_server import free_port
from services.schemas import TrainBatch

log = logging.getLogger(__name__)
STEP_METRICS = (*LOSS_METRICS, "loss")  # averaged over a batch's micro-batches, weighted by their tokens
PORT_TRIES = 5  # a one-process world's own store port, picked again when taken before it listened


def init_distributed(port: int = 0, timeout_s: float = 600.0) -> None:
    """A one-process world unless a launcher (torchrun, deepspeed) already described one. No collective waits
    longer than `timeout_s` (a dead rank fails the others instead of hanging them)."""
    import datetime

    import deepspeed

    ours = False  # the port is one we picked (free a moment ago): another process may take it before we listen
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        ours = not port and "MASTER_PORT" not in os.environ
        os.environ.setdefault("MASTER_PORT", str(port or free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    for attempt in range(PORT_TRIES):
        try:
            deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
            return
        except torch.distributed.DistNetworkError as e:  # EADDRINUSE: a replica's engine took it meanwhile
            if not ours or "EADDRINUSE" not in str(e) or attempt == PORT_TRIES - 1:
                raise
            log.warning("port %s was taken before the learner listened on it: another", os.environ["MASTER_PORT"])
            os.environ["MASTER_PORT"] = str(free_port())


class Trainer:
    def __init__(self, settings: LearnerSettings, model: torch.nn.Module | None = None):
        import deepspeed
        from transformers import AutoModelForCausalLM

        self.s = settings
        self.dtype = resolve_dtype(settings.dtype, log)
        init_distributed(settings.dist_port, settings.dist_timeout_s)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(
                settings.model_dir, dtype=torch.float32, attn_implementation=settings.attention
            )
        self.adapter = None  # LoRA: what the adapter is (rank, alpha, targets, the base model's fingerprint)
        if settings.lora_rank is not None:  # the adapter alone trains (learner/lora.py)
            model = lora.wrap(model, settings)
            self.adapter = lora.adapter_info(settings)
        config = getattr(model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else getattr(config, "eos_token_id", None) or 0)
        self.tokenizer = self._tokenizer()
        # the chunked log-probs apply the lm_head to the hidden states themselves, right only where the logits are
        # the head's output: ZeRO-3 (only a module call gathers the head) and a model that transforms its logits
        # after the head (soft-capping, a scale) take the model's own forward instead
        transform = logits_transform(config)
        self.full_logits = settings.zero_stage == 3 or transform is not None
        if transform is not None:
            log.info("%s: log-probs from the model's full forward (logits transformed after the head)", transform)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
        ds_config = {
            "train_micro_batch_size_per_gpu": settings.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,  # step() ends a mini-batch of any number of micro-batches
            "gradient_clipping": settings.grad_clip,
            "zero_optimization": {"stage": settings.zero_stage},
            "bf16": {"enabled": self.dtype == "bf16"},  # fp32 master weights and optimizer state
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        # no scheduler for DeepSpeed to step at each optimizer step: the LR is set per batch (learner/schedule.py)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.rank, self.world = world()  # data-parallel ranks: learner/parallel.py
        self._clip_norm = 0.0
        if self.world > 1 and settings.zero_stage == 0 and self.dtype == "fp32":
            self.engine.clip_fp32_gradients = self._clip_fp32  # the norm of the reduced gradients, for the metrics
        self.batches_done = 0  # the learner passes its version (batches in the weights) instead, restarts included
        self.device = self.engine.device
        self._entropy = 0.0
        self._gap: dict[str, float] = {}
        self.last: BatchTensors | None = None  # the last batch trained, as tensors, while the episode log records

    def _tokenizer(self) -> Any:
        if (
            not (self.s.model_dir / "tokenizer.json").exists()
            and not (self.s.model_dir / "tokenizer_config.json").exists()
        ):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.s.model_dir)

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt arrived as text but {self.s.model_dir} has no tokenizer")
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def micro(self, idx: torch.Tensor, t: BatchTensors) -> list[torch.Tensor]:
        """Micro-batches of rows `idx`: by the token budget over length-sorted rows (or fixed counts)."""
        return token_microbatches(idx, t.attention_mask.sum(-1), self.s.micro_batch_tokens, self.s.micro_batch_size)

    def units(self, idx: torch.Tensor, t: BatchTensors) -> list[torch.Tensor | None]:
        """This rank's micro-batches of rows `idx` (all of them on one rank): its share of the rows by tokens, cut
        by the budget, padded with None (a zero-weighted call) to as many as the busiest rank has."""
        if self.world == 1:
            return list(self.micro(idx, t))
        shares = split_rows(idx, t.attention_mask.sum(-1), self.world)
        return padded([self.micro(r, t) if len(r) else [] for r in shares], self.rank)

    @torch.no_grad()
    def logprobs(self, t: BatchTensors, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """Per-token log-probs of every row under the current weights ([N, T], aligned with input_ids; at the
        positions of `mask`, or of the responses, and 0 elsewhere), and the mean entropy over `mask` (the policy's
        entropy before this batch's updates)."""
        out = torch.zeros_like(t.behaviour_logp)
        ent = torch.zeros(2, dtype=torch.float64)  # entropy sum, token count
        # no LoRA dropout in pi_prox: the replicas sample without it (its modules alone: the base keeps its mode)
        dropouts = [m for n, m in self.engine.module.named_modules() if ".lora_dropout." in n and m.training]
        for m in dropouts:
            m.train(False)
        try:
            self._logprobs_all(t, mask, out, ent)
        finally:
            for m in dropouts:
                m.train(True)
        all_sum(out)
        all_sum(ent)
        return out, float(ent[0] / max(float(ent[1]), 1.0))

    def _logprobs_all(self, t: BatchTensors, mask: torch.Tensor | None, out: torch.Tensor, ent: torch.Tensor) -> None:
        wanted = t.response_mask if mask is None else mask
        rows = torch.arange(len(t))
        for idx in self.units(rows, t):  # this rank's micro-batches; the others' are summed in
            if idx is None and self.s.zero_stage != 3:
                continue
            part = t.select(rows[:1] if idx is None else idx)
            if idx is None:  # ZeRO-3: every forward gathers the weights collectively: as many as the other ranks
                self._logprobs(part, wanted[rows[:1], : part.input_ids.shape[1]])
                continue
            only = wanted[idx, : part.input_ids.shape[1]]
            logp, e = self._logprobs(part, only, with_entropy=mask is not None)
            out[idx, : logp.shape[1]] = logp.cpu()
            if e is not None:  # asked for only with a mask: `only` is that mask's part
                m = only.to(self.device)
                ent += torch.tensor([float((e * m).sum()), float(m.sum())], dtype=torch.float64)

    def _logprobs(
        self, part: BatchTensors, only: torch.Tensor, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 per-token log-probs (and entropies) of `part` at the positions of `only`, at each sample's own
        sampling temperature: pi_prox, pi_theta and the entropy are those of the distribution the rollout sampled
        from, as its behaviour log-probs are. The decoder's hidden states, then the lm_head a chunk at a time."""
        module = self.engine.module
        ids = part.input_ids.to(self.device)
        mask = part.attention_mask.to(self.device)
        if self.full_logits:  # see __init__: the model's own forward, and its logits
            logits = self.engine(input_ids=ids, attention_mask=mask).logits
            # in fp32, as the chunked path: a bf16 temperature is rounded (0.7 -> 0.6992), and so is the quotient
            temps = part.temperature.to(logits.device, torch.float32).view(-1, 1, 1)
            lp, ent = token_logprobs_and_entropy(logits.float() / temps, ids, with_entropy=with_entropy)
            keep = only.to(lp)
            return lp * keep, None if ent is None else ent * keep
        hidden = module.get_decoder()(input_ids=ids, attention_mask=mask)[0]
        return chunked_logprobs(
            hidden,
            module.get_output_embeddings(),
            ids,
            part.temperature,
            chunk=self.s.logprob_chunk,
            with_entropy=with_entropy,
            only=only,
        )

    def prepare(self, batch: TrainBatch, version: int | None = None) -> BatchTensors:
        """Tensors, advantages, the proximal log-probs, the off-policy weights; the behaviour/proximal gap in
        `self._gap` (per batch, and per version lag when the learner's `version` is given)."""
        s = self.s
        t = to_tensors(batch, self.pad_id, self._tokenize if self.tokenizer is not None else None)
        t.advantages = group_advantages(
            t.rewards, t.group_index, normalize_std=s.normalize_std, pool_mean=t.pool_mean, pool_std=t.pool_std
        )
        keep = (~t.truncated).float().unsqueeze(-1) if s.overlong_filter else 1.0
        t.loss_mask = t.response_mask * keep
        t.old_logp, self._entropy = self.logprobs(t, t.loss_mask)
        self._gap = gap_metrics(t.old_logp, t.behaviour_logp, t.loss_mask)
        if version is not None:
            self._gap |= gap_by_lag(t.old_logp, t.behaviour_logp, t.loss_mask, version - t.versions)
            self._gap |= token_versions(t.versions, t.response_mask, version)
        if s.off_policy != "off":  # weigh each token by pi_prox / pi_behav (the decoupled objective)
            t.is_weights, bound = importance_weights(
                t.old_logp, t.behaviour_logp, t.loss_mask, mode=s.off_policy, cap=s.off_policy_cap
            )
            self._gap["is_bound_frac"] = float(bound.sum()) / max(float((t.loss_mask > 0).sum()), 1.0)
            if s.off_policy == "token-mask":  # masked tokens leave the loss, its token count included
                t.loss_mask = t.loss_mask * (~bound)
        return t

    def train(self, batch: TrainBatch, version: int | None = None) -> dict[str, float]:
        """One batch; `version`: the learner's policy version now (for the gap per version lag)."""
        t0 = time.perf_counter()
        index = self.batches_done if version is None else version
        lr = self.set_lr(index)
        self.last = None
        t = self.prepare(batch, version)
        if self.s.record_episodes > 0:  # what the episode log records of it (learner/episodes.py); none: freed
            self.last = t
        sums = torch.zeros(len(STEP_METRICS) + 1, dtype=torch.float64)  # token-weighted sums, then the tokens
        grad_norms = []
        for mb in minibatches(len(t), self.s.minibatches, generator=self.shuffle(index)):
            assert t.loss_mask is not None
            tokens = float(t.loss_mask[mb].sum())  # the whole mini-batch's, on every rank (each holds the batch)
            if tokens == 0:  # every sample of this mini-batch filtered out
                continue
            seqs = int(loss_sequences(t.loss_mask[mb]))  # samples with a loss token left
            for idx in self.units(mb, t):
                part = t.select(mb[:1] if idx is None else idx)  # None: zero-weighted, as many calls as the others
                m, n = self._micro_step(part, tokens, seqs, weight=idx is not None)
                if idx is not None:
                    sums += torch.tensor([m[k] * n for k in STEP_METRICS] + [n], dtype=torch.float64)
            grad_norms.append(self._step())
        all_sum(sums)
        seconds = time.perf_counter() - t0
        weight = float(sums[-1])
        out = {k: float(v) / weight for k, v in zip(STEP_METRICS, sums.tolist(), strict=False)} if weight else {}
        out |= {
            "seconds": seconds,
            "tokens_per_s": t.response_tokens / seconds,
            "response_tokens": float(t.response_tokens),
            "grad_norm": max(grad_norms) if grad_norms else 0.0,
            "optimizer_steps": float(len(grad_norms)),  # fewer than --minibatches for a small or filtered batch
            "lr": lr,
            "reward_mean": float(t.rewards.mean()),
            "acc_mean": sum(sc.acc for g in batch.groups for sc in g.scores) / max(1, len(t)),
            "batch_samples": float(len(t)),
            "truncated_frac": float(t.truncated.float().mean()) if len(t) else 0.0,  # cut at the length bound
            "entropy": self._entropy,
        } | self._gap
        out |= episode_metrics(batch)
        return out

    def shuffle(self, index: int) -> torch.Generator:
        """The mini-batch shuffle of the batch trained after `index` others: a function of the seed and the index
        only, so a learner resumed from a checkpoint and a replay of the recorded batches draw the same."""
        return torch.Generator().manual_seed(self.s.seed * 1_000_003 + index)

    def set_lr(self, batches_done: int) -> float:
        """The LR of the next batch, from the number of batches trained before it."""
        s = self.s
        lr = s.lr * lr_factor(
            batches_done,
            warmup=s.warmup_batches,
            schedule=s.lr_schedule,
            decay=s.lr_decay_batches or (None if s.max_batches is None else max(1, s.max_batches - s.warmup_batches)),
            min_ratio=s.lr_min_ratio,
        )
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.batches_done = batches_done + 1
        return lr

    def _step(self) -> float:
        """Optimizer step; returns the gradient norm before clipping."""
        if self.s.zero_stage == 0 and self.dtype == "fp32" and self.world > 1:
            self.engine.step()  # reduces over the ranks, then clips through _clip_fp32
            return self._clip_norm
        if self.s.zero_stage == 0 and self.dtype == "fp32":  # DeepSpeed keeps no norm on this path: take it here
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            self.engine.step()
            return norm
        self.engine.step()
        return float(self.engine.get_global_grad_norm() or 0.0)

    def _clip_fp32(self) -> None:
        """DeepSpeed's fp32 clip (ZeRO-0 over several ranks: after the all-reduce), keeping the norm it found."""
        from deepspeed.runtime.utils import clip_grad_norm_

        engine = self.engine
        norm = clip_grad_norm_(
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
        )
        self._clip_norm = float(norm)

    def _micro_step(
        self, part: BatchTensors, tokens: float, seqs: int, weight: bool = True
    ) -> tuple[dict[str, float], float]:
        """Forward and backward of one micro-batch. The loss is scaled by the world size (DeepSpeed averages the
        ranks' gradients; each loss is already a share of the whole mini-batch's); `weight` False: by 0."""
        assert part.old_logp is not None and part.advantages is not None and part.loss_mask is not None
        logp = self._logprobs(part, part.loss_mask)[0]
        dev = self.device
        loss, m = policy_loss(
            logp,
            part.old_logp.to(dev),
            part.advantages.to(dev),
            part.loss_mask.to(dev),
            clip_low=self.s.clip_low,
            clip_high=self.s.clip_high,
            clip_c=self.s.clip_c,
            agg=self.s.loss_agg,
            global_tokens=tokens,
            global_seqs=seqs,
            norm_len=self.s.max_response_tokens,
            is_weights=None if part.is_weights is None else part.is_weights.to(dev),
        )
        self.engine.backward(loss * (self.world if weight else 0.0), scale_wrt_gas=False)
        m["loss"] = float(loss.detach()) * tokens / max(float(part.loss_mask.sum()), 1.0)  # this part's token-mean
        return m, float(part.loss_mask.sum())

    def sequence_logprob(self, batch: TrainBatch) -> torch.Tensor:
        """Sum of response-token log-probs of each sample under the current weights (for tests and eval)."""
        t = to_tensors(batch, self.pad_id)
        return (self.logprobs(t)[0] * t.response_mask).sum(-1)
