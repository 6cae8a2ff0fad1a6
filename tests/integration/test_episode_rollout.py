"""Episodes through a real replica (a process: the HF engine, vLLM's continuous batching, vLLM's chunked loop) on
the tiny model, against the real environment service over HTTP, published into real Redis: each environment
task's G episodes come out as one group whose samples carry their turns, the environment's tokens rendered by
the chat template exactly, the model's log-probs those of a transformers forward over the whole episode; an
environment that fails is begun again, then dead-lettered; an environment service killed -9 mid-episode and
restarted loses no prompt and publishes none twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from learner.batching import to_tensors
from learner.tiny import tiny_tokenizer
from rollout.engines import Completion
from rollout.engines.base import encode_prompt
from rollout.episodes import Renderer
from rollout.evaluate import load_eval_items
from services.child_process import ROOT, child_env, running, wait_ready
from services.datasets import Item, write_items
from services.episodes import ChatMessage, ResetResponse
from services.redis_server import EmbeddedRedis, free_port
from services.schemas import EvalResult, PromptTask, ScoredGroup, TrainBatch
from services.streams import (
    DEAD_LETTER_STREAM,
    STREAM_EVAL,
    STREAM_PROMPTS,
    StreamProducer,
    connect,
    decode,
    ensure_group,
)
from tests.integration.test_rollout_engines import TOL_HF, TOLERANCE, reference_logprobs
from tests.integration.test_rollout_worker import groups, start, stop, wait_groups
from tests.integration.test_rollout_worker import tasks as single_turn

VLLM = [pytest.mark.slow, pytest.mark.vllm]
FEEDBACK = "That is not right. Try again."


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    with running("env_server", "--workers", "4", ready_path="/readyz") as (base, _):
        yield base


def env_tasks(n: int, g: int = 2, env: str = "retry") -> list[PromptTask]:
    return [PromptTask(task_id=f"e{i}", prompt_id=f"{env}-{i}", prompt=f"{env} seed {i}", n_samples=g,
                       ground_truth=json.dumps({"seed": i}), verifier=f"env:{env}", data_source=f"env/{env}")
            for i in range(n)]  # fmt: skip


def check_episode_group(g: ScoredGroup, env_url: str, model_dir: Path, tol: float) -> int:
    """The opening is the environment's, rendered; every environment turn is the feedback rendered exactly; the
    model's log-probs are a forward's over the whole episode; the learner masks the environment's tokens. The
    number of model turns in the group."""
    seed = json.loads(g.task.ground_truth)["seed"]
    opening = httpx.post(f"{env_url}/v1/episodes", json={"env": "retry", "seed": seed}, timeout=10).json()
    render = Renderer(tiny_tokenizer())
    assert g.task.prompt_token_ids is not None
    prompt = g.task.prompt_token_ids.tolist()
    assert prompt == render.opening(ResetResponse.model_validate(opening).messages)
    turns = 0
    for s, score in zip(g.samples, g.scores, strict=True):
        assert s.turns and s.episode and s.episode.env == "retry" and s.schema_version == 4
        assert [t.role for t in s.turns][::2] == ["model"] * ((len(s.turns) + 1) // 2)  # model, env, model, ...
        ids, at = s.response_token_ids.tolist(), 0
        for t in s.turns:
            part = ids[at : at + t.tokens]
            if t.role == "env":
                # the tiny tokenizer's end of sequence is not the start of its template's closing ("\n"): nothing
                # of the closing is ever in the model's turn, as after a turn cut by the length limit
                want = render.continuation(ids[:at], "length", [ChatMessage(role="user", content=FEEDBACK)])
                assert part == want, (render.tok.decode(part), render.tok.decode(want))
            at += t.tokens
        assert s.episode.model_turns == sum(t.role == "model" for t in s.turns)
        assert s.episode.ended == "done" and (score.reward == 1.0 or s.episode.model_turns == 2)
        ref = reference_logprobs(model_dir, prompt, Completion(ids, "", s.logprobs.tolist(), "stop"))
        mask = s.loss_mask()
        gap = max(abs(a - b) for a, b, m in zip(s.logprobs.tolist(), ref, mask, strict=True) if m)
        assert gap <= tol, f"model tokens' log-probs differ from a forward by {gap}"
        turns += s.episode.model_turns
    t = to_tensors(TrainBatch.assemble(0, [g]), pad_id=0)
    for i, s in enumerate(g.samples):
        assert t.response_mask[i, len(prompt) : len(prompt) + len(s.response_token_ids)].tolist() == s.loss_mask()
    return turns


@pytest.mark.parametrize(
    ("engine", "tol"),
    [("hf", TOL_HF["fp32"]), pytest.param("vllm", TOLERANCE["fp32"], marks=VLLM),
     pytest.param("vllm --no-stream", TOLERANCE["fp32"], marks=VLLM)],
)  # fmt: skip
def test_env_tasks_become_token_exact_episode_groups(
    model_dir: Path, server: EmbeddedRedis, env_url: str, engine: str, tol: float
) -> None:
    client = connect(server.url)
    ensure_group(client, STREAM_PROMPTS, "rollout")
    StreamProducer(client, STREAM_PROMPTS).publish_many(env_tasks(4))
    name, *extra = engine.split()
    proc = start(model_dir, server.url, "http://127.0.0.1:9", "r0", "--env-url", env_url, "--dtype", "fp32",
                 "--max-episode-tokens", "400", *extra, engine=name)  # fmt: skip
    try:
        got = wait_groups(client, 4, timeout_s=300)
    finally:
        stop(proc)
    assert sorted(g.task.task_id for g in got) == ["e0", "e1", "e2", "e3"]
    turns = sum(check_episode_group(g, env_url, model_dir, tol) for g in got)
    assert turns > 8  # a random model is mostly wrong: most episodes take both attempts
    assert client.xlen(DEAD_LETTER_STREAM) == 0


@pytest.mark.parametrize(
    ("engine", "tol"), [("hf", TOL_HF["fp32"]), pytest.param("vllm", TOLERANCE["fp32"], marks=VLLM)]
)
def test_single_turn_prompts_and_environment_tasks_take_one_rollout_path(
    model_dir: Path, server: EmbeddedRedis, env_url: str, reward_url: str, engine: str, tol: float
) -> None:
    """One stream of both kinds through one replica (the chunked loop, continuous batching): a single-turn
    prompt's group comes out as single-turn samples (no turns, scored by the reward server with overlong shaping
    on its own prompt tokens), an environment task's as its episodes; nothing dead-lettered or left pending."""
    client = connect(server.url)
    ensure_group(client, STREAM_PROMPTS, "rollout")
    mixed = [t for pair in zip(single_turn(3), env_tasks(3), strict=True) for t in pair]
    StreamProducer(client, STREAM_PROMPTS).publish_many(mixed)
    proc = start(model_dir, server.url, reward_url, "r0", "--env-url", env_url, "--dtype", "fp32",
                 "--max-episode-tokens", "400", engine=engine)  # fmt: skip
    try:
        got = {g.task.task_id: g for g in wait_groups(client, 6, timeout_s=300)}
    finally:
        stop(proc)
    assert sorted(got) == ["e0", "e1", "e2", "t0", "t1", "t2"]
    tok = tiny_tokenizer()
    for i in range(3):
        g = got[f"t{i}"]
        assert g.task.prompt_token_ids is not None
        assert g.task.prompt_token_ids.tolist() == encode_prompt(tok, g.task.prompt or "", chat_template=True)
        assert len(g.samples) == 3
        for s, sc in zip(g.samples, g.scores, strict=True):
            assert s.turns is None and s.episode is None and len(s.logprobs) == len(s.response_token_ids)
            assert sc.acc == ("answer" not in s.response_text[-300:].lower())  # the reward server's verdict
            n = len(s.response_token_ids)  # L_max 16, L_cache 3 (test_rollout_worker.py)
            assert sc.reward == pytest.approx((1.0 if sc.acc else -1.0) + (0.0 if n <= 13 else (13 - n) / 3))
        check_episode_group(got[f"e{i}"], env_url, model_dir, tol)
    assert client.xlen(DEAD_LETTER_STREAM) == 0
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 0


