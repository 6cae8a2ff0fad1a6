"""A pool of verifier worker processes with a hard time limit per job.

    pool = VerifierPool(size=2, on_restart=metrics.restarts.inc)
    await pool.start()
    reply = await pool.run(job, timeout_s=5.0)   # raises JobTimeout / WorkerDied
    await pool.close()

A job that overruns its limit has its worker killed (SIGKILL) and replaced in the background;
so does a worker that dies. Other jobs keep running on the other workers, so a pathological answer
costs its own limit and nothing more. (concurrent.futures cannot do this: it cannot kill one task,
and one dead worker breaks the whole executor.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import msgpack

from reward_server.worker import HEADER, MAX_FRAME, frame, worker_env

log = logging.getLogger(__name__)


class JobTimeout(Exception):
    pass


class WorkerDied(Exception):
    pass


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            head = await self.proc.stdout.readexactly(HEADER.size)
            (n,) = HEADER.unpack(head)
            if n > MAX_FRAME:
                raise WorkerDied(f"worker sent a frame of {n} bytes")
            return msgpack.unpackb(await self.proc.stdout.readexactly(n))  # type: ignore[no-any-return]
        except asyncio.IncompleteReadError as e:
            raise WorkerDied(f"worker {self.pid} exited (code {self.proc.returncode})") from e

    async def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        if self.proc.returncode is not None or self.proc.stdin.is_closing():
            raise WorkerDied(f"worker {self.pid} is gone (exit code {self.proc.returncode})")
        try:
            self.proc.stdin.write(frame(job))
            await self.proc.stdin.drain()
        except (OSError, RuntimeError) as e:  # asyncio: BrokenPipe/ConnectionReset; uvloop: RuntimeError
            raise WorkerDied(f"worker {self.pid} is gone: {e}") from e

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class VerifierPool:
    def __init__(
        self,
        size: int,
        *,
        start_timeout_s: float = 120.0,
        memory_mb: int = 0,
        on_restart: Callable[[], None] | None = None,
    ):
        self.size = size
        self.memory_mb = memory_mb  # each worker's address space (0: no limit)
        self.start_timeout_s = start_timeout_s
        self.on_restart = on_restart
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.starting = 0  # workers being started (at start, or replacing one that was killed)
        self.spawn_failures = 0  # in a row: > 0 means a new worker could not be started (the pool is broken)

    @property
    def alive(self) -> int:
        return sum(1 for w in self._workers if w.proc.returncode is None)

    def pids(self) -> list[int]:
        return sorted(w.pid for w in self._workers if w.proc.returncode is None)

    async def start(self) -> None:
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for w in workers:
            self._idle.put_nowait(w)

    async def _spawn(self) -> _Worker:
        self.starting += 1
        try:
            w = await self._start_worker()
        except BaseException:
            self.spawn_failures += 1
            raise
        finally:
            self.starting -= 1
        self.spawn_failures = 0
        return w

    async def _start_worker(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "reward_server.worker",
            str(self.memory_mb),
            env=worker_env(os.environ),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        w = _Worker(proc)
        self._workers.add(w)
        try:
            hello = await asyncio.wait_for(w.read(), self.start_timeout_s)
        except (TimeoutError, WorkerDied):
            w.kill()
            self._workers.discard(w)
            raise
        if hello.get("ready") != proc.pid or hello.get("selfcheck") is not True:
            w.kill()
            self._workers.discard(w)
            raise WorkerDied(f"worker {proc.pid} failed its start-up verification: {hello}")
        return w

    async def _replace(self, dead: _Worker) -> None:
        dead.kill()
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            await dead.proc.wait()
        self._workers.discard(dead)
        delay = 0.1
        while not self._closed:
            try:
                self._idle.put_nowait(await self._spawn())
                if self.on_restart:
                    self.on_restart()
                return
            except (TimeoutError, WorkerDied, OSError) as e:
                log.error("could not start a verifier worker (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _schedule_replace(self, w: _Worker) -> None:
        task = asyncio.get_running_loop().create_task(self._replace(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Run one job on an idle worker; its time limit starts when a worker takes it."""
        w = await self._idle.get()
        job = job | {"id": next(self._ids)}
        try:
            await w.send(job)
            reply = await asyncio.wait_for(w.read(), timeout_s)
        except TimeoutError:
            log.warning("verification over %.1f s: killing worker %d", timeout_s, w.pid)
            self._schedule_replace(w)
            raise JobTimeout from None
        except (WorkerDied, asyncio.CancelledError):  # died, or the caller went away mid-job
            self._schedule_replace(w)
            raise
        except Exception as e:  # anything else leaves the worker's state unknown too
            self._schedule_replace(w)
            raise WorkerDied(f"worker {w.pid}: {type(e).__name__}: {e}") from e
        if reply.get("id") != job["id"]:
            self._schedule_replace(w)
            raise WorkerDied(f"worker {w.pid} answered job {reply.get('id')} for job {job['id']}")
        self._idle.put_nowait(w)
        return reply

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for w in list(self._workers):
            w.kill()
        for w in list(self._workers):
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                await w.proc.wait()
        self._workers.clear()
