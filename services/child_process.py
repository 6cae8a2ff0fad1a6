"""Start a service as a process, as a user would (`python -m <package> --port N ...`), and wait
until it answers. Used by the tests, the benchmarks and the local mesh launcher.

    with running("reward_server", "--workers", "2", ready_path="/readyz") as (base_url, proc):
        httpx.post(f"{base_url}/v1/score", json=...)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from services.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]  # the checkout, so `python -m` finds the packages


DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a service process: ours, without a torch.distributed world a parent may have
    (an in-process DeepSpeed sets MASTER_PORT: a learner child would try to bind the same port), plus `extra`."""
    return {k: v for k, v in os.environ.items() if k not in DIST_ENV} | {"PYTHONPATH": str(ROOT)} | extra


def wait_ready(
    proc: subprocess.Popen[bytes],
    url: str,
    *,
    name: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    poll_s: float = 0.5,
    log_hint: str = "",
) -> None:
    """Poll `url` until it answers 200; fail at once if the process exits, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:  # one client: each bare httpx.get builds an SSL context (~30 ms CPU)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}{log_hint}")
            try:
                if client.get(url, headers=headers or {}).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after {timeout_s:.0f} s{log_hint}")
            time.sleep(poll_s)


@contextmanager
def running(
    package: str,
    *args: str,
    env: dict[str, str] | None = None,
    ready_path: str = "/healthz",
    token: str | None = None,
    timeout_s: float = 120.0,
    log: Path | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yield (base URL, process); the process's stderr goes to `log` when given."""
    port = free_port()
    e = child_env(**(env or {}))
    stderr = log.open("wb") if log else None
    proc = subprocess.Popen([sys.executable, "-m", package, "--port", str(port), *args], env=e, cwd=ROOT, stderr=stderr)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        wait_ready(proc, base + ready_path, name=package, headers=headers, timeout_s=timeout_s, poll_s=0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if stderr:
            stderr.close()
