"""One OpenAI-compatible endpoint for N replicas, as a user runs it: `dapo-mesh up` with three vLLM replicas serving
the gateway behind the router, agents written with the `openai` SDK alone opening sessions and calling the model
through the router's one base_url, one replica killed with kill -9 while it holds sessions: those sessions get a
clear error (410: lost with their replica), the others finish, the killed replica's tasks are taken by the others,
the learner trains its steps, and the audit finds nothing trained twice and nothing lost. Sessions still open when
the run is over and the mesh stops every replica get the same clear 410; they are counted apart (not the kill's)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from mesh.layout import RunFile, RunLayout
from services.redis_server import free_port
from services.schemas import ReplicaHeartbeat
from services.session_keys import replica_tag, tag_of
from services.streams import REPLICA_KEY_PREFIX, connect, unpack
from tests.e2e.meshrun import audit, left_behind, start_mesh

SESSIONS = 48
STOPPING = b"CPU: orchestrator"  # up's last line before it stops the services (bytes: up.out may end mid-character)


class Agents:
    """Agents that open sessions through the router, call the model twice (a pause between the calls: sessions are
    open when the replica is killed) and end them with `score: true`, until SESSIONS ended and the mesh stops."""

    def __init__(self, base: str, up_out: Path):
        self.base, self.lock, self.stop = base, threading.Lock(), threading.Event()
        self.up_out = up_out  # the mesh's output: it says when the mesh begins to stop its services
        self.open: set[str] = set()  # session ids between their opening and their end
        self.ended: list[str] = []
        self.lost: list[tuple[str, str]] = []  # (session id, the error) of sessions whose replica died
        self.lost_at_stop: list[tuple[str, str]] = []  # the same, once the mesh was stopping every replica
        self.errors: list[str] = []

    def run(self) -> None:
        opener = openai.OpenAI(base_url=self.base, api_key="local", max_retries=20, timeout=120)
        while not self.stop.is_set():
            try:
                s: dict = opener.post("/sessions", body={}, cast_to=object)  # type: ignore[assignment]
            except (openai.APIConnectionError, openai.APIStatusError) as e:  # the mesh finished (or not up yet)
                self.errors.append(f"open: {e}")
                time.sleep(1)
                continue
            with self.lock:
                self.open.add(s["session_id"])
            try:
                self.episode(s)
            except openai.APIConnectionError as e:  # the mesh finished while the session was open
                self.errors.append(f"{s['session_id']}: {e}")
            except openai.APIStatusError as e:
                with self.lock:
                    if e.status_code == 410 and STOPPING in self.up_out.read_bytes():
                        self.lost_at_stop.append((s["session_id"], str(e)))  # the run is over: every replica stops
                    elif e.status_code == 410:
                        self.lost.append((s["session_id"], str(e)))
                    else:
                        self.errors.append(f"{s['session_id']}: {e}")
            finally:
                with self.lock:
                    self.open.discard(s["session_id"])

    def episode(self, s: dict) -> None:
        client = openai.OpenAI(base_url=self.base, api_key=s["api_key"], max_retries=2, timeout=120)
        messages = list(s["task"]["messages"])
        for _ in range(2):
            r = client.chat.completions.create(model=s["model"], messages=messages, max_tokens=8)
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": "Are you sure?"}]  # fmt: skip
            time.sleep(0.5)
        client.post(f"/sessions/{s['session_id']}/end", body={"score": True}, cast_to=object)
        with self.lock:
            self.ended.append(s["session_id"])


def replica_tags(run_dir: Path) -> dict[str, str]:
    """The replicas' session tags now (their ids and incarnations, from their heartbeats)."""
    found = RunFile.read(RunLayout(run_dir))
    assert found is not None and found.redis_url
    client = connect(found.redis_url)
    tags = {}
    for i in range(3):
        raw = client.get(REPLICA_KEY_PREFIX + f"rollout-{i}")
        if raw is not None:
            hb = unpack(raw, ReplicaHeartbeat)
            tags[replica_tag(hb.replica_id, hb.incarnation)] = hb.replica_id
    return tags


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_the_router_serves_three_replicas_and_loses_only_a_killed_ones_sessions(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    run_dir, port = tmp_path / "run", free_port()
    flags = ["--engine", "vllm", "--replicas", "3", "--steps", "3", "--set", f"mesh.gateway_port={port}",
             "--set", "rollout.gateway_only=true", "--set", "rollout.claim_idle_ms=15000",
             "--set", "rollout.vllm_kv_cache_gib=1", "--set", "mesh.max_response_tokens=16"]  # fmt: skip
    mesh = start_mesh(tmp_path, *flags)
    agents = Agents(f"http://127.0.0.1:{port}/v1", tmp_path / "up.out")
    threads = [threading.Thread(target=agents.run, daemon=True) for _ in range(8)]
    try:
        deadline = time.monotonic() + 900
        while "ready: router" not in (tmp_path / "up.out").read_text():
            assert mesh.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()[-4000:]
            time.sleep(1)
        for t in threads:
            t.start()
        while len(agents.ended) < 12:  # sessions flowing through every replica
            assert mesh.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()[-4000:]
            time.sleep(0.2)
        victim = None
        while victim is None:  # the replica holding the most open sessions, at least one
            tags = replica_tags(run_dir)
            with agents.lock:
                held = [tags.get(tag_of(sid) or "") for sid in agents.open]
            counts = {r: held.count(r) for r in set(held) if r}
            victim = max(counts, key=counts.__getitem__) if counts else None
            time.sleep(0.05)
        killed_tag = next(t for t, r in tags.items() if r == victim)
        pids = json.loads(RunLayout(run_dir).pids.read_text())
        os.kill(pids[victim], signal.SIGKILL)
        while len(agents.ended) < SESSIONS and mesh.poll() is None:
            assert time.monotonic() < deadline, f"{len(agents.ended)} sessions ended; lost {agents.lost}"
            time.sleep(0.5)
        code = mesh.wait(600)
    finally:
        agents.stop.set()
        if mesh.poll() is None:
            mesh.kill()
    out = (tmp_path / "up.out").read_text()
    print(f"lost: {len(agents.lost)} to the kill, {len(agents.lost_at_stop)} as the mesh stopped")
    assert code == 0, out[-4000:]
    assert len(agents.ended) >= SESSIONS, (len(agents.ended), agents.lost, agents.errors[-5:])
    # the killed replica's sessions, and only those, were lost, each with a clear error
    assert agents.lost and all(tag_of(sid) == killed_tag for sid, _ in agents.lost), (agents.lost, agents.errors[-8:])
    assert all("is lost with its replica" in e or "is over" in e for _, e in agents.lost + agents.lost_at_stop), (
        agents.lost + agents.lost_at_stop
    )
    assert all(tag_of(sid) != killed_tag for sid in agents.ended[-SESSIONS // 2 :])
    code, report = audit(run_dir)  # nothing trained twice, nothing vanished
    assert code == 0, report
    router_log = (run_dir / "logs" / "router.log").read_text()
    assert "Traceback" not in router_log, router_log[-6000:]
    with pytest.raises(httpx.ConnectError):  # the router stopped with the mesh
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    time.sleep(1)
    assert left_behind(run_dir) == []