def dead_letters(client: redis.Redis) -> list[dict[bytes, bytes]]:
    return [f for _, f in client.xrange(DEAD_LETTER_STREAM)]


def test_an_environment_that_fails_is_begun_again_then_dead_lettered(model_dir: Path, server: EmbeddedRedis) -> None:
    """An environment whose step raises (`error` in the answer) or whose reset is slower than the service allows
    (504): each episode is begun again, then the prompt is dead-lettered with the reason (a slow reset is not an
    outage to wait out for ever); a malformed environment task is dead-lettered at once."""
    client = connect(server.url)
    ensure_group(client, STREAM_PROMPTS, "rollout")
    broken = [t.model_copy(update={"verifier": "env:broken"}) for t in env_tasks(2)]
    slow_reset = json.dumps({"task": {"reset_seconds": 1.5}})  # past the service's --step-timeout-s: a 504
    slow = env_tasks(1)[0].model_copy(update={"task_id": "slow", "verifier": "env:sleepy", "ground_truth": slow_reset})
    bad = env_tasks(1)[0].model_copy(update={"task_id": "bad", "ground_truth": "17"})
    StreamProducer(client, STREAM_PROMPTS).publish_many([*broken, slow, bad])
    plugins = ("--env-classes", "tests.integration.env_plugins:Broken,tests.integration.env_plugins:Sleepy")
    with running("env_server", *plugins, "--step-timeout-s", "1", ready_path="/readyz") as (url, _):
        proc = start(model_dir, server.url, "http://127.0.0.1:9", "r0", "--env-url", url, "--episode-retries", "1")
        try:
            deadline = time.monotonic() + 120
            while len(dead_letters(client)) < 4:
                assert time.monotonic() < deadline, f"dead letters: {dead_letters(client)}"
                time.sleep(0.2)
        finally:
            stop(proc)
    kinds = sorted(f[b"kind"].decode() for f in dead_letters(client))
    assert kinds == ["env_failed", "env_failed", "env_failed", "env_task_invalid"], kinds
    detail = b" ".join(f[b"reason"] for f in dead_letters(client)).decode()
    assert "failed 2 times" in detail and "RuntimeError: a bug in the environment" in detail
    assert "(504): sleepy took over 1 s to reset" in detail
    assert '{"seed": n[, "split": s]}' in detail  # what an env task's ground truth must be
    assert groups(client) == []


