"""The learner's share of the episode log (services/episode_log.py): a trained batch's groups with what only the
learner knows — each sample's advantage, each token's log-prob under the weights before the update (pi_prox) and its
loss mask.

    records = trained_records(batch, tensors, version, wants=log.wants)   # tensors: Trainer.last
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from learner.batching import BatchTensors
from services.episode_log import group_record, sample_record
from services.schemas import TrainBatch


def trained_records(
    batch: TrainBatch, t: BatchTensors, version: int, wants: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """A record per group `wants`, trained into `version`. Rows of `t` are the batch's samples in order (group by
    group, learner/batching.py to_tensors), each its prompt, then its response, then padding; pi_prox is 0 where the
    loss mask is 0 (not computed there)."""
    assert t.old_logp is not None and t.advantages is not None and t.loss_mask is not None
    records, row = [], 0
    for g in batch.groups:
        if wants(g.group_id):
            samples = []
            for i, (sample, score) in enumerate(zip(g.samples, g.scores, strict=True), start=row):
                end = int(t.attention_mask[i].sum())
                start = end - len(sample.response_token_ids)
                samples.append(
                    sample_record(
                        sample,
                        score.reward,
                        score.acc,
                        score.pred,
                        advantage=float(t.advantages[i]),
                        learner_logp=t.old_logp[i, start:end].tolist(),
                        loss_mask=t.loss_mask[i, start:end].tolist(),
                    )
                )
            records.append(group_record(g, "trained", version, batch_id=batch.batch_id, samples=samples))
        row += len(g.samples)
    return records
