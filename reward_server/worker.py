"""A verifier worker process: reads jobs on stdin, writes verdicts on stdout, one at a time.

    python -m reward_server.worker [MEMORY_MB]     # started by reward_server.pool, not by hand

Limits, so that one pathological input costs only its own item: the address space is capped at MEMORY_MB
(RLIMIT_AS; an allocation past it fails inside the verifier, which answers the item as wrong or with an
error), and each job may use its time limit plus one second of CPU (RLIMIT_CPU; past it the kernel stops the
process and the pool replaces it). The pool also starts it with an environment that holds none of the
server's secrets (`worker_env`).

Frames are a 4-byte big-endian length and a msgpack map (no pickle). Verification runs in the
process's main thread, where math-verify's `signal.alarm` timeouts work. Anything a library prints
goes to stderr: stdout carries frames only. The pool kills this process when a job overruns.
"""

from __future__ import annotations

import math
import os
import resource
import struct
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024


def read_frame(stream: BinaryIO) -> dict[str, Any] | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes is over the {MAX_FRAME} limit")
    return msgpack.unpackb(stream.read(n))  # type: ignore[no-any-return]


ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONHASHSEED")
SINGLE_THREADED = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def worker_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a worker gets of the server's environment: an allow-list, so no token, password or Redis URL; one
    thread for the numeric libraries (their per-thread buffers would count against the memory limit)."""
    return {k: v for k, v in env.items() if k in ENV_KEPT} | SINGLE_THREADED


def limit_cpu(seconds: float) -> None:
    """Allow `seconds` more CPU time from now (the soft limit; the kernel sends SIGXCPU past it)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used.ru_utime + used.ru_stime + seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def frame(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj)
    return HEADER.pack(len(body)) + body


def main() -> None:
    if len(sys.argv) > 1 and int(sys.argv[1]) > 0:  # before the imports: they count too
        limit = int(sys.argv[1]) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = os.fdopen(os.dup(1), "wb")  # our private channel to the pool
    os.dup2(2, 1)  # stray prints from libraries go to stderr
    import math_verify  # noqa: F401  (imported up front so the first job is not slow)
    import reasoning_gym  # noqa: F401

    from reward_server.verifiers import run_verifier

    # a real verification before saying hello: a live worker is one that can verify (the server's /readyz
    # relies on it instead of queueing a check behind the jobs)
    check = run_verifier("math_verify", "\\boxed{2}", "2", timeout_s=30, lenient=True, continuous=False)
    out.write(frame({"ready": os.getpid(), "selfcheck": check.acc}))
    out.flush()
    while (job := read_frame(sys.stdin.buffer)) is not None:
        limit_cpu(float(job["timeout_s"]) + 1.0)
        try:
            v = run_verifier(
                job["verifier"],
                job["response"],
                job["ground_truth"],
                timeout_s=job["timeout_s"],
                lenient=job["lenient"],
                continuous=job["continuous"],
            )
            reply = {"id": job["id"], "score": v.score, "acc": v.acc, "pred": v.pred, "error": v.error}
        except Exception as e:  # a verifier bug, a bad ground truth, memory over the limit: report it, keep serving
            reply = {
                "id": job["id"],
                "score": -1.0,
                "acc": False,
                "pred": None,
                "error": f"{type(e).__name__}: {e}",
            }
        out.write(frame(reply))
        out.flush()


if __name__ == "__main__":
    main()