def test_an_unreachable_environment_service_holds_the_prompts(model_dir: Path, server: EmbeddedRedis,
                                                              tmp_path: Path) -> None:  # fmt: skip
    """No environment service at all: an outage, not the prompts' fault — the episodes are begun again with
    backoff, nothing is dead-lettered, the prompts stay pending (and go to another replica if this one leaves)."""
    client = connect(server.url)
    ensure_group(client, STREAM_PROMPTS, "rollout")
    StreamProducer(client, STREAM_PROMPTS).publish_many(env_tasks(2))
    log = tmp_path / "r0.log"
    args = ["--engine", "hf", "--model-dir", str(model_dir), "--redis-url", server.url, "--port", str(free_port()),
            "--replica-id", "r0", "--env-url", f"http://127.0.0.1:{free_port()}", "--env-retries", "0"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "rollout", *args], env=child_env(OMP_NUM_THREADS="1"), cwd=ROOT,
                            stderr=log.open("wb"))  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while log.read_text().count("the environment service is unreachable") < 8:  # 2 prompts x 2 episodes, twice
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 2
    finally:
        stop(proc)
    assert dead_letters(client) == [] and groups(client) == []
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 2  # left for another replica


def test_the_environment_service_killed_mid_episode_loses_and_duplicates_nothing(
    model_dir: Path, server: EmbeddedRedis, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "env_server", "--port", str(port)]

    def env_service() -> subprocess.Popen[bytes]:
        p = subprocess.Popen([*cmd, "--env-classes", "tests.integration.env_plugins:Sleepy"], env=child_env(),
                             cwd=ROOT, stderr=(tmp_path / "env.log").open("ab"))  # fmt: skip
        wait_ready(p, f"{url}/readyz", name="env_server", timeout_s=60)
        return p

    client = connect(server.url)
    ensure_group(client, STREAM_PROMPTS, "rollout")
    slow = [t.model_copy(update={"verifier": "env:sleepy", "ground_truth": json.dumps({"task": {"seconds": 0.5}})})
            for t in env_tasks(8, g=2)]  # fmt: skip
    StreamProducer(client, STREAM_PROMPTS).publish_many(slow)
    env = env_service()
    proc = start(model_dir, server.url, "http://127.0.0.1:9", "r0", "--env-url", url, "--env-retries", "2",
                 "--episode-retries", "3")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not groups(client):
            assert time.monotonic() < deadline, "no group before the kill"
            time.sleep(0.05)
        env.kill()  # -9, episodes in flight
        env.wait(10)
        time.sleep(1.0)
        env = env_service()  # the same address, none of the old episodes
        got = wait_groups(client, 8, timeout_s=180)
    finally:
        stop(proc)
        env.kill()
    assert sorted(g.task.task_id for g in got) == sorted(f"e{i}" for i in range(8))  # each once
    assert client.xlen(DEAD_LETTER_STREAM) == 0
    assert all(s.episode and s.episode.ended == "done" for g in got for s in g.samples)


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=VLLM)])
def test_held_out_environment_tasks_are_evaluated_as_episodes(
    model_dir: Path, server: EmbeddedRedis, env_url: str, reward_url: str, engine: str, tmp_path: Path
) -> None:
    """A replica's held-out evaluation of a file mixing `env:retry` tasks and single-turn items: k episodes per
    environment task (success = a positive reward), k samples per single-turn item scored by the reward server,
    reported per task. The chunked loop runs it seeded, turn by turn; continuous batching beside training's
    episodes (`--eval-mode shared`), so it reports the versions of its tokens (the seeded run does not)."""
    client = connect(server.url)
    held_out = tmp_path / "eval.jsonl"
    single = [Item(f"s{i}", f"Say something about {i}.", "[INVALID]", "dapo_math", "test") for i in range(2)]
    write_items(held_out, [*load_eval_items("env:retry", size=3), *single])
    ensure_group(client, STREAM_PROMPTS, "rollout")
    StreamProducer(client, STREAM_PROMPTS).publish_many(env_tasks(4))  # training's episodes beside it
    proc = start(model_dir, server.url, reward_url, "r0", "--env-url", env_url, "--eval-every", "1",
                 "--eval-data", str(held_out), "--eval-size", "5", "--eval-k", "2", engine=engine)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not client.xlen(STREAM_EVAL):
            assert time.monotonic() < deadline, "no held-out evaluation"
            assert proc.poll() is None, "the replica exited"
            time.sleep(0.2)
        wait_groups(client, 4, timeout_s=240)
    finally:
        stop(proc)
    result = decode(client.xrange(STREAM_EVAL)[0][1], EvalResult)
    assert (result.k, result.n_prompts, sorted(result.by_task)) == (2, 5, ["env/retry", "test"])
    assert 0 <= result.avg_at_k <= 1 and result.mean_response_tokens > 0
    if engine == "vllm":  # shared: the versions of the tokens it sampled, model tokens only
        assert result.mean_token_version == 0.0 and result.newest_version == 0 and result.later_token_frac == 0.0
    else:
        assert result.mean_token_version is None
    assert client.xlen(DEAD_LETTER_STREAM) == 0


