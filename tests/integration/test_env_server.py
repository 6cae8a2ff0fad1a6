"""The environment service over real HTTP (a real uvicorn process): the dapo-env/1 protocol checked by the
conformance checker against it and against a third-party server written from the docs alone; the built-in
environments' episodes, tool calls good and bad; an environment that hangs or raises ends its episode, not the
service; capacity (429 + Retry-After) and idle expiry; metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from env_server.conformance import Checker
from learner.tiny import tiny_tokenizer
from rollout.engines.base import SamplingParams
from rollout.env_client import EnvClient, EnvUnavailable
from rollout.episode_runner import EpisodeRunner
from rollout.metrics import RolloutMetrics
from rollout.settings import RolloutSettings
from services.child_process import ROOT, child_env, running
from services.schemas import PromptTask
from services.streams import Delivery
from services.tool_calls import render_call
from tests.integration.env_http import reset, step
from tests.integration.third_party_env import serve

TOKEN = "env-token-0123456789"
PLUGINS = ",".join(f"tests.integration.env_plugins:{c}" for c in ("Sleepy", "Broken", "TasksOnly"))


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    args = ("--workers", "2", "--env-classes", PLUGINS, "--step-timeout-s", "1", "--queue-timeout-s", "0.5")
    with running("env_server", *args, env={"DAPO_AUTH_TOKEN": TOKEN}, ready_path="/readyz", token=TOKEN) as (base, _):
        yield base


@pytest.fixture
def http(env_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
        yield c


def test_the_built_in_service_passes_the_conformance_checker(env_url: str) -> None:
    report = Checker(env_url, TOKEN).run(["calculator", "retry"])  # not the tests' odd ones
    assert report.ok, report.failed
    for env in ("calculator", "retry"):
        assert f"{env}: steps until done within max_turns; a retried step answers the same" in report.passed
    assert "calculator: bad tool calls come back to the model, counted" in report.passed
    assert "a request without the token is 401" in report.passed
    cli = subprocess.run([sys.executable, "-m", "env_server.conformance", env_url, "--env", "retry"],
                         cwd=ROOT, env=child_env(DAPO_ENV_TOKEN=TOKEN), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert cli.returncode == 0 and " 0 failed" in cli.stdout, cli.stdout + cli.stderr


def test_a_third_party_server_from_the_docs_passes_and_a_broken_one_does_not() -> None:
    with serve() as url:
        report = Checker(url).run()
    assert report.ok, report.failed
    assert len(report.passed) >= 9
    with serve(bug="retry") as url:
        report = Checker(url).run()
    assert any("a retried step answered" in f or "expected 200, got 409" in f for f in report.failed), report.failed
    with serve(bug="endless") as url:
        report = Checker(url).run()
    assert any("not done after max_turns" in f for f in report.failed), report.failed


def test_the_example_environment_server_passes_the_checker_behind_its_token() -> None:
    """examples/env_server.py — the server the docs' "your own server" runs and configs/agents-external.toml trains
    against — passes every check, its token required; its held-out split never serves a training question."""
    import threading

    from examples.env_server import POOLS, make_server

    server = make_server("127.0.0.1", 0, token="its-token")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        report = Checker(url, "its-token").run()
        assert report.ok, report.failed
        assert "a request without the token is 401" in report.passed
        auth = {"Authorization": "Bearer its-token"}
        asked = {
            split: {
                httpx.post(
                    f"{url}/v1/episodes", json={"env": "arith", "seed": seed, "split": split}, headers=auth, timeout=10
                ).json()["task_id"]
                for seed in range(200)
            }  # fmt: skip
            for split in ("train", "eval")
        }
        assert asked["train"] and asked["eval"] and not asked["train"] & asked["eval"]
        assert len(POOLS["eval"]) * 2 < len(POOLS["train"]) < len(POOLS["eval"]) * 3  # a third held out
    finally:
        server.shutdown()
        server.server_close()


def test_calculator_a_tool_call_then_the_answer(http: httpx.Client) -> None:
    opening = reset(http, "calculator", task={"expression": "417 * 38 + 123"})
    assert opening.messages[-1].content == "What is 417 * 38 + 123?"
    shown = [(m.role, m.content) for m in opening.messages[1:-1]]  # the format, by an example exchange
    assert shown == [("user", "What is 23 * 4?"), ("assistant", "<calculator>23 * 4</calculator>"), ("tool", "92"),
                     ("assistant", "Answer: 92")]  # fmt: skip
    drawn = {reset(http, "calculator", seed=s).messages[-1].content.split()[0] for s in range(12)}
    assert {"What", "Multiply", "Compute"} <= drawn  # drawn tasks come in several wordings
    assert [t.function.name for t in opening.tools] == ["calculator"]
    out = step(http, opening.episode_id, 1, "Let me compute. <calculator>417*38+123</calculator>")
    assert not out.done and out.tools.valid == 1 and out.reward is None
    assert out.messages[0].role == "tool" and out.messages[0].content == "15969"
    assert out.messages[0].name == "calculator" and out.messages[0].tool_call_id == "call_1_0"
    out = step(http, opening.episode_id, 2, "Answer: 15969")
    assert out.done and out.reward == 1.0 and not out.truncated

    wrong = reset(http, "calculator", task={"expression": "417 * 38 + 123"})
    out = step(http, wrong.episode_id, 1, "Answer: 15968")
    assert out.done and out.reward == -1.0


def test_calculator_tool_errors_reach_the_model_and_turns_run_out(http: httpx.Client) -> None:
    eid = reset(http, "calculator", seed=7).episode_id
    out = step(http, eid, 1, "<calculator>__import__('os').system('id')</calculator>")
    assert out.tools.failed == 1 and "error: calculator failed" in out.messages[0].content and not out.done
    out = step(http, eid, 2, "<calculator>1 + </calculator>")
    assert out.tools.failed == 1 and "not an arithmetic expression" in out.messages[0].content
    out = step(http, eid, 3, "<calculator>1+1</calculator> and <calculator>2 * (3")
    assert (out.tools.valid, out.tools.malformed) == (1, 1) and len(out.messages) == 2
    assert "never closed" in out.messages[0].content and out.messages[1].content == "2"
    out = step(http, eid, 4, "<calculator>2+2</calculator>")
    assert out.done and out.truncated and out.reward == -1.0  # max_turns = 4, still calling tools


def test_hermes_tool_calls_reach_the_tools_and_their_errors_the_model() -> None:
    """The JSON format (the default of an environment with tools), on a user's environment loaded by the service."""
    args = ("--env-classes", "tests.integration.env_plugins:Lookup")
    with running("env_server", *args, ready_path="/readyz") as (base, _), httpx.Client(base_url=base) as http:
        eid = reset(http, "lookup", seed=1).episode_id
        out = step(http, eid, 1, render_call("capital", {"country": "France"}) + render_call("web_search", {}))
        assert (out.tools.valid, out.tools.unknown) == (1, 1) and out.messages[0].content == "Paris"
        assert "there is no tool 'web_search'" in out.messages[1].content
        out = step(http, eid, 2, render_call("capital", {"state": "France"}))  # a wrong argument name
        assert out.tools.failed == 1 and "unexpected keyword" in out.messages[0].content
        assert Checker(base).run(["lookup"]).ok


