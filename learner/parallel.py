"""Data parallelism of the learner: N ranks take exactly the step one rank would.

    for idx in trainer.units(mini_batch, tensors):  # this rank's micro-batches, padded with None to equal counts
        ...                                         # None: a zero-weighted micro-batch (keeps collectives aligned)

Every rank holds the whole TrainBatch (rank 0 reads it, the others get its msgpack bytes: `broadcast_bytes`), so the
advantages (per group), the mini-batch shuffle and each mini-batch's token count (DAPO's token-mean denominator)
are the whole batch's on every rank. Each mini-batch's rows are dealt to the ranks by tokens (`split_rows`: longest
first, to the least loaded rank), and each rank cuts its rows into micro-batches by the token budget as one rank
would. Two rules make the split exact:

- **Equal micro-batch counts.** ZeRO-2/3 reduce gradients inside each backward and ZeRO-3 gathers weights inside
  each forward: every rank must make the same calls. A rank with fewer micro-batches runs a real one with its loss
  multiplied by 0 (gradients 0, the same collectives).
- **Loss x world size.** DeepSpeed averages gradients over ranks; the loss is already normalised by the whole
  mini-batch's tokens, so each rank's loss is scaled by N and the average is the sum one rank would have.

Proximal log-probs are computed on each rank for its micro-batches and summed (all-reduce) into the whole batch's,
so the off-policy weights, masks and gap metrics are the whole batch's everywhere too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def split_rows(idx: torch.Tensor, lengths: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Rows `idx` dealt to `size` ranks by tokens: longest first, each to the rank with the fewest tokens so far
    (ties: the lowest rank). Every rank computes every rank's share the same way (each holds the whole batch)."""
    order = idx[torch.argsort(lengths[idx], descending=True, stable=True)].tolist()
    shares: list[list[int]] = [[] for _ in range(size)]
    load = [0] * size
    for i in order:
        r = min(range(size), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += int(lengths[i])
    return [torch.tensor(sorted(s), dtype=torch.long) for s in shares]


def padded(units: Sequence[Sequence[T]], rank: int) -> list[T | None]:
    """This rank's units, padded with None to the most any rank has (equal call counts on every rank)."""
    most = max((len(u) for u in units), default=0)
    return [*units[rank], *([None] * (most - len(units[rank])))]


def comm_device() -> torch.device:
    """Where a collective's tensors must be: the rank's GPU under NCCL (it moves no CPU tensors), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks (in place; the tensor itself with one rank)."""
    if world()[1] > 1:
        dev = comm_device()
        moved = t.to(dev)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        if moved is not t:
            t.copy_(moved)
    return t


def shutdown() -> None:
    """Tear the process group down before the interpreter exits (left to the exit, gloo's threads are sometimes
    destroyed while joinable: "terminate called without an active exception", SIGABRT)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_rank() -> None:
    """End a rank of a multi-rank world whose work is done and whose process group is shut down, without the
    interpreter's teardown: even after `shutdown`, C++ threads of gloo and of DeepSpeed's CPU communication op are
    sometimes destroyed while joinable there, and the rank aborts (SIGABRT) after its work is done, which torchrun
    reports as a failed rank (seen in CI, 2 of 8 two-rank replays in one run). One process: returns."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def barrier() -> None:
    """Every rank has come here (nothing with one rank)."""
    if world()[1] > 1:
        dist.barrier()


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """`data` from rank `src` on every rank: its length, then its bytes as a uint8 tensor (no pickle)."""
    rank, size = world()
    if size == 1:
        assert data is not None
        return data
    dev = comm_device()
    n = torch.tensor([len(data) if rank == src and data is not None else 0], dtype=torch.long, device=dev)
    dist.broadcast(n, src)
    size = int(n)
    if size == 0:
        return b""
    if rank == src and data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src)
    return buf.cpu().numpy().tobytes()


def check_ranks(rows: int, minibatches: int, size: int) -> None:
    """More ranks than samples in a mini-batch leave ranks with only zero-weighted work: a setting error."""
    per_minibatch = rows // max(1, min(minibatches, rows))
    if size > per_minibatch:
        raise ValueError(
            f"{size} learner ranks but {per_minibatch} samples per mini-batch ({rows} samples / minibatches "
            f"{minibatches}): use at most {per_minibatch} ranks or fewer minibatches"
        )
