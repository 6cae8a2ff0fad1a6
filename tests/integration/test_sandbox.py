"""The sandbox service over real HTTP (`python -m sandbox` under uvicorn, real bubblewrap): programs run with their
verdicts, a battery of escapes each contained — the service stays healthy and nothing a program started is running
afterwards, checked from outside — and bad input refused with a clear 4xx."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from sandbox.jail import pids_of
from services.child_process import running

TOKEN = "sandbox-test-token-123"
ADMIN = "sandbox-admin-token-456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WORKERS = 2
UID_BASE = 61000
AS_ROOT = os.geteuid() == 0
LIMITS = {"wall_s": 5, "cpu_s": 2, "memory_mb": 256, "processes": 16, "output_bytes": 4096, "file_size_mb": 1}


@pytest.fixture(scope="module")
def sandbox() -> Iterator[tuple[str, int]]:
    args = ["--workers", str(WORKERS), "--uid-base", str(UID_BASE), "--max-wall-s", "20", "--max-source-bytes", "5000"]
    env = {"DAPO_AUTH_TOKEN": ADMIN, "DAPO_SANDBOX_TOKEN": TOKEN}
    with running("sandbox", *args, env=env, ready_path="/readyz", token=ADMIN) as (base, proc):
        yield base, proc.pid


def run(base: str, source: str, stdin: str = "", **limits: float) -> dict:
    body = {"language": "python", "source": source, "stdin": stdin, "limits": LIMITS | limits}
    r = httpx.post(f"{base}/v1/run", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def leftovers() -> list[int]:
    """Processes of the workers' uids alive now, read from /proc by this (outside) process."""
    return [pid for slot in range(WORKERS) for pid in pids_of(UID_BASE + slot)]


def healthy(base: str) -> bool:
    return httpx.get(f"{base}/readyz", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).status_code == 200


def test_a_program_runs_with_its_stdin_files_and_output(sandbox: tuple[str, int]) -> None:
    base, _ = sandbox
    body = {
        "language": "python",
        "source": "import sys\nfrom helper.util import twice\nprint(twice(sys.stdin.read().strip()))",
        "stdin": "ab\n",
        "files": {"helper/__init__.py": "", "helper/util.py": "def twice(s):\n    return s * 2\n"},
    }
    r = httpx.post(f"{base}/v1/run", json=body, headers=AUTH, timeout=60).json()
    assert (r["verdict"], r["exit_code"], r["stdout"]) == ("ok", 0, "abab\n")
    assert r["wall_s"] > 0 and r["cpu_s"] > 0 and 1 < r["peak_memory_mb"] < 200

    r = run(base, "import sys; print('to stderr', file=sys.stderr); raise SystemExit(3)")
    assert (r["verdict"], r["exit_code"], r["stderr"]) == ("error", 3, "to stderr\n")


def test_a_batch_runs_each_input_in_its_own_sandbox_in_order(sandbox: tuple[str, int]) -> None:
    base, _ = sandbox
    source = "import os\nassert not os.path.exists('seen')\nopen('seen', 'w').write('x')\nprint(int(input()) ** 2)"
    body = {"language": "python", "source": source, "stdins": ["1", "2", "3", "4", "5", "x"]}
    results = httpx.post(f"{base}/v1/batch", json=body, headers=AUTH, timeout=60).json()["results"]
    assert [r["stdout"] for r in results[:5]] == ["1\n", "4\n", "9\n", "16\n", "25\n"]  # a file one wrote: not seen
    assert results[5]["verdict"] == "error" and "ValueError" in results[5]["stderr"]


