"""Verifiers by name. `dapo_math` is pure and bounded and runs in the server process; the others
(math-verify, reasoning-gym) run in worker processes with a hard time limit per item.

    dapo_math               the DAPO rule reward (parity with the authors' verl reference)
    math_verify             HF math-verify symbolic equivalence
    reasoning_gym:<task>    reasoning-gym's own score_answer for <task>
    code                    the answer's program against its tests, in the sandbox service (verifiers/code.py;
                            run by reward_server/code_runner.py, neither inline nor pooled: it waits on HTTP)
"""

from __future__ import annotations

from reward_server.verifiers.base import Verdict
from reward_server.verifiers.dapo_math import dapo_math
from reward_server.verifiers.reasoning_gym import PREFIX as RG_PREFIX

INLINE = {"dapo_math"}
POOLED = {"math_verify"}
SANDBOXED = {"code"}


def check_name(name: str) -> str | None:
    """None if `name` is a verifier this server knows, else what is wrong with it."""
    if name in INLINE or name in POOLED or name in SANDBOXED:
        return None
    if name.startswith(RG_PREFIX):
        from reward_server.verifiers.reasoning_gym import known_tasks

        task = name[len(RG_PREFIX) :]
        if task in known_tasks():
            return None
        return f"unknown reasoning-gym task {task!r} (e.g. chain_sum, basic_arithmetic, gsm_symbolic)"
    return f"unknown verifier {name!r}: use dapo_math, math_verify, code or reasoning_gym:<task>"


def run_verifier(
    name: str, response: str, ground_truth: str, *, timeout_s: float, lenient: bool, continuous: bool
) -> Verdict:
    """Run one verification in this process (the worker calls this; `dapo_math` is also inline)."""
    if name == "dapo_math":
        return dapo_math(response, ground_truth)
    if name == "math_verify":
        from reward_server.verifiers.math_verify import math_verify

        return math_verify(response, ground_truth, timeout_s=max(1, int(timeout_s / 2)))
    if name.startswith(RG_PREFIX):
        from reward_server.verifiers.reasoning_gym import reasoning_gym_score

        return reasoning_gym_score(
            name[len(RG_PREFIX) :], response, ground_truth, lenient=lenient, continuous=continuous
        )
    raise ValueError(check_name(name) or f"verifier {name!r} cannot run here")


__all__ = ["INLINE", "POOLED", "SANDBOXED", "Verdict", "check_name", "run_verifier"]