def test_a_retried_step_must_ask_the_same_and_a_seed_needs_an_environment_that_draws(http: httpx.Client) -> None:
    eid = reset(http, "retry", task={"expression": "47 + 86"}).episode_id
    first = step(http, eid, 1, "Answer: 100")
    assert step(http, eid, 1, "Answer: 100") == first  # a retry: the same answer, the environment not run again
    r = http.post(f"/v1/episodes/{eid}/step", json={"turn": 1, "message": {"role": "assistant", "content": "133"}})
    assert r.status_code == 409 and "answered for another message" in r.text  # another rollout's turn 1
    r = http.post("/v1/episodes", json={"env": "tasks-only", "seed": 3})
    assert r.status_code == 422 and "tasks-only draws no task from a seed" in r.text
    assert reset(http, "tasks-only", task={"anything": 1}).messages[0].content == "Say anything."


def test_retry_feedback_until_right_or_out_of_attempts(http: httpx.Client) -> None:
    eid = reset(http, "retry", task={"expression": "47 + 86 - 39"}).episode_id
    out = step(http, eid, 1, "Answer: 100")
    assert not out.done and out.messages[0].role == "user" and "not right" in out.messages[0].content
    out = step(http, eid, 2, "Sorry, it is 94. Answer: 94")
    assert out.done and out.reward == 1.0 and out.info["attempts"] == 2
    eid = reset(http, "retry", task={"expression": "47 + 86 - 39"}).episode_id
    outs = [step(http, eid, t, "Answer: 1") for t in (1, 2)]
    assert [o.done for o in outs] == [False, True] and outs[-1].reward == -1.0 and not outs[-1].truncated


