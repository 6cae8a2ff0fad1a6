"""Fuzzing the HTTP services with schemathesis, over real HTTP against real processes: cases generated
from each service's own OpenAPI schema (valid and invalid ones), sent with the bearer token. Whatever
they send: no 5xx, no hang (every call has a timeout), no crash (the process still answers after).
The reward server and the gateway are fuzzed for a time (FUZZ_S: as many cases as the machine generates in it,
their count printed and held to a floor), the others by a count of cases; the buffer stands for the services
built only from the shared app (learner and rollout serve the same endpoints from the same code)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from services.child_process import ROOT, child_env, running
from services.redis_server import EmbeddedRedis

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation import GenerationMode  # noqa: E402

TOKEN = "fuzz-token-0123456789"
FUZZ_S = 60.0  # seconds of generated cases per half (valid, invalid) where a test is sized by time
REWARD_BUDGET = {("POST", "/v1/score"): 10_000, ("GET", "/readyz"): 400, ("GET", "/config"): 400,
                 ("GET", "/metrics"): 400}  # fmt: skip
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


class TimeUp(Exception):
    """An operation's share of a fuzz sized by time is spent (raised from a case, caught around the run)."""


def fuzz(
    base: str,
    budget: dict[tuple[str, str], int],
    modes: tuple[GenerationMode, ...] = MODES,
    prepare: Callable[[Any], None] | None = None,
    to: str | None = None,
    default: int = 200,
    seconds: float | None = None,
) -> Counter[str]:
    """Run `budget[(method, path)]` generated cases per operation (half valid, half invalid; `modes` says which
    halves this call runs) of `base`'s schema, sent to `to` (default: `base`); `prepare` may change a case before it
    is sent. `seconds`: sized by time instead — each operation and half gets its share of it by its budget, and
    runs as many cases as fit (its budget a ceiling)."""
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=HEADERS)  # served with --api-docs
    to = to or base
    stats: Counter[str] = Counter()
    ops = [result.ok() for result in schema.get_all_operations()]
    sizes = [budget.get((op.method.upper(), op.path), default) for op in ops]
    clock = {"until": math.inf}  # the current operation's end (sized by time)
    for op, n in zip(ops, sizes, strict=True):
        for mode in modes:
            share = None if seconds is None else seconds * n / sum(sizes) / len(modes)
            clock["until"] = math.inf if share is None else time.monotonic() + share

            @settings(max_examples=n // 2, deadline=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.generate], derandomize=True, database=None)  # fmt: skip
            @given(case=op.as_strategy(generation_mode=mode))
            def call(case) -> None:  # type: ignore[no-untyped-def]
                if time.monotonic() > clock["until"]:
                    raise TimeUp  # this operation's share of the time is spent
                if prepare is not None:
                    prepare(case)
                r = case.call(base_url=to, headers=HEADERS, timeout=15)  # a hang fails the test
                stats["cases"] += 1
                stats[f"{r.status_code // 100}xx"] += 1
                assert r.status_code < 500, f"{case.method} {case.path} -> {r.status_code}: {r.text[:300]}"

            try:
                call()
            except TimeUp:
                pass
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                assert mode == GenerationMode.NEGATIVE
    assert httpx.get(f"{to}/healthz", timeout=5).status_code == 200  # still alive
    return stats


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reward_server_survives_a_minute_of_generated_requests(tmp_path: Path) -> None:
    """FUZZ_S of valid cases here and FUZZ_S of invalid ones from a second process at the same time (~2,400 cases
    each on this machine: ~25 ms a case)."""
    log = tmp_path / "reward.log"
    with running("reward_server", "--workers", "2", "--api-docs", env={"DAPO_AUTH_TOKEN": TOKEN},
                 ready_path="/readyz", token=TOKEN, log=log) as (base, proc):  # fmt: skip
        # generating cases is what takes the time (one core, ~25 ms a case): the invalid half is generated and sent
        # by a second process at the same time (its numbers come back as JSON on its stdout)
        half = subprocess.Popen([sys.executable, "-m", "tests.integration.test_fuzz_http", base], cwd=ROOT,
                                env=child_env(), stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            stats = fuzz(base, REWARD_BUDGET, modes=(GenerationMode.POSITIVE,), seconds=FUZZ_S)
            out, _ = half.communicate(timeout=500)
        finally:
            half.kill()
        assert half.returncode == 0, "the invalid half failed (its stderr is above)"
        stats.update(json.loads(out.splitlines()[-1]))
        assert proc.poll() is None
    print(f"reward server fuzz: {dict(stats)}")
    assert stats["cases"] >= 1_500 and stats["5xx"] == 0  # the floor: a quarter of what this machine runs
    assert stats["4xx"] > 300  # the invalid half really was invalid, and answered with a 4xx
    assert stats["2xx"] > 500  # and the valid half really reached the verifiers


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with EmbeddedRedis(tmp_path / "redis") as s:
        yield s.url


@pytest.mark.slow
def test_buffer_http_survives_generated_requests(tmp_path: Path, redis_url: str) -> None:
    args = ["--redis-url", redis_url, "--api-docs", "--run-dir", str(tmp_path / "run"),
            "--dataset-size", "50", "--eval-size", "5"]  # fmt: skip
    with running("buffer", *args, env={"DAPO_AUTH_TOKEN": TOKEN}, token=TOKEN, ready_path="/readyz") as (base, proc):
        stats = fuzz(base, {})
        assert proc.poll() is None
    print(f"buffer fuzz: {dict(stats)}")
    assert stats["cases"] >= 300 and stats["5xx"] == 0  # parameterless GETs: few distinct cases exist


ENV_BUDGET = {("POST", "/v1/episodes"): 400, ("POST", "/v1/episodes/{episode_id}/step"): 400,
              ("DELETE", "/v1/episodes/{episode_id}"): 100, ("GET", "/v1/envs"): 100}  # fmt: skip


@pytest.mark.slow
def test_env_server_survives_1000_generated_requests(tmp_path: Path) -> None:
    """Resets with generated tasks and seeds, steps with generated messages and turns (to ids that exist or
    not), deletes: every answer is a 2xx or a 4xx."""
    with running("env_server", "--api-docs", env={"DAPO_AUTH_TOKEN": TOKEN}, ready_path="/readyz", token=TOKEN,
                 log=tmp_path / "env.log") as (base, proc):  # fmt: skip
        for seed in range(20):  # episodes the generated steps can hit (schemathesis draws ids it likes, too)
            httpx.post(f"{base}/v1/episodes", json={"env": "calculator", "seed": seed, "episode_id": f"e{seed}"},
                       headers=HEADERS, timeout=10).raise_for_status()  # fmt: skip
        stats = fuzz(base, ENV_BUDGET)
        assert proc.poll() is None
    print(f"environment service fuzz: {dict(stats)}")
    assert stats["cases"] >= 1_000 and stats["5xx"] == 0
    assert stats["2xx"] > 200 and stats["4xx"] > 200


SANDBOX_BUDGET = {("POST", "/v1/run"): 400, ("POST", "/v1/batch"): 200}


@pytest.mark.slow
def test_sandbox_survives_generated_programs_and_limits(tmp_path: Path) -> None:
    """Generated programs (mostly not Python), stdins, files and limits, valid and not, run for real in the sandbox:
    every answer is a 2xx (it ran, whatever its verdict) or a 4xx — never the sandbox failing to start one (503)."""
    args = ["--api-docs", "--wall-s", "2", "--max-wall-s", "5", "--cpu-s", "2", "--max-cpu-s", "5", "--max-batch", "16"]
    with running("sandbox", *args, env={"DAPO_AUTH_TOKEN": TOKEN}, ready_path="/readyz", token=TOKEN,
                 log=tmp_path / "sandbox.log") as (base, proc):  # fmt: skip
        stats = fuzz(base, SANDBOX_BUDGET)
        assert proc.poll() is None
    print(f"sandbox fuzz: {dict(stats)}")
    assert stats["cases"] >= 600 and stats["5xx"] == 0
    assert stats["2xx"] > 100 and stats["4xx"] > 100


GATEWAY_BUDGET = {("POST", "/v1/chat/completions"): 1000, ("POST", "/v1/completions"): 600,
                  ("POST", "/v1/sessions"): 200, ("POST", "/v1/sessions/{sid}/end"): 200,
                  ("GET", "/v1/sessions/{sid}"): 100, ("GET", "/v1/models"): 100,
                  ("GET", "/v1/models/{model}"): 100}  # fmt: skip


def served_model(case: Any) -> None:
    """Generated bodies name the model served (an unknown one is a 404 before anything else is looked at, and is
    tested on its own): the rest of each case reaches the validation and the engine."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "policy"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_gateway_survives_a_minute_of_generated_requests(tmp_path: Path, model_dir: Path, reward_url: str) -> None:
    """The OpenAI-compatible gateway on a vLLM replica (tiny model): generated chat completions, completions and
    session calls, valid and not, sent with the mesh token (calls not captured) or without a task to hand out.
    Whatever they send: no 5xx, the replica still serves after. Then the same schema's cases through the router in
    front of it (the one endpoint): no 5xx either, and both still serve."""
    from services.redis_server import free_port

    with EmbeddedRedis(tmp_path / "redis") as server:
        gport = free_port()
        args = ["--engine", "vllm", "--model-dir", str(model_dir), "--redis-url", server.url, "--reward-url",
                reward_url, "--gateway-port", str(gport), "--gateway-only",
                "--gateway-max-tokens", "4", "--gateway-max-n", "2", "--gateway-open-wait-s", "0.05",
                "--gateway-max-context", "256"]  # fmt: skip
        env = {"OMP_NUM_THREADS": "1", "DAPO_AUTH_TOKEN": TOKEN}
        with running("rollout", *args, env=env, ready_path="/readyz", token=TOKEN,
                     timeout_s=300, log=tmp_path / "rollout.log") as (_, proc):  # fmt: skip
            base = f"http://127.0.0.1:{gport}"
            stats = fuzz(base, GATEWAY_BUDGET, prepare=served_model, seconds=FUZZ_S)  # both halves in one minute
            assert proc.poll() is None
            router_env = {"DAPO_AUTH_TOKEN": TOKEN, "DAPO_REDIS_URL": server.url}
            with running("router", "--api-docs", env=router_env, ready_path="/readyz", token=TOKEN,
                         log=tmp_path / "router.log") as (router, router_proc):  # fmt: skip
                routed = fuzz(base, {}, prepare=served_model, to=router, default=100)
                assert router_proc.poll() is None
                ops = fuzz(router, {}, default=40)  # the router's own routes: health, readiness, metrics, config
            assert proc.poll() is None
            r = httpx.post(f"{base}/v1/chat/completions", headers=HEADERS, timeout=30,
                           json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
            assert r.status_code == 200, r.text  # still generating
    print(f"gateway fuzz: {dict(stats)}; through the router: {dict(routed)}; the router's own: {dict(ops)}")
    assert stats["cases"] >= 400 and stats["5xx"] == 0  # the floor: a third of what fits in a minute here
    assert stats["2xx"] > 50 and stats["4xx"] > 100
    assert routed["cases"] >= 500 and routed["5xx"] == 0 and routed["2xx"] > 50 and routed["4xx"] > 100
    assert ops["cases"] >= 20 and ops["5xx"] == 0


if __name__ == "__main__":  # the reward server test's second process: the invalid half, stats as JSON
    print(json.dumps(fuzz(sys.argv[1], REWARD_BUDGET, modes=(GenerationMode.NEGATIVE,), seconds=FUZZ_S)))
