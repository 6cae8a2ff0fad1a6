"""TrainBatch -> padded tensors, and the mini-/micro-batch split.

Each sample becomes one row: prompt token ids then response token ids, right-padded. Everything
is aligned with `input_ids` positions: `response_mask[i, t]` is 1 where token t is a response token the model
sampled (an episode's environment turns sit in the response as context, with 0: no loss, no log-prob),
`behaviour_logp[i, t]` is the rollout's log-prob of that token (see loss.token_logprobs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

from services.schemas import TrainBatch

Tokenize = Callable[[str], list[int]]


@dataclass
class BatchTensors:
    input_ids: torch.Tensor  # [N, T] long
    attention_mask: torch.Tensor  # [N, T] long
    response_mask: torch.Tensor  # [N, T] float
    behaviour_logp: torch.Tensor  # [N, T] float
    rewards: torch.Tensor  # [N] float
    group_index: torch.Tensor  # [N] long
    truncated: torch.Tensor  # [N] bool
    versions: torch.Tensor  # [N, T] long: policy version that sampled each response token (0 elsewhere)
    temperature: torch.Tensor  # [N] float: the sampling temperature, applied to the learner's logits (greedy: 1)
    pool_mean: torch.Tensor | None = None  # [N] float: the group's baseline over every sample drawn (NaN: none)
    pool_std: torch.Tensor | None = None  # [N] float: ... its spread (GroupSampling, the balanced rule)
    # filled in by the trainer before the updates:
    old_logp: torch.Tensor | None = None  # [N, T] log-probs under the weights before this batch
    advantages: torch.Tensor | None = None  # [N]
    loss_mask: torch.Tensor | None = None  # [N, T] response_mask, minus filtered samples
    is_weights: torch.Tensor | None = None  # [N, T] truncated importance weights

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, idx: torch.Tensor | slice) -> BatchTensors:
        """Rows `idx`, trimmed to the longest of them (less padding per micro-batch)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        part = BatchTensors(**{k: v if v is None else v[idx] for k, v in values.items()})  # type: ignore[arg-type]
        width = int(part.attention_mask.sum(-1).max()) if len(part) else 0
        for k, v in vars(part).items():
            if v is not None and v.ndim == 2:
                setattr(part, k, v[:, :width])
        return part

    @property
    def response_tokens(self) -> int:
        return int(self.response_mask.sum())


def to_tensors(batch: TrainBatch, pad_id: int, tokenize: Tokenize | None = None) -> BatchTensors:
    """`tokenize` is used only for prompts that arrive as text without token ids."""
    rows: list[tuple[list[int], list[int], list[float], list[int], list[int]]] = []
    rewards, groups, truncated, temps, pool_mean, pool_std = [], [], [], [], [], []
    nan = float("nan")
    for gi, group in enumerate(batch.groups):
        pooled = group.sampling if group.sampling is not None and group.sampling.pool_mean is not None else None
        task = group.task
        if task.prompt_token_ids is not None:
            prompt = task.prompt_token_ids.tolist()
        elif tokenize is not None and task.prompt is not None:
            prompt = tokenize(task.prompt)
        else:
            raise ValueError(f"group {task.task_id}: no prompt_token_ids and no tokenizer to make them")
        for sample, score in zip(group.samples, group.scores, strict=True):
            ids = sample.response_token_ids.tolist()
            rows.append((prompt, ids, sample.logprobs.tolist(), sample.token_versions(), sample.loss_mask()))
            rewards.append(score.reward)
            groups.append(gi)
            truncated.append(sample.truncated)
            temps.append(sample.temperature if sample.temperature > 0 else 1.0)
            pool_mean.append(pooled.pool_mean if pooled is not None else nan)
            pool_std.append(pooled.pool_std if pooled is not None and pooled.pool_std is not None else nan)
    width = max(len(p) + len(r) for p, r, _, _, _ in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response = torch.zeros((n, width), dtype=torch.float32)
    behaviour = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.zeros((n, width), dtype=torch.long)
    for i, (p, r, lp, vs, mask) in enumerate(rows):
        end = len(p) + len(r)
        input_ids[i, :end] = torch.tensor(p + r, dtype=torch.long)
        attention[i, :end] = 1
        response[i, len(p) : end] = torch.tensor(mask, dtype=torch.float32)
        behaviour[i, len(p) : end] = torch.tensor(lp, dtype=torch.float32) * response[i, len(p) : end]
        versions[i, len(p) : end] = torch.tensor(vs, dtype=torch.long)
    return BatchTensors(
        input_ids,
        attention,
        response,
        behaviour,
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(groups, dtype=torch.long),
        torch.tensor(truncated, dtype=torch.bool),
        versions,
        torch.tensor(temps, dtype=torch.float32),
        torch.tensor(pool_mean, dtype=torch.float32),
        torch.tensor(pool_std, dtype=torch.float32),
    )


def episode_metrics(batch: TrainBatch) -> dict[str, float]:
    """How the batch's episodes went (none: {}): model turns per episode, the fraction cut at --max-episode-tokens
    or max_turns (truncated), tool calls per episode by outcome, and the share of their time spent waiting for the
    environment rather than in the engine."""
    eps = [s.episode for g in batch.groups for s in g.samples if s.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    waited, generated = sum(e.env_seconds for e in eps), sum(e.generate_seconds for e in eps)
    calls = Counter[str]()
    for e in eps:
        calls.update(e.tool_calls)
    return {
        "episode_turns": sum(e.model_turns for e in eps) / n,
        "episode_truncated_frac": sum(e.ended != "done" for e in eps) / n,
        "env_wait_frac": waited / (waited + generated) if waited + generated > 0 else 0.0,
        **{f"tool_calls/{k}": calls.get(k, 0) / n for k in ("valid", "malformed", "unknown", "failed")},
    }


def minibatches(n: int, count: int, *, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Split row indices 0..n-1, shuffled, into `count` near-equal mini-batches (one optimizer step each)."""
    count = max(1, min(count, n))
    order = torch.randperm(n, generator=generator)
    return [chunk for chunk in torch.tensor_split(order, count) if len(chunk)]


def microbatches(idx: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """Consecutive chunks of `size` rows (gradient accumulation within one mini-batch)."""
    for start in range(0, len(idx), size):
        yield idx[start : start + size]


def token_microbatches(
    idx: torch.Tensor, lengths: torch.Tensor, budget: int, max_rows: int | None = None
) -> list[torch.Tensor]:
    """Rows `idx` sorted longest first and cut into micro-batches whose padded size (rows x longest) fits `budget`
    tokens, `max_rows` rows at most; a row longer than the budget is a micro-batch of its own. Padding is what a
    short row costs beside a long one: sorted, neighbours have near-equal lengths. `budget` 0: `microbatches`."""
    if budget <= 0:
        return list(microbatches(idx, max_rows or len(idx) or 1))
    order = idx[torch.argsort(lengths[idx], descending=True, stable=True)].tolist()
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if cur is None or (len(cur) + 1) * int(lengths[cur[0]]) > budget or len(cur) == max_rows:
            out.append([i])
        else:
            cur.append(i)
    return [torch.tensor(rows, dtype=torch.long) for rows in out]
