"""The sandbox service's HTTP API (POST /v1/run, POST /v1/batch): one untrusted program per run, isolated.

The reward server's code verifiers and the environment service's `python` tool call it; anyone else may too. The
models are the contract: the service (sandbox/) answers with them and its callers import the same classes.

    RunRequest(language="python", source="print(input()[::-1])", stdin="abc")   ->   RunResult(verdict="ok", ...)
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FILE_PART = re.compile(r"[A-Za-z0-9._-]{1,100}")
LANGUAGES = ("python",)
Language = Literal["python"]
# ok: exited 0 within its limits; error: exited with another status (an exception, sys.exit(1));
# timeout: past its wall or CPU time; memory: past its memory; output_limit: printed past the output limit or wrote
# a file past the file-size limit; killed: ended by a signal no limit sent (it killed itself, a segfault).
Verdict = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]
VERDICTS: tuple[Verdict, ...] = ("ok", "error", "timeout", "memory", "output_limit", "killed")


class RunLimits(BaseModel):
    """A run's limits; each one unset takes the service's default, and one above the service's maximum is a 422."""

    model_config = ConfigDict(extra="forbid")
    wall_s: float | None = Field(None, gt=0, description="Wall-clock time, from its start to its end.")
    cpu_s: float | None = Field(None, gt=0, description="CPU time of all its processes together.")
    memory_mb: int | None = Field(None, ge=16, description="Address space of each process (RLIMIT_AS).")
    processes: int | None = Field(None, ge=1, description="Processes and threads alive at once.")
    open_files: int | None = Field(None, ge=8, description="Open file descriptors per process.")
    file_size_mb: int | None = Field(None, ge=0, description="Largest file it may write.")
    output_bytes: int | None = Field(None, ge=0, description="Bytes of stdout, and of stderr, kept (more: stopped).")


class ProgramSpec(BaseModel):
    """What a run and a batch share: the program, its files, its limits."""

    model_config = ConfigDict(extra="forbid")
    language: Language = Field(description="The program's language (python: CPython 3, the service's own).")
    source: str = Field(description="The program's text, run as main.py in its working directory.")
    files: dict[str, str] = Field(
        default_factory=dict, description="More files in the working directory: relative path -> text."
    )
    limits: RunLimits = Field(default_factory=RunLimits)

    @field_validator("files")
    @classmethod
    def _plain_relative_paths(cls, files: dict[str, str]) -> dict[str, str]:
        for name in files:
            parts = name.split("/")
            if not all(FILE_PART.fullmatch(p) and p not in {".", ".."} for p in parts) or len(parts) > 8:
                raise ValueError(
                    f"file name {name!r}: give a relative path of at most 8 parts, each of letters, digits, '.', '_' "
                    "and '-' (at most 100 characters), not '.' or '..'"
                )
            if name == "main.py":
                raise ValueError("file name 'main.py' is the program itself: give it as the source")
        dirs = {"/".join(name.split("/")[:i]) for name in files for i in range(1, name.count("/") + 1)}
        if clash := sorted(dirs & files.keys()):
            raise ValueError(f"{clash[0]!r} is both a file and a directory of other files")
        return files


class RunRequest(ProgramSpec):
    stdin: str = Field("", description="What the program reads on stdin.")


class BatchRequest(ProgramSpec):
    """One program against many inputs (test cases): each run is separate, in its own sandbox."""

    stdins: list[str] = Field(min_length=1, description="One run per input, results in the same order.")


class RunResult(BaseModel):
    verdict: Verdict
    exit_code: int | None = Field(
        description="Its exit status; None when a signal ended it (a status of 128 + N reads as signal N)."
    )
    signal: str | None = Field(None, description="The signal that ended it (SIGKILL, SIGXCPU, ...), if one did.")
    stdout: str = Field(description="Its stdout (UTF-8, undecodable bytes replaced), at most output_bytes.")
    stderr: str = Field(description="Its stderr, at most output_bytes.")
    truncated: bool = Field(False, description="stdout or stderr was cut at output_bytes.")
    wall_s: float = Field(description="Wall-clock time.")
    cpu_s: float = Field(description="CPU time (user + system) of its main process and the children it waited for.")
    peak_memory_mb: float = Field(description="Largest resident set of its main process, sampled every 5 ms.")


class BatchResult(BaseModel):
    results: list[RunResult]
