"""reasoning-gym tasks, scored by the task's own `score_answer`.

The ground truth is the dataset entry as JSON (`{"answer": ..., "metadata": {...}}`, what the
buffer sends), or a bare answer string for tasks whose scorer needs nothing else.

The answer is extracted from the response in this order: the last `<answer>...</answer>` (the
reasoning-gym convention), the last `Answer: ...` line (the DAPO convention), and, when `lenient`,
the last number in the response (small models answer in prose: "16 + 44 = 60.").
acc = score >= 1.0; the reward is +1/-1, or 2*score - 1 when `continuous` (partial credit).
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

from reward_server.verifiers.base import Verdict

PREFIX = "reasoning_gym:"
_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def known_tasks() -> frozenset[str]:
    from reasoning_gym.factory import DATASETS

    return frozenset(DATASETS)


@cache
def _scorer(task: str) -> Any:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def extract_answer(response: str, *, lenient: bool = True) -> str | None:
    if tags := _TAG.findall(response):
        return str(tags[-1]).strip()
    if lines := _LINE.findall(response):
        return str(lines[-1]).strip()
    if lenient and (numbers := _NUMBER.findall(response)):
        return str(numbers[-1]).replace(",", "")
    return None


def _entry(ground_truth: str) -> dict[str, Any]:
    try:
        entry = json.loads(ground_truth)
    except json.JSONDecodeError:
        entry = None
    if isinstance(entry, dict) and "answer" in entry:
        entry.setdefault("metadata", {})
        return entry
    return {"answer": ground_truth, "metadata": {}}


def reasoning_gym_score(
    task: str, response: str, ground_truth: str, *, lenient: bool = True, continuous: bool = False
) -> Verdict:
    pred = extract_answer(response, lenient=lenient)
    score = float(_scorer(task)(pred, _entry(ground_truth)))
    acc = score >= 1.0
    reward = 2.0 * score - 1.0 if continuous else (1.0 if acc else -1.0)
    return Verdict(reward, acc, pred=pred)
