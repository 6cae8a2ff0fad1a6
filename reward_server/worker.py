"""A verifier worker process: reads jobs on stdin, writes verdicts on stdout, one at a time.

    python -m reward_server.worker        # started by reward_server.pool, not by hand

Frames are a 4-byte big-endian length and a msgpack map (no pickle). Verification runs in the
process's main thread, where math-verify's `signal.alarm` timeouts work. Anything a library prints
goes to stderr: stdout carries frames only. The pool kills this process when a job overruns.
"""

from __future__ import annotations

import os
import struct
import sys
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


def frame(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj)
    return HEADER.pack(len(body)) + body


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")  # our private channel to the pool
    os.dup2(2, 1)  # stray prints from libraries go to stderr
    import math_verify  # noqa: F401  (imported up front so the first job is not slow)
    import reasoning_gym  # noqa: F401

    from reward_server.verifiers import run_verifier

    out.write(frame({"ready": os.getpid()}))
    out.flush()
    while (job := read_frame(sys.stdin.buffer)) is not None:
        try:
            v = run_verifier(
                job["verifier"], job["response"], job["ground_truth"],
                timeout_s=job["timeout_s"], lenient=job["lenient"], continuous=job["continuous"],
            )  # fmt: skip
            reply = {"id": job["id"], "score": v.score, "acc": v.acc, "pred": v.pred, "error": v.error}
        except Exception as e:  # a verifier bug or bad ground truth: report it, keep serving
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