def test_each_turn_of_a_seeded_episode_draws_its_own_random_stream(env_url: str, model_dir: Path) -> None:
    """Episodes run turn by turn (the chunked loop, the seeded evaluation) with a seed: the second turn is sampled
    with a seed of its own, not the first turn's again (turn k replayed turn 1's random numbers), and the same seed
    gives the same episodes again. Unseeded, each run draws fresh randomness: two engines give different texts."""
    from prometheus_client import CollectorRegistry

    from rollout.engines import SamplingParams, load_engine
    from rollout.episode_runner import EpisodeRunner, run_items
    from rollout.metrics import RolloutMetrics
    from rollout.settings import RolloutSettings

    engine = load_engine(model_dir, "hf")
    calls: list[int | None] = []
    generate = engine.generate

    def recorded(prompts, n, params):  # type: ignore[no-untyped-def]
        calls.append(params.seed)
        return generate(prompts, n, params)

    engine.generate = recorded  # type: ignore[method-assign]
    s = RolloutSettings(model_dir=model_dir, env_url=env_url)  # type: ignore[call-arg]

    def episodes(seed: int | None) -> list[list[int]]:
        runner = EpisodeRunner(s, engine.tokenizer, RolloutMetrics(CollectorRegistry()), hold_outages=False)
        got = run_items(runner, engine, env_tasks(4, g=2), SamplingParams(max_tokens=6, seed=seed))
        runner.close()
        return [e.ids for eps in got.values() for e in eps]

    first = episodes(7)
    assert len(calls) >= 2 and calls[0] == 7 and len(set(calls)) == len(calls), calls  # a seed per turn
    assert episodes(7) == first  # seeded: the same episodes again
    texts = []
    for _ in range(2):  # unseeded, in two processes: fresh randomness in each
        code = f"""
from rollout.engines import SamplingParams, load_engine
from rollout.engines.base import encode_prompt
e = load_engine({str(model_dir)!r}, "hf")
print(e.generate([encode_prompt(e.tokenizer, "Hi")], 4, SamplingParams(max_tokens=12))[0])
"""
        texts.append(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True,
                                    text=True, timeout=120, check=True).stdout)  # fmt: skip
    assert texts[0] != texts[1]
