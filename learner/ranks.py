"""The learner service on N ranks: rank 0 is the service, the other ranks follow it.

    torchrun --nproc-per-node 2 -m learner --model-dir M --redis-url URL ...     # or: dapo-mesh up --learner-ranks 2

Rank 0 alone talks to Redis and HTTP, writes the ledger, records batches, acknowledges and sends the weights to the
replicas (learner/service.py, learner/runner.py). Every step that needs all ranks goes through `Leader`: rank 0
broadcasts a command (msgpack bytes: learner/parallel.broadcast_bytes, no pickle) and takes the step; each other
rank, in `follow`, receives it and takes the same step:

    train    the TrainBatch (its wire bytes) at a version      every rank trains its share (learner/parallel.py)
    export   the HF snapshot of a version                       ZeRO-3: gathered on every rank, written by rank 0
    save     a checkpoint with the learner's state              every rank writes its shard, then all meet (barrier)
    gather   the parameters of one weight-sync bucket           ZeRO-3: all-gathered for rank 0 to send
    start    the version rank 0 resumed from                    each rank checks it loaded the same checkpoint
    idle     nothing (rank 0 waited for a batch)                keeps the followers' wait under the group timeout
    stop     rank 0 is done

Rank 0 acknowledges a batch only after `save` returned on every rank (the barrier), so a checkpoint that holds it
exists for every rank before Redis forgets it. A rank that dies makes the others fail (torchrun stops the group;
a collective waits at most --dist-timeout-s), and the restarted group resumes from the last checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgpack
import torch

from learner import checkpoint
from learner.checkpoint import LearnerState
from learner.parallel import broadcast_bytes
from learner.trainer import Trainer
from learner.weight_sync import zero3_gather
from services.schemas import TrainBatch
from services.streams import pack, unpack

log = logging.getLogger(__name__)


class Leader:
    """Rank 0's side: each collective step is told to the followers, then taken here. With one rank: just taken."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.size = trainer.world

    def tell(self, op: str, **fields: Any) -> None:
        if self.size > 1:
            broadcast_bytes(msgpack.packb({"op": op, **fields}))

    def train(self, batch: TrainBatch, version: int) -> dict[str, float]:
        if self.size > 1:  # (packed only to be sent)
            self.tell("train", version=version, batch=pack(batch))
        return self.trainer.train(batch, version=version)

    def export(self, hf_dir: Path, version: int, keep: int) -> Path:
        self.tell("export", version=version)
        t = self.trainer
        return checkpoint.export_hf(t.engine, hf_dir, version, tokenizer=t.tokenizer, keep=keep, adapter=t.adapter)

    def save(self, run_dir: Path, state: LearnerState, keep: int) -> str:
        self.tell("save", state=asdict(state), keep=keep)
        return checkpoint.save(self.trainer.engine, run_dir, state, keep=keep)

    def gather(self, index: list[int], params: list[torch.nn.Parameter]) -> Any:
        """ZeRO-3: the full values of `params` (their positions in the module: `index`) on this rank, for a while."""
        self.tell("gather", index=index)
        return zero3_gather(index, params)

    def start(self, version: int) -> None:
        """After every rank loaded the newest checkpoint: the version rank 0 resumes from, which each rank checks."""
        self.tell("start", version=version)

    def idle(self) -> None:
        self.tell("idle")

    def stop(self) -> None:
        self.tell("stop")


def follow(trainer: Trainer, run_dir: Path, version: int) -> int:
    """A rank > 0 that loaded `version`: take rank 0's collective steps until it says stop; the batches trained."""
    first = msgpack.unpackb(broadcast_bytes(None))
    if first != {"op": "start", "version": version}:
        raise RuntimeError(
            f"rank {trainer.rank} resumed from version {version}, rank 0 from {first.get('version')}: every rank must "
            f"see the same checkpoints ({run_dir / 'checkpoints'}: one shared directory, e.g. a ReadWriteMany volume)"
        )
    params = list(trainer.engine.module.parameters())
    trained = 0
    while True:
        cmd = msgpack.unpackb(broadcast_bytes(None))
        op = cmd["op"]
        if op == "train":
            trainer.train(unpack(cmd["batch"], TrainBatch), version=cmd["version"])
            trained += 1
        elif op == "export":
            checkpoint.export_hf(trainer.engine, run_dir / "hf", cmd["version"], adapter=trainer.adapter)
        elif op == "save":
            checkpoint.save(trainer.engine, run_dir, LearnerState(**cmd["state"]), keep=cmd["keep"])
        elif op == "gather":
            with zero3_gather(cmd["index"], [params[i] for i in cmd["index"]]):
                pass
        elif op == "stop":
            log.info("rank %d: stopped by rank 0 after %d batches", trainer.rank, trained)
            return trained
        elif op != "idle":
            raise ValueError(f"rank {trainer.rank}: unknown command {op!r} from rank 0")
