"""Runs the code verifier: a program and its tests to the sandbox service (POST /v1/batch), the verdict back.

    runner = CodeRunner(settings)                  # --sandbox-url, the sandbox role's token, the time limits
    verdict = await runner.verify(response, ground_truth)
    await runner.close()

Reward (DAPO's rule): +1 when every test passes, -1 otherwise; with --code-reward fraction, 2 * passed / tests - 1
(every test +1, none -1). A sandbox that does not answer, or answers with an error, is the item's error (never the
model's fault, never a 500); one past --code-answer-timeout-s is timed out.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from pydantic import ValidationError

from reward_server.settings import RewardSettings
from reward_server.verifiers.base import Verdict
from reward_server.verifiers.code import build_program, judge
from services.code_tests import parse_tests
from services.sandbox_api import BatchResult
from services.settings import role_token

log = logging.getLogger(__name__)


class CodeRunner:
    def __init__(self, settings: RewardSettings):
        self.settings = settings
        token = role_token(settings, "sandbox_token")
        headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        self.client = httpx.AsyncClient(
            base_url=str(settings.sandbox_url or ""),
            headers=headers,
            timeout=httpx.Timeout(settings.code_answer_timeout_s + 5, connect=5),
        )
        self.gate = asyncio.Semaphore(settings.code_concurrency)  # answers at the sandbox at once

    async def verify(self, response: str, ground_truth: str) -> Verdict:
        s = self.settings
        try:
            tests = parse_tests(ground_truth)
        except ValueError as e:
            return Verdict(-1.0, False, error=str(e))
        program = build_program(tests, response)
        body = {
            "language": "python",
            "source": program.source,
            "files": program.files,
            "stdins": program.stdins,
            "limits": {"wall_s": s.code_test_timeout_s, "cpu_s": s.code_test_timeout_s, "memory_mb": s.code_memory_mb},
        }
        try:
            async with self.gate, asyncio.timeout(s.code_answer_timeout_s):
                while (r := await self.client.post("/v1/batch", json=body)).status_code == 429:  # its queue is full
                    await asyncio.sleep(_retry_after(r))
        except TimeoutError:
            return Verdict(-1.0, False, timed_out=True, error=f"over the {s.code_answer_timeout_s} s limit per answer")
        except httpx.HTTPError as e:
            log.warning("the sandbox did not answer: %s", e)
            return Verdict(-1.0, False, error=f"sandbox unreachable: {type(e).__name__}")
        if r.status_code != 200:
            return Verdict(-1.0, False, error=f"sandbox answered {r.status_code}: {r.text[:200]}")
        try:
            passed = judge(tests, program, BatchResult.model_validate_json(r.content).results)
        except (ValidationError, ValueError) as e:
            return Verdict(-1.0, False, error=f"the sandbox's answer does not read: {str(e)[:200]}")
        n, ok = len(passed), sum(passed)
        score = 2 * ok / n - 1 if s.code_reward == "fraction" else (1.0 if ok == n else -1.0)
        return Verdict(score, ok == n, pred=f"{ok}/{n} tests passed")

    async def close(self) -> None:
        await self.client.aclose()


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(max(float(r.headers.get("Retry-After", "1")), 0.05), 10.0)
    except ValueError:
        return 1.0
