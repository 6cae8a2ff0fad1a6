"""HF math-verify: symbolic equivalence of the response's final answer with the ground truth.

math-verify times itself out with `signal.alarm`, which works only in a process's main thread, so
this runs inside the verifier worker processes (reward_server/worker.py), never in the server.
"""

from __future__ import annotations

from reward_server.verifiers.base import Verdict


def math_verify(response: str, ground_truth: str, *, timeout_s: int = 2) -> Verdict:
    from math_verify import parse, verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=timeout_s)
    pred = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=timeout_s)
    if not gold or not pred:
        return Verdict(-1.0, False, pred=None if not pred else str(pred[-1]))
    ok = bool(verify(gold, pred, timeout_seconds=timeout_s))
    return Verdict(1.0 if ok else -1.0, ok, pred=str(pred[-1]))