@pytest.mark.skipif(not AS_ROOT, reason="per-worker uids (the process limit per worker) need the service as root")
def test_escapes_are_contained_and_leave_nothing_behind(sandbox: tuple[str, int], reward_url: str) -> None:
    base, service_pid = sandbox
    reward_port = int(reward_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", reward_port), timeout=5):  # open from here: the port is live
        pass
    secret = {"DAPO_AUTH_TOKEN": ADMIN, "DAPO_SANDBOX_TOKEN": TOKEN}
    connect = "import socket, sys\nfor p in map(int, sys.argv[1:] or input().split()):\n" + (
        "    s = socket.socket(); s.settimeout(2); print(p, s.connect_ex(('127.0.0.1', p)))"
    )
    cases: list[tuple[str, str, str, Callable[[dict], bool]]] = [
        # (name, source, stdin, what must hold of the result)
        ("network", connect, f"6379 {reward_port} {base.rsplit(':', 1)[1]}", lambda r: " 0" not in r["stdout"]),
        ("shadow", "print(open('/etc/shadow').read())", "", lambda r: "FileNotFoundError" in r["stderr"]),
        ("host env", "import os; print(sorted(os.environ))", "", lambda r: "DAPO" not in r["stdout"]),
        (
            "proc environ",
            "import glob\nfor p in glob.glob('/proc/*/environ'):\n    print(p, open(p, 'rb').read())",
            "",
            lambda r: (
                {line.split("/")[2] for line in r["stdout"].splitlines()} == {"1", "self", "thread-self"}
                and all(t not in r["stdout"] for t in secret.values())
            ),
        ),  # only itself, as PID 1: no other process is there to read
        ("write outside", "open('/usr/evil', 'w')", "", lambda r: "Read-only file system" in r["stderr"]),
        ("write root", "open('/evil', 'w')", "", lambda r: r["verdict"] == "error"),
        ("dev mem", "open('/dev/mem', 'rb')", "", lambda r: "FileNotFoundError" in r["stderr"]),
        (
            "fill /dev/shm",
            "f = open('/dev/shm/x', 'w')\nfor _ in range(100):\n    f.write('x' * (1 << 20))\n    f.flush()",
            "",
            lambda r: "No space left on device" in r["stderr"] or "File too large" in r["stderr"],
        ),  # a tmpfs of its own, bounded (bwrap's /dev is half the host's memory)
        (
            "nested user namespace",
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), ctypes.get_errno())",  # CLONE_NEWUSER
            "",
            lambda r: r["stdout"].split()[0] == "-1",
        ),
        ("exit status 170", "raise SystemExit(170)", "", lambda r: (r["verdict"], r["exit_code"]) == ("error", 170)),
        ("kill all", "import os; os.kill(-1, 9); print('alive')", "", lambda r: "ProcessLookupError" in r["stderr"]),
        (
            "ptrace",
            "import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.ptrace(16, int(input()), 0, 0), ctypes.get_errno())",  # PTRACE_ATTACH to the service
            str(service_pid),
            lambda r: r["stdout"].split() == ["-1", "3"],  # ESRCH: no such process in its world
        ),
        ("memory", "x = bytearray(400 << 20)", "", lambda r: r["verdict"] == "memory"),
        ("cpu", "while True: pass", "", lambda r: r["verdict"] == "timeout" and r["cpu_s"] > 1.5),
        ("sleep", "import time; time.sleep(30)", "", lambda r: r["verdict"] == "timeout" and r["wall_s"] < 10),
        (
            "print 1 GB",
            "import sys\nfor _ in range(1 << 14): sys.stdout.write('x' * (1 << 16))",
            "",
            lambda r: r["verdict"] == "output_limit" and r["truncated"] and len(r["stdout"]) == 4096,
        ),
        ("big file", "open('f', 'w').write('x' * (2 << 20))", "", lambda r: r["verdict"] == "output_limit"),
        ("fork bomb", "import os\nwhile True: os.fork()", "", lambda r: r["verdict"] != "ok"),
        (
            "daemon",
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')",
            "",
            lambda r: r["verdict"] == "ok",
        ),
    ]
    for name, source, stdin, holds in cases:
        r = run(base, source, stdin, wall_s=5 if name == "sleep" else 15)
        assert holds(r), f"{name}: {r}"
        assert leftovers() == [], f"{name}: processes left behind"
        assert healthy(base), f"{name}: the service is not ready after it"


def test_runs_cannot_see_each_other(sandbox: tuple[str, int]) -> None:
    base, _ = sandbox
    writer = "open('/work/secret', 'w').write('s3cret'); open('/tmp/secret', 'w').write('s3cret')\n"
    writer += "import time; time.sleep(1.5); print('done')"
    reader = "import os, time\ntime.sleep(0.5)\nfor d in ('/work', '/tmp', '/'):\n    print(d, sorted(os.listdir(d)))"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        w = pool.submit(run, base, writer)
        seen = pool.submit(run, base, reader).result()
        assert w.result()["stdout"] == "done\n"
    assert "secret" not in seen["stdout"], seen


def test_bad_input_gets_a_clear_4xx(sandbox: tuple[str, int]) -> None:
    base, _ = sandbox

    def post(route: str, body: dict, headers: dict[str, str] = AUTH) -> httpx.Response:
        body = {"language": "python", "source": "print(1)"} | body
        return httpx.post(f"{base}/v1/{route}", json=body, headers=headers, timeout=30)

    r = post("run", {"language": "cobol"})
    assert r.status_code == 422 and "python" in r.text
    r = post("run", {"source": "x" * 6000})
    assert r.status_code == 413 and "5000" in r.json()["detail"]
    r = post("run", {"limits": {"wall_s": 100, "memory_mb": 100_000}})
    assert r.status_code == 422 and "wall_s" in r.json()["detail"] and "memory_mb" in r.json()["detail"]
    r = post("run", {"limits": {"gpu": 1}})
    assert r.status_code == 422
    r = post("run", {"files": {"../escape.py": "x"}})
    assert r.status_code == 422 and "relative path" in r.text
    r = post("batch", {"stdins": [""] * 300})
    assert r.status_code == 413 and "256" in r.json()["detail"]
    r = post("batch", {"stdins": []})
    assert r.status_code == 422
    assert post("run", {}, headers={}).status_code == 401
    assert post("run", {}, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 401  # the role has its own
    metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    assert 'dapo_sandbox_requests_total{route="run",status="413"}' in metrics


def test_more_runs_than_the_queue_holds_get_429_with_retry_after() -> None:
    with running("sandbox", "--workers", "1", "--queue", "0", ready_path="/readyz") as (base, _):
        body = {"language": "python", "source": "import time; time.sleep(2)"}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{base}/v1/run", json=body, timeout=30)
            for _ in range(50):  # until the first run holds the one worker
                if "dapo_sandbox_running_runs 1.0" in httpx.get(f"{base}/metrics", timeout=5).text:
                    break
                time.sleep(0.05)
            second = httpx.post(f"{base}/v1/run", json=body, timeout=30)
            assert second.status_code == 429 and second.headers["Retry-After"] == "1", second.text
            batch = httpx.post(f"{base}/v1/batch", json=body | {"stdins": ["", ""]}, timeout=30)
            assert batch.status_code == 413 and "holds 1 at most" in batch.text  # no wait would ever fit it
            assert first.result().json()["verdict"] == "ok"
