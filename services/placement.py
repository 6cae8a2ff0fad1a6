"""Where a process runs on the CPU: its cores (affinity) and torch's intra-op threads.

    place(cores="1", threads=None, log=log)   # pinned to core 1, torch on 1 thread

When the learner and a vLLM replica share a machine, vLLM's OpenMP pool binds the cores it is given
(VLLM_CPU_OMP_THREADS_BIND) and spins on them; a learner whose torch pool runs on the same cores fights it for
every matmul. `dapo-mesh up` splits the cores (the learner's `--cpu-cores`, the replicas' `--cpu-cores`); the
measurement behind the default is in the docs (benchmarks.md, placement).
"""

from __future__ import annotations

import logging
import os


def parse_cores(spec: str) -> set[int]:
    """'0', '0-3', '0,2-3' -> the set of core numbers; ValueError naming the bad part."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad core list {spec!r}: {part!r} is not N or N-M") from None
        if a < 0 or b < a:
            raise ValueError(f"bad core list {spec!r}: {part!r} is not an ascending range of core numbers")
        cores |= set(range(a, b + 1))
    return cores


def place(cores: str | None, threads: int | None, log: logging.Logger | None = None) -> None:
    """Pin this process to `cores` and give torch `threads` intra-op threads (unset: one per pinned core)."""
    import torch

    if cores:
        wanted = parse_cores(cores)
        have = os.sched_getaffinity(0)
        if not wanted <= have:
            raise ValueError(f"--cpu-cores {cores}: this process may run on cores {sorted(have)} only")
        os.sched_setaffinity(0, wanted)
        threads = threads or len(wanted)
    if threads:
        torch.set_num_threads(threads)
    if log and (cores or threads):
        log.info("placement: cores %s, %d torch threads", sorted(os.sched_getaffinity(0)), torch.get_num_threads())