def test_a_task_that_is_not_one_is_422_with_the_reason(http: httpx.Client) -> None:
    r = http.post("/v1/episodes", json={"env": "calculator", "task": {"expression": "open('/etc/passwd')"}})
    assert r.status_code == 422 and "expression" in r.text
    r = http.post("/v1/episodes", json={"env": "calculator", "task": {"expression": "1 +"}})
    assert r.status_code == 422 and "not an arithmetic expression" in r.text
    r = http.post("/v1/episodes", json={"env": "retry", "seed": 1, "task": {"expression": "1"}})
    assert r.status_code == 422 and "exactly one of" in r.text


def test_an_environment_that_hangs_or_raises_ends_its_episode_not_the_service(http: httpx.Client) -> None:
    eid = reset(http, "sleepy", task={"seconds": 3}).episode_id
    t0 = time.monotonic()
    out = step(http, eid, 1, "hello")
    assert out.done and out.error and "took over 1 s" in out.error and time.monotonic() - t0 < 2.5
    ready = http.get("/readyz").json()
    assert "(1 stuck)" in ready["detail"]  # its thread still sleeps, holding one of the 2 workers
    assert http.get("/metrics").text.count('dapo_env_timeouts_total{env="sleepy"} 1.0') == 1
    # the other worker still serves; a third request finds none free within the queue timeout -> 429
    blocker, waiting = reset(http, "sleepy", task={"seconds": 0.8}).episode_id, reset(http, "retry", seed=1).episode_id
    with httpx.Client(base_url=str(http.base_url), headers=http.headers, timeout=30) as other:
        t = threading.Thread(target=step, args=(other, blocker, 1, "x"))
        t.start()
        time.sleep(0.2)
        body = {"turn": 1, "message": {"role": "assistant", "content": "1"}}
        r = http.post(f"/v1/episodes/{waiting}/step", json=body)
        t.join()
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert http.post(f"/v1/episodes/{waiting}/step", json=body).status_code == 200  # the turn was not used up
    out = step(http, reset(http, "broken", seed=1).episode_id, 1, "hello")
    assert out.done and out.error and "RuntimeError: a bug in the environment" in out.error
    time.sleep(2)  # the sleeper returns: its worker is free again
    assert "(0 stuck)" in http.get("/readyz").json()["detail"]
    assert step(http, reset(http, "retry", task={"expression": "1 + 1"}).episode_id, 1, "2").reward == 1.0
    r = http.post("/v1/episodes", json={"env": "sleepy", "task": {"reset_seconds": 1.6}})
    assert r.status_code == 504 and "took over 1 s to reset" in r.text  # slow, not broken (500 is not retried)
    time.sleep(1)  # its worker frees up


