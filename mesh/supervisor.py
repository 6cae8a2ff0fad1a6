"""The mesh's supervisor: starts each service as a process, restarts what exits, stops everything.

    sup = Supervisor(RunLayout(run_dir), max_restarts=10, say=print)
    url = sup.start_redis()                     # the embedded Redis (unless the mesh uses an external one)
    for cmd in service_commands(...):
        sup.spawn(cmd)                          # logs to RUN_DIR/logs/<name>.log
    while running:
        sup.supervise()                         # the restart policy, once a second
    sup.stop()                                  # SIGTERM in reverse start order, SIGKILL after 60 s

The restart policy is a container's `restart: on-failure`: a service that exits while the mesh runs is started
again with the same command (port, consumer name) after a backoff of 1, 2, 4, ... 30 s; so is the embedded
Redis (same port, same append-only file). Each restart is a line of supervisor.jsonl; `pids.json` always names
the running processes (the chaos test kills them from there).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from mesh.commands import ServiceCommand
from mesh.layout import RunLayout
from services.child_process import ROOT, child_env
from services.redis_server import EmbeddedRedis, die_with_parent

RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S = 1.0, 30.0  # 1, 2, 4, ... s before restarting a service again
STOP_GRACE_S = 60.0  # a learner finishing its batch and checkpoint gets this long after SIGTERM


class Supervisor:
    def __init__(self, paths: RunLayout, *, max_restarts: int = 10, say: Callable[[str], None] = print):
        self.paths, self.max_restarts, self.say = paths, max_restarts, say
        self.cmds: dict[str, ServiceCommand] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: dict[str, int] = {}
        self.down_since: dict[str, float] = {}
        self.redis: EmbeddedRedis | None = None

    def start_redis(self) -> str:
        """The embedded Redis, started from the main thread (see tied_to_thread); fsync on every write: a killed
        Redis loses nothing it acknowledged, so the exactly-once bookkeeping of the buffer and learner survives."""
        self.redis = EmbeddedRedis(self.paths.redis, tied_to_thread=True, appendfsync="always")
        url = self.redis.start()
        self._write_pids()
        return url

    def spawn(self, cmd: ServiceCommand) -> None:
        self.cmds[cmd.name] = cmd
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        with self.paths.log(cmd.name).open("ab") as log:
            self.procs[cmd.name] = subprocess.Popen(
                cmd.argv(),
                env=child_env(**cmd.env),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        self._write_pids()

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def _write_pids(self) -> None:
        pids = {name: p.pid for name, p in self.procs.items()}
        if self.redis is not None and self.redis.proc is not None:
            pids["redis"] = self.redis.proc.pid
        tmp = self.paths.root / ".pids.json.tmp"
        tmp.write_text(json.dumps(pids))
        tmp.replace(self.paths.pids)

    def _dead(self) -> list[tuple[str, int | None]]:
        dead = [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
            dead.insert(0, ("redis", self.redis.proc.returncode))  # first: the services need it
        return dead

    def supervise(self) -> None:
        """Restart every process that has exited and waited out its backoff; raise after `max_restarts`."""
        now = time.monotonic()
        for name, code in self._dead():
            if name not in self.down_since:
                self.down_since[name] = now
                self.say(f"[yellow]{name} exited with code {code}[/]")
            n = self.restarts.get(name, 0)
            if n >= self.max_restarts:
                raise RuntimeError(f"{name} exited {n + 1} times (code {code}); see {self.paths.log(name)}")
            if now - self.down_since[name] < min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**n):
                continue
            if name == "redis":
                assert self.redis is not None
                self.redis.start()  # the same port and data dir: the streams come back from the AOF
                self._write_pids()
            else:
                self.spawn(self.cmds[name])
            self.restarts[name] = n + 1
            del self.down_since[name]
            with self.paths.supervisor_log.open("a") as f:
                f.write(json.dumps({"time": time.time(), "service": name, "exit_code": code, "restart": n + 1}) + "\n")
            self.say(f"restarted {name} (restart {n + 1})")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each running service and Redis has used so far, from /proc."""
        procs = {name: p.pid for name, p in self.procs.items() if p.poll() is None}
        redis = self.redis.proc if self.redis else None
        if redis is not None and redis.poll() is None:
            procs["redis"] = redis.pid
        out = {}
        for name, pid in procs.items():
            if (used := process_cpu_seconds(pid)) is not None:
                out[name] = used
        return out

    def stop(self) -> None:
        """SIGTERM to every service, the last started first (replicas before the reward server they call), then
        SIGKILL to any still running after the grace period; Redis last."""
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.redis:
            self.redis.stop()


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process (its threads included), or None when it is gone or /proc is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
