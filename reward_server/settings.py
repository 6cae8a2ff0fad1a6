"""Settings of the reward server (env DAPO_*, or --flags)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import AnyHttpUrl, Field, SecretStr, model_validator

from services.settings import ServiceSettings


class RewardSettings(ServiceSettings):
    port: int = Field(8001, ge=0, le=65535, description="HTTP port.")
    reward_token: SecretStr | None = Field(
        None,
        description="The token that scores (POST /v1/score): the replicas hold it. Unset: the auth token. Once set, "
        "the auth token does not score.",
    )
    workers: int = Field(2, ge=1, le=256, description="Verifier worker processes (math-verify, reasoning-gym).")
    item_timeout_s: float = Field(5.0, gt=0, le=600, description="Hard time limit of one verification.")
    worker_start_timeout_s: float = Field(120.0, gt=0, description="Time a new worker may take to start.")
    worker_memory_mb: int = Field(
        2048, ge=0, description="Address space of each verifier worker (RLIMIT_AS; ~320 MB used at rest; 0: no limit)."
    )
    max_items: int = Field(4096, ge=1, description="Items per request (413 beyond).")
    max_response_chars: int = Field(200_000, ge=1, description="Characters per response (413 beyond).")
    max_ground_truth_chars: int = Field(100_000, ge=1, description="Characters per ground truth (413 beyond).")
    cache_size: int = Field(100_000, ge=0, description="Verdicts kept in the LRU cache (0: no cache).")
    overlong_shaping: bool = Field(True, description="Add DAPO's overlong penalty when tokens are given.")
    max_response_tokens: int = Field(20480, ge=1, description="L_max when an item does not give one.")
    overlong_buffer_tokens: int = Field(4096, ge=1, description="L_cache, the soft overlong buffer.")
    overlong_factor: float = Field(1.0, ge=0, description="Penalty at and beyond L_max.")
    rg_lenient: bool = Field(True, description="reasoning_gym: fall back to the last number in the response.")
    rg_continuous: bool = Field(False, description="reasoning_gym: reward 2*score-1 instead of +-1.")
    sandbox_url: AnyHttpUrl | None = Field(
        None, description="The sandbox service the `code` verifier runs programs in (unset: `code` items are a 422)."
    )
    sandbox_token: SecretStr | None = Field(
        None, description="The sandbox role's token, sent to the sandbox service. Unset: the auth token."
    )
    code_test_timeout_s: float = Field(
        5.0, gt=0, le=60, description="code: wall and CPU time of one test (verl's prime_code: 5 s)."
    )
    code_answer_timeout_s: float = Field(60.0, gt=0, le=600, description="code: time for all of one answer's tests.")
    code_memory_mb: int = Field(1024, ge=64, description="code: memory of each test's process.")
    code_concurrency: int = Field(
        4, ge=1, le=1024, description="code: answers whose tests are at the sandbox at once (the rest wait here)."
    )
    code_reward: Literal["all", "fraction"] = Field(
        "all",
        description="code: +1 when every test passes and -1 otherwise (DAPO's rule), or 2*passed/tests-1 (fraction).",
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> Self:
        if self.overlong_buffer_tokens > self.max_response_tokens:
            raise ValueError("overlong_buffer_tokens must be <= max_response_tokens")
        return self