def test_capacity_and_idle_expiry() -> None:
    args = ("--max-open-episodes", "2", "--episode-ttl-s", "1")
    with running("env_server", *args, ready_path="/readyz") as (base, _), httpx.Client(base_url=base) as http:
        a, _b = reset(http, "retry", seed=1), reset(http, "retry", seed=2)
        r = http.post("/v1/episodes", json={"env": "retry", "seed": 3})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1" and "2 episodes are open" in r.text
        assert reset(http, "retry", seed=1, episode_id=a.episode_id) == a  # a retried reset is not refused
        time.sleep(1.8)  # idle past the TTL; the sweeper runs every TTL/4
        r = http.post(
            f"/v1/episodes/{a.episode_id}/step", json={"turn": 1, "message": {"role": "assistant", "content": "1"}}
        )
        assert r.status_code == 404 and "idle past 1 s" in r.text
        reset(http, "retry", seed=3)  # room again
        metrics = http.get("/metrics").text
        assert 'dapo_env_episodes_total{env="retry",outcome="expired"} 2.0' in metrics
        assert "dapo_env_episodes_open 1.0" in metrics


def test_concurrent_resets_never_overshoot_the_capacity() -> None:
    """Resets in flight count against --max-open-episodes: six slow resets at once into room for two open two."""
    args = ("--max-open-episodes", "2", "--env-classes", "tests.integration.env_plugins:Sleepy")
    with running("env_server", *args, ready_path="/readyz") as (base, _):

        def one(seed: int) -> int:
            with httpx.Client(base_url=base, timeout=30) as c:
                body = {"env": "sleepy", "task": {"reset_seconds": 0.5, "n": seed}}
                return c.post("/v1/episodes", json=body).status_code

        with ThreadPoolExecutor(6) as pool:
            codes = sorted(pool.map(one, range(6)))
        assert codes == [200, 200, 429, 429, 429, 429], codes


def test_a_reset_whose_answer_is_lost_is_closed_at_once_not_held_until_the_ttl() -> None:
    """The replica's client gives up on a slow reset (its answer lost) and closes the episode it may have opened;
    the service, still opening it, lets it go when the reset ends: the room is free again at once, not after the
    idle TTL (with a service's few sessions, a lost reset would otherwise mean 429s for ten minutes)."""
    args = ("--max-open-episodes", "1", "--env-classes", "tests.integration.env_plugins:Sleepy")  # TTL: 600 s
    with running("env_server", *args, ready_path="/readyz") as (base, _):
        envs = EnvClient(base, timeout_s=0.3, retries=0)
        with pytest.raises(EnvUnavailable):
            envs.reset("sleepy", {"task": {"reset_seconds": 1.0}}, episode_id="lost-1")
        closed = 'dapo_env_episodes_total{env="sleepy",outcome="closed"} 1.0'
        until(lambda: closed in httpx.get(f"{base}/metrics").text, "the lost reset to end, closed")
        opening = envs.reset("sleepy", {"task": {}}, episode_id="next-1")  # the one room: a 429 if "lost-1" held it
        assert opening.response.episode_id == "next-1"
        metrics = httpx.get(f"{base}/metrics").text
        assert closed in metrics and "dapo_env_episodes_open 1.0" in metrics


