"""The sandbox's rules without a process: which file names a program may bring, which limits a run may ask, and how
an ending reads as a verdict."""

from __future__ import annotations

import signal

import pytest
from fastapi import HTTPException
from pydantic import ValidationError

from sandbox.app import resolve_limits
from sandbox.jail import Limits, _exit, _verdict
from sandbox.settings import SandboxSettings
from services.sandbox_api import RunRequest

LIMITS = Limits(wall_s=5, cpu_s=2, memory_mb=256, processes=16, open_files=64, file_size_mb=1, output_bytes=100)


@pytest.mark.parametrize(
    "name", ["../x", "/etc/passwd", "a/../../x", "main.py", "", "a//b", "a/", ".", "a/./b", "sp ace", "x" * 101]
)
def test_file_names_outside_the_working_directory_or_odd_are_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="file name|main.py"):
        RunRequest(language="python", source="", files={name: ""})


def test_plain_relative_file_names_are_taken_and_a_file_cannot_be_a_directory_too() -> None:
    files = {"data/in.txt": "1", "lib/util.py": "", "README": "x", ".hidden": ""}
    assert RunRequest(language="python", source="", files=files).files == files
    with pytest.raises(ValidationError, match="both a file and a directory"):
        RunRequest(language="python", source="", files={"a": "", "a/b": ""})


def test_a_limit_above_the_maximum_is_refused_and_unset_ones_take_the_defaults() -> None:
    s = SandboxSettings(wall_s=3, max_wall_s=10, memory_mb=100)
    got = resolve_limits(RunRequest(language="python", source="", limits={"cpu_s": 7}), s)
    assert (got.wall_s, got.cpu_s, got.memory_mb) == (3, 7, 100)
    with pytest.raises(HTTPException) as e:
        resolve_limits(RunRequest(language="python", source="", limits={"wall_s": 11, "processes": 1000}), s)
    assert e.value.status_code == 422 and "wall_s" in e.value.detail and "processes" in e.value.detail


def test_a_default_above_its_maximum_fails_at_start_up() -> None:
    with pytest.raises(ValidationError, match="wall_s .* is above max_wall_s"):
        SandboxSettings(wall_s=30, max_wall_s=20)


@pytest.mark.parametrize(
    ("returncode", "why", "cpu_s", "stderr", "verdict"),
    [
        (0, "", 0.1, b"", "ok"),
        (1, "", 0.1, b"ValueError", "error"),
        (0, "wall", 0.1, b"", "timeout"),  # stopped by the service at the wall limit
        (0, "output", 0.1, b"", "output_limit"),
        (1, "", 0.1, b"OSError: [Errno 27] File too large", "output_limit"),
        (1, "", 0.1, b"MemoryError\n", "memory"),
        (128 + signal.SIGKILL, "", 1.95, b"", "timeout"),  # the kernel's SIGKILL at RLIMIT_CPU, a tick short
        (128 + signal.SIGKILL, "", 0.2, b"", "killed"),  # not the CPU limit (the OOM killer, say)
        (128 + signal.SIGSEGV, "", 0.1, b"", "killed"),
        (0, "", 2.1, b"", "timeout"),  # exited by itself, but past its CPU limit
    ],
)
def test_how_an_ending_reads_as_a_verdict(returncode: int, why: str, cpu_s: float, stderr: bytes, verdict: str) -> None:
    code, sig = _exit(returncode)
    assert _verdict(code, sig, why, cpu_s, stderr, LIMITS) == verdict


def test_a_status_above_128_reads_as_the_signal_bwrap_reports() -> None:
    assert _exit(128 + signal.SIGSEGV) == (None, signal.SIGSEGV)
    assert _exit(3) == (3, None)
    assert _exit(-signal.SIGKILL) == (None, signal.SIGKILL)
