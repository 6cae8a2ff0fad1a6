"""Settings of the environment service (env DAPO_*, or --flags)."""

from __future__ import annotations

from typing import Self

from pydantic import AnyHttpUrl, Field, SecretStr, model_validator

from services.settings import ServiceSettings


class EnvSettings(ServiceSettings):
    port: int = Field(8005, ge=0, le=65535, description="HTTP port.")
    env_token: SecretStr | None = Field(
        None,
        description="The token of the dapo-env/1 routes (/v1/envs, /v1/episodes...): the replicas hold it. Unset: "
        "the auth token. Once set, the auth token does not run episodes.",
    )
    workers: int = Field(
        8, ge=1, le=1024, description="Threads running environment code (resets, steps, tools) at the same time."
    )
    step_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Time one reset or step may take; beyond, the episode ends with an error."
    )
    queue_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Time a request waits for a free worker; beyond, 429 with Retry-After."
    )
    max_open_episodes: int = Field(4096, ge=1, description="Episodes held at once (429 with Retry-After beyond).")
    episode_ttl_s: float = Field(
        600.0, gt=0, description="An episode untouched this long is dropped (counted as expired)."
    )
    env_classes: list[str] = Field(
        default_factory=list,
        description="More environments to serve, as module:Class (an env_server.base.Environment subclass each).",
    )
    openenv: list[str] = Field(
        default_factory=list,
        description="OpenEnv servers to serve as environments, as NAME=URL[?max_turns=N&timeout_s=S&action=FIELD&"
        "observation=FIELD] (env_server/openenv.py).",
    )
    sandbox_url: AnyHttpUrl | None = Field(
        None,
        description="The sandbox service the `python` tool runs programs in; set, the `compute` environment is served.",
    )
    sandbox_token: SecretStr | None = Field(
        None, description="The sandbox role's token, sent to the sandbox service. Unset: the auth token."
    )
    python_timeout_s: float = Field(10.0, gt=0, le=60, description="python tool: wall and CPU time of one program.")
    python_output_chars: int = Field(2000, ge=100, description="python tool: characters of output in the tool message.")

    @model_validator(mode="after")
    def _tool_within_a_step(self) -> Self:
        if self.sandbox_url is not None and self.python_timeout_s >= self.step_timeout_s:
            raise ValueError(
                f"python_timeout_s ({self.python_timeout_s}) must be below step_timeout_s ({self.step_timeout_s}): "
                "a step runs its tool calls"
            )
        return self