def until(ok: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(0.1)


def test_a_replica_that_leaves_closes_the_episodes_it_holds_open() -> None:
    """A replica's episode runner told to leave (SIGTERM, a crash of its loop) closes every episode it opened on
    the service — those awaiting their model turn, those whose reset has answered and not been collected yet, and
    those whose reset is still running (closed when it answers) — instead of leaving them to the idle TTL."""
    with running("env_server", "--episode-ttl-s", "600", ready_path="/readyz") as (base, _):
        s = RolloutSettings(model_dir="/nonexistent", env_url=base)  # type: ignore[call-arg]

        def started(n: int) -> EpisodeRunner:
            runner = EpisodeRunner(s, tiny_tokenizer(), RolloutMetrics(CollectorRegistry()))
            for i in range(n):
                t = PromptTask(task_id=f"t{i}", prompt_id=f"p{i}", prompt="retry", verifier="env:retry",
                               ground_truth=json.dumps({"seed": i}), data_source="env/retry", n_samples=2)  # fmt: skip
                runner.start(Delivery(f"1-{i}", t, 1), SamplingParams(max_tokens=8))
            return runner

        def counts() -> tuple[str, str]:
            m = httpx.get(f"{base}/metrics").text
            closed = re.findall(r'outcome="closed"} (\S+)', m) or ["0.0"]  # (no series before the first)
            return re.findall(r"^dapo_env_episodes_open (\S+)$", m, re.M)[0], closed[0]

        runner = started(3)
        until(lambda: runner.collect() or len(runner.ready) == 6, "the resets to come back")  # collected
        assert counts() == ("6.0", "0.0")
        runner.close()
        assert counts() == ("0.0", "6.0")
        runner = started(2)
        until(lambda: all(f.done() for f in runner.calls), "the resets to answer")  # not collected
        runner.close()
        assert counts() == ("0.0", "10.0")
        runner = started(2)
        runner.close()  # the resets in flight
        until(lambda: counts() == ("0.0", "14.0"), "the resets in flight to be closed as they answer")


def test_metrics_count_episodes_turns_and_tool_calls(http: httpx.Client) -> None:
    eid = reset(http, "calculator", task={"expression": "2 * 3 + 4"}).episode_id
    step(http, eid, 1, "<calculator>oops")
    step(http, eid, 2, "<calculator>2*3+4</calculator>")
    step(http, eid, 3, "Answer: 10")
    m = http.get("/metrics").text
    for line in ('dapo_env_tool_calls_total{env="calculator",outcome="malformed"}',
                 'dapo_env_tool_calls_total{env="calculator",outcome="valid"}',
                 'dapo_env_episodes_total{env="calculator",outcome="success"}',
                 'dapo_env_episode_turns_bucket{env="calculator",le="3.0"}',
                 'dapo_env_step_latency_seconds_count{env="calculator",kind="step"}',
                 'dapo_env_requests_total{route="/v1/episodes/{episode_id}/step",status="200"}'):  # fmt: skip
        assert line in m, line


def test_a_replica_whose_token_a_peer_refuses_stops_at_start_up(tmp_path: Path) -> None:
    """A configuration error fails at start-up, before anything runs: a replica whose environment-service token is
    not the service's stops in seconds with what to set — before it loads an engine or takes a prompt (it took
    prompts and dead-lettered them, each a 401) — and one given the service's token by DAPO_AUTH_TOKEN alone does
    not stop there (nor for a peer that does not answer yet)."""
    from learner.tiny import tiny_llama

    model = tiny_llama(tmp_path / "m")
    with running("env_server", env={"DAPO_AUTH_TOKEN": "the-services"}, ready_path="/readyz", token="the-services") as (
        env_url,
        _,
    ):
        args = [sys.executable, "-m", "rollout", "--engine", "hf", "--model-dir", str(model), "--env-url", env_url,
                "--reward-url", "http://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:9/0"]  # fmt: skip
        bad = subprocess.run(args, cwd=ROOT, env=child_env(DAPO_ENV_TOKEN="not-the-services"), capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert bad.returncode != 0
        assert f"the environment service at {env_url}/v1/envs refused this replica's credentials (401" in bad.stderr
        assert "set DAPO_ENV_TOKEN" in bad.stderr and "not-the-services" not in bad.stderr
        good = subprocess.run(args, cwd=ROOT, env=child_env(DAPO_AUTH_TOKEN="the-services"), capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert "refused this replica's credentials" not in good.stderr  # it went on past the checks
        assert "the reward server at http://127.0.0.1:9/v1/score does not answer yet" in good.stderr  # not an error
