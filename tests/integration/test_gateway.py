"""The OpenAI-compatible gateway, driven by the official `openai` client against a real replica (vLLM's continuous
batching on the tiny model), real Redis, a real reward server, the environment service and two third-party
environment servers that misbehave: sessions for the tasks the mesh hands out, multi-turn (streamed and not),
captured token-exactly, published as one group whose samples the learner masks right; a rewritten history starts a
new segment; bad input gets OpenAI-shaped 4xx; a client gone mid-stream leaves nothing in the engine; every session
ends in a named state whatever fails; rewards only from the task's scorer; each credential opens what it should.
The whole mesh is given one token (DAPO_AUTH_TOKEN) and a session-opening token: every role falls back to it."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from learner.batching import to_tensors
from learner.tiny import tiny_tokenizer
from rollout.episodes import Renderer
from services.child_process import running
from services.episodes import ChatMessage
from services.redis_server import EmbeddedRedis, free_port
from services.schemas import PromptTask, ScoredGroup, TrainBatch
from services.streams import DEAD_LETTER_STREAM, STREAM_PROMPTS, STREAM_ROLLOUTS, StreamProducer, connect, decode
from tests.integration import third_party_env

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
TOKEN = "mesh-token-for-tests"
OPENER = "opener-token-for-tests"
ROUTE_TOKEN = "third-party-token"
MESH = {"Authorization": f"Bearer {TOKEN}"}
IDLE_S = 6


@dataclass
class Mesh:
    base: str  # the gateway's
    ops: str  # the replica's health and metrics
    env: str  # the environment service
    client: redis.Redis
    proc: subprocess.Popen[bytes]
    proxy: str  # a third-party server whose resets come back as a proxy's HTML page (env "guessbad")
    failing: str  # one whose steps all come back with `error` (env "guesserr", behind ROUTE_TOKEN)
    router: str  # the one endpoint in front of the replicas' gateways


@pytest.fixture(scope="module")
def mesh(model_dir: Path, reward_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    token = {"DAPO_AUTH_TOKEN": TOKEN}  # the environment service takes the mesh's token: the replica falls back to it
    with (
        EmbeddedRedis(tmp_path_factory.mktemp("gw-redis")) as server,
        running("env_server", env=token, ready_path="/readyz", token=TOKEN) as (env_url, _),
        third_party_env.serve(bug="proxy", name="guessbad") as proxy,
        third_party_env.serve(bug="step_error", name="guesserr", token=ROUTE_TOKEN) as failing,
    ):
        gport = free_port()
        routes = json.dumps({"guessbad": proxy, "guesserr": failing})
        args = ["--engine", "vllm", "--model-dir", str(model_dir), "--redis-url", server.url, "--reward-url",
                reward_url, "--replica-id", "gw", "--gateway-port", str(gport),
                "--gateway-only", "--gateway-idle-s", str(IDLE_S), "--gateway-max-n", "4",
                "--gateway-max-tokens", "1024", "--max-response-tokens", "24", "--episode-retries", "1",
                "--env-url", env_url, "--env-routes", routes]  # fmt: skip
        env = token | {"OMP_NUM_THREADS": "1", "DAPO_SESSION_TOKEN": OPENER,
                       "DAPO_ENV_ROUTE_TOKENS": json.dumps({"guesserr": ROUTE_TOKEN})}  # fmt: skip
        replica = running("rollout", *args, env=env, ready_path="/readyz", token=TOKEN, timeout_s=300)
        with replica as (ops, proc):
            router = running("router", env=token | {"DAPO_REDIS_URL": server.url}, ready_path="/readyz", token=TOKEN)
            with router as (router_url, _):
                base = f"http://127.0.0.1:{gport}"
                yield Mesh(base, ops, env_url, connect(server.url), proc, proxy, failing, router_url)


def task(i: int, g: int = 2, prompt: str = "Add 2 and 3.", verifier: str = "dapo_math", truth: str = "5") -> PromptTask:
    return PromptTask(task_id=f"gw{i}", prompt_id=f"p{i}", prompt=prompt, ground_truth=truth, verifier=verifier,
                      data_source="test", n_samples=g)  # fmt: skip


def open_session(m: Mesh) -> dict:
    r = httpx.post(f"{m.base}/v1/sessions", headers=MESH, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()


def groups(m: Mesh) -> list[ScoredGroup]:
    return [decode(f, ScoredGroup) for _, f in m.client.xrange(STREAM_ROLLOUTS)]


def wait_group(m: Mesh, task_id: str, timeout_s: float = 60, *, prompt_id: str | None = None) -> ScoredGroup:
    """The group of task `task_id` (or the first of `prompt_id`: a client's own task is published under an id of
    its own per group)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for g in groups(m):
            if g.task.task_id == task_id or g.task.prompt_id == prompt_id:
                return g
        time.sleep(0.2)
    raise AssertionError(f"no group for {task_id or prompt_id} after {timeout_s} s")


def dead_letters(m: Mesh, kind: str) -> list[tuple[PromptTask, str]]:
    out = []
    for _, f in m.client.xrange(DEAD_LETTER_STREAM):
        if f[b"kind"] == kind.encode():
            orig = {k[5:]: v for k, v in f.items() if k.startswith(b"orig:")}
            out.append((decode(orig, PromptTask), f[b"reason"].decode()))
    return out


def until(ok: Callable[[], object], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(0.2)


def render_ids(messages: list[dict]) -> list[int]:
    tok = tiny_tokenizer()
    return list(tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False).input_ids)  # fmt: skip


def metric(m: Mesh, name: str) -> float:
    text = httpx.get(f"{m.ops}/metrics", headers=MESH, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
               line.startswith(name + "{"))  # fmt: skip


def test_multi_turn_sessions_become_one_token_exact_group(mesh: Mesh) -> None:
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(1, verifier="client"))  # its client gives the rewards
    tok, render = tiny_tokenizer(), Renderer(tiny_tokenizer())
    seen: list[list[tuple[list[int], list[int], list[float], str]]] = []  # per session: (prompt, ids, logprobs, finish)
    for reward in (1.0, 0.0):
        s = open_session(mesh)
        assert s["task"]["task_id"] == "gw1" and s["task"]["group_size"] == 2
        client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
        messages = [{"role": "system", "content": "Be brief."}, *s["task"]["messages"]]
        calls = []
        for turn in range(3):
            extra = {"return_token_ids": True}
            if turn == 1:  # streamed
                stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=12,
                                                        logprobs=True, stream=True, extra_body=extra)  # fmt: skip
                text, lps, ids, prompt, finish = "", [], [], [], ""
                for chunk in stream:
                    for ch in chunk.choices:
                        text += ch.delta.content or ""
                        if ch.finish_reason:
                            finish = ch.finish_reason
                            lps = [t.logprob for t in ch.logprobs.content]
                            ids, prompt = ch.model_extra["token_ids"], ch.model_extra["prompt_token_ids"]
            else:
                r = client.chat.completions.create(model="policy", messages=messages, max_tokens=12, logprobs=True,
                                                   extra_body=extra)  # fmt: skip
                ch = r.choices[0]
                text, finish, lps = ch.message.content, ch.finish_reason, [t.logprob for t in ch.logprobs.content]
                ids, prompt = ch.model_extra["token_ids"], r.model_extra["prompt_token_ids"]
                assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
            assert len(lps) == len(ids) > 0 and all(lp <= 0 for lp in lps)
            if calls:  # the previous prompt and answer, as sampled, then the new messages rendered after them
                before, last_ids, _, last_finish = calls[-1]
                assert prompt[: len(before) + len(last_ids)] == before + last_ids
                new = [ChatMessage(role="user", content=messages[-1]["content"])]
                assert prompt == before + last_ids + render.continuation(last_ids, last_finish, new)
                # and as text, the conversation in the chat template (the answers as the model wrote them)
                as_written = [*messages[:-2], {"role": "assistant", "content": tok.decode(last_ids)}, messages[-1]]
                assert tok.decode(prompt) == tok.decode(render_ids(as_written)) or turn == 2
            else:
                assert prompt == render_ids(messages)
            calls.append((prompt, ids, lps, "length" if finish == "length" else "stop"))
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]
        seen.append(calls)
        r = httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"reward": reward},
                       headers={"Authorization": f"Bearer {s['api_key']}"}, timeout=10)  # fmt: skip
        assert r.status_code == 200, r.text
        # the key is over with its session, and says so
        with pytest.raises(openai.APIStatusError, match="is over: ended") as e:
            client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        assert e.value.status_code == 410

    g = wait_group(mesh, "gw1")
    assert [sc.reward for sc in g.scores] == [1.0, 0.0]
    opening = g.task.prompt_token_ids.tolist()
    for sample, calls in zip(g.samples, seen, strict=True):
        assert opening == calls[0][0]
        last_prompt, last_ids = calls[-1][0], calls[-1][1]
        assert sample.response_token_ids.tolist() == last_prompt[len(opening) :] + last_ids
        mask, lps = sample.loss_mask(), sample.logprobs.tolist()
        want_mask = [0] * len(sample.response_token_ids)
        for prompt, ids, call_lps, _ in calls:  # each answer in the loss, with the log-probs the client was given
            at = len(prompt) - len(opening)
            want_mask[at : at + len(ids)] = [1] * len(ids)
            assert lps[at : at + len(ids)] == pytest.approx(call_lps, abs=1e-6)
        assert mask == want_mask
        assert sample.episode is not None and sample.episode.env == "gateway" and sample.episode.model_turns == 3
        assert [list(r) for r in sample.version_runs or []] == [[0, len(sample.response_token_ids)]]
    t = to_tensors(TrainBatch.assemble(0, [g]), pad_id=0)
    for i, sample in enumerate(g.samples):
        n = len(sample.response_token_ids)
        assert t.response_mask[i, len(opening) : len(opening) + n].tolist() == sample.loss_mask()
        assert t.input_ids[i, : len(opening) + n].tolist() == opening + sample.response_token_ids.tolist()


def test_a_rewritten_history_is_a_new_segment_and_tools_are_taught(mesh: Mesh) -> None:
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(2, g=1))
    s = open_session(mesh)
    client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": params}}]
    messages = [*s["task"]["messages"]]
    r = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, tools=tools,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    prompt = r.model_extra["prompt_token_ids"]
    assert "You can call tools" in tiny_tokenizer().decode(prompt) and "- add(a: integer): Adds." in \
        tiny_tokenizer().decode(prompt)  # fmt: skip
    # the client summarises: not the answer it was given -> a new segment, rendered in full, and said so
    summary = [{"role": "user", "content": "Summary: adding."},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "5"}]  # fmt: skip
    r2 = client.chat.completions.create(model="policy", messages=summary, max_tokens=8,
                                        extra_body={"return_token_ids": True})  # fmt: skip
    text = tiny_tokenizer().decode(r2.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>' in text  # as the model writes calls
    state = httpx.get(f"{mesh.base}/v1/sessions/{s['session_id']}", headers=MESH, timeout=10).json()
    assert [seg["reason"].split(":")[0] for seg in state["segments"]] == ["start", "history rewritten"]
    assert state["calls"] == 2
    httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"score": True}, headers=MESH, timeout=30)
    g = wait_group(mesh, "gw2")  # the last segment is what is trained on, scored by the reward server
    assert g.task.prompt_token_ids.tolist() == r2.model_extra["prompt_token_ids"]
    assert g.samples[0].response_token_ids.tolist() == r2.choices[0].model_extra["token_ids"]
    assert g.scores[0].reward in (-1.0, 1.0)


def test_an_environments_task_opens_and_is_scored_by_its_environment(mesh: Mesh) -> None:
    env_task = PromptTask(
        task_id="gwe",
        prompt_id="calc-3",
        prompt="calculator seed 3",
        n_samples=2,
        ground_truth=json.dumps({"seed": 3}),
        verifier="env:calculator",
        data_source="env/calculator",
    )
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(env_task)
    opened = httpx.post(f"{mesh.base}/v1/sessions", headers=MESH, timeout=30).json()
    check = {"env": "calculator", "seed": 3, "episode_id": "check"}  # the same seed: the same task, as it opens
    opening = httpx.post(f"{mesh.env}/v1/episodes", json=check, headers=MESH, timeout=10).json()
    httpx.delete(f"{mesh.env}/v1/episodes/check", headers=MESH, timeout=10)
    assert opened["task"]["messages"] == [{k: v for k, v in m.items() if v is not None} for m in opening["messages"]]
    assert [t["function"]["name"] for t in opened["task"]["tools"]] == ["calculator"]
    sessions = (opened, open_session(mesh))
    held = env_open(mesh)  # the two sessions' episodes among them
    for k, s in enumerate(sessions):
        client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
        r = client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=8)
        end = httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"score": True}, headers=MESH,
                         timeout=30)  # fmt: skip
        assert end.status_code == 200, end.text
        # the environment's own verdict on the same answer, in a fresh episode of the same task
        httpx.post(
            f"{mesh.env}/v1/episodes",
            json={"env": "calculator", "seed": 3, "episode_id": f"v{k}"},
            headers=MESH,
            timeout=10,
        )
        step = {"turn": 1, "message": {"role": "assistant", "content": r.choices[0].message.content}}
        verdict = httpx.post(f"{mesh.env}/v1/episodes/v{k}/step", json=step, headers=MESH, timeout=10).json()
        httpx.delete(f"{mesh.env}/v1/episodes/v{k}", headers=MESH, timeout=10)
        want = verdict["reward"] if verdict["done"] else -1.0
        assert end.json()["reward"] == want
        # the session's own episode is closed on the environment once scored (not left to its idle TTL)
        until(lambda k=k: env_open(mesh) == held - k - 1, "the scored session's episode to be closed")
    g = wait_group(mesh, "gwe")
    assert g.task.prompt_token_ids.tolist() == render_ids(opened["task"]["messages"])
    assert len(g.samples) == 2 and all(x.episode is not None and x.episode.env == "gateway" for x in g.samples)


def test_a_clients_own_task_makes_its_own_group(mesh: Mesh) -> None:
    own = {"task_id": "mine-1", "prompt": "Add 1 and 1.", "ground_truth": "2", "group_size": 2}
    keys = []
    for reward in (0.5, -0.5):
        r = httpx.post(f"{mesh.base}/v1/sessions", json={"task": own}, headers=MESH, timeout=30)
        assert r.status_code == 201, r.text
        s = r.json()
        assert s["task"]["task_id"] == "mine-1" and s["task"]["messages"] == [
            {"role": "user", "content": own["prompt"]}
        ]
        client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
        client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=6)
        end = httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"reward": reward}, headers=MESH,
                         timeout=30)  # fmt: skip
        assert end.status_code == 200, end.text
        keys.append(s["api_key"])
    g = wait_group(mesh, "", prompt_id="mine-1")
    assert g.task.data_source == "gateway" and [sc.reward for sc in g.scores] == [0.5, -0.5]
    assert g.task.prompt_token_ids.tolist() == render_ids([{"role": "user", "content": own["prompt"]}])
    # the same task id again, once its group is published: a new group of its own, never a duplicate of the first
    # (the buffer drops a group id it has batched: the client would be told "ended" for nothing)
    for reward in (1.0, -1.0):
        s = httpx.post(f"{mesh.base}/v1/sessions", json={"task": own}, headers=MESH, timeout=30).json()
        client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
        client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=6)
        httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"reward": reward}, headers=MESH,
                   timeout=30).raise_for_status()  # fmt: skip
    until(lambda: len([x for x in groups(mesh) if x.task.prompt_id == "mine-1"]) == 2, "the second group")
    ids = [x.task.task_id for x in groups(mesh) if x.task.prompt_id == "mine-1"]
    assert len(set(ids)) == 2 and all(i.startswith("mine-1.") for i in ids)


def test_bad_input_gets_openai_shaped_4xx(mesh: Mesh) -> None:
    bad = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key="dms_nosuch_session", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{mesh.base}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=TOKEN, max_retries=0)  # the mesh token: not captured
    assert [m.id for m in ok.models.list()] == ["policy"]
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        ok.chat.completions.create(model="gpt-4", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="n: at most 4"):
        ok.chat.completions.create(model="policy", messages=msgs, n=5)
    with pytest.raises(openai.BadRequestError, match="max_tokens: at most 1024"):
        ok.chat.completions.create(model="policy", messages=msgs, max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        ok.chat.completions.create(model="policy", messages=msgs, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="top_p"):  # the learner recomputes the whole distribution
        ok.chat.completions.create(model="policy", messages=msgs, top_p=0.9)
    r = httpx.post(f"{mesh.base}/v1/chat/completions", headers=MESH, json={"model": "policy"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(f"{mesh.base}/v1/chat/completions", headers=MESH, content=b"{not json", timeout=10)
    assert r.status_code == 400 and "error" in r.json()
    # completions, streamed, with usage; token-id prompts checked against the vocabulary
    usage = {"include_usage": True}
    stream = ok.completions.create(model="policy", prompt="Hi", max_tokens=5, stream=True, stream_options=usage,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with pytest.raises(openai.BadRequestError, match="token ids"):
        ok.completions.create(model="policy", prompt=[1, 2, 99999], max_tokens=2)
    # text a tokenizer cannot take, tools it cannot read, an own task it cannot score: 400s, not 500s
    surrogate = b'{"model": "policy", "messages": [{"role": "user", "content": "\\ud800"}]}'  # JSON's escape
    r = httpx.post(f"{mesh.base}/v1/chat/completions", headers={**MESH, "content-type": "application/json"},
                   content=surrogate, timeout=10)  # fmt: skip
    assert r.status_code == 400, r.text
    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 1}}}}]
    with pytest.raises(openai.BadRequestError):
        ok.chat.completions.create(model="policy", messages=msgs, tools=bad_tools, max_tokens=2)  # type: ignore[arg-type]
    own = {"task_id": "x", "prompt": "p", "verifier": "env:calculator", "group_size": 2}
    assert httpx.post(f"{mesh.base}/v1/sessions", json={"task": own}, headers=MESH, timeout=10).status_code == 400
    # the SDK's own message objects, dumped, are sent back as they are
    first = ok.chat.completions.create(model="policy", messages=msgs, max_tokens=3)
    again = [*msgs, first.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    assert ok.chat.completions.create(model="policy", messages=again, max_tokens=3).choices
    # n choices, uncaptured, work with the mesh token
    out = ok.chat.completions.create(model="policy", messages=msgs, n=3, max_tokens=4)
    assert [c.index for c in out.choices] == [0, 1, 2]
    # no task handed out: 429 with Retry-After (the SDK would retry it)
    r = httpx.post(f"{mesh.base}/v1/sessions", headers=MESH, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    # a session key cannot open sessions; an idle session expires and its key with it
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(3, g=2, verifier="client"))
    s1, s2 = open_session(mesh), open_session(mesh)
    r = httpx.post(f"{mesh.base}/v1/sessions", headers={"Authorization": f"Bearer {s1['api_key']}"}, timeout=10)
    assert r.status_code == 401
    c1 = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s1["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="empty"):  # refused, and the session is free again
        c1.completions.create(model="policy", prompt="", max_tokens=4)
    c1.chat.completions.create(model="policy", messages=s1["task"]["messages"], max_tokens=4)
    httpx.post(f"{mesh.base}/v1/sessions/{s1['session_id']}/end", json={"reward": 1}, headers=MESH, timeout=10)
    time.sleep(IDLE_S + 2.5)  # s2 never called: abandoned; one ended is too few to train on -> dead-lettered
    with pytest.raises(openai.APIStatusError, match="over: abandoned .idle for") as e:
        openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s2["api_key"], max_retries=0).models.list()
    assert e.value.status_code == 410
    deadline = time.monotonic() + 20
    while not (dead := [f for _, f in mesh.client.xrange(DEAD_LETTER_STREAM) if f[b"kind"] == b"sessions_abandoned"]):
        assert time.monotonic() < deadline, "the abandoned group was not dead-lettered"
        time.sleep(0.2)
    task3 = decode({k[5:]: v for k, v in dead[0].items() if k.startswith(b"orig:")}, PromptTask)
    assert task3.task_id == "gw3"


def test_client_gone_mid_stream_leaves_nothing_in_the_engine(mesh: Mesh) -> None:
    cancelled = metric(mesh, "dapo_gateway_cancelled_total")
    body = {"model": "policy", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 1000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{mesh.base}/v1/chat/completions", json=body,
                                                       headers=MESH) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens in, then gone
        assert any('"content"' in line for line in got)
    deadline = time.monotonic() + 20
    while metric(mesh, "dapo_gateway_cancelled_total") < cancelled + 1 or metric(
        mesh, "dapo_rollout_sequences_in_flight"
    ):
        assert time.monotonic() < deadline, "the stream's sequence is still in the engine"
        time.sleep(0.2)
    assert json.loads(got[0].removeprefix("data: "))["object"] == "chat.completion.chunk"


def env_open(m: Mesh) -> float:
    """Episodes the environment service holds now."""
    text = httpx.get(f"{m.env}/metrics", headers=MESH, timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith("dapo_env_episodes_open ")).split()[-1])


def env_closed(m: Mesh) -> float:
    text = httpx.get(f"{m.env}/metrics", headers=MESH, timeout=10).text
    series = 'dapo_env_episodes_total{env="calculator",outcome="closed"}'
    found = [line for line in text.splitlines() if line.startswith(series)]
    return float(found[0].split()[-1]) if found else 0.0


def env_task_of(i: int, env: str, seed: int, g: int = 2) -> PromptTask:
    return task(i, g=g, prompt=f"{env} seed {seed}", verifier=f"env:{env}", truth=json.dumps({"seed": seed}))


def test_an_environment_that_answers_out_of_protocol_never_wedges_a_session(mesh: Mesh) -> None:
    """A reset answered with a proxy's HTML page (200, not JSON): each opening fails at once with a 503 that says
    why, its seat free again (no session left busy, no seat held); past --episode-retries the task is dead-lettered
    with the reason, and the replica goes on."""
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(env_task_of(10, "guessbad", 1))
    open_before = metric(mesh, "dapo_gateway_sessions_open")
    for _ in range(2):  # --episode-retries 1: the second failure gives the task up
        r = httpx.post(f"{mesh.base}/v1/sessions", headers=MESH, timeout=30)
        assert r.status_code == 503 and "not JSON" in r.json()["error"]["message"], r.text
        assert r.headers["retry-after"]
        assert metric(mesh, "dapo_gateway_sessions_open") == open_before
    until(lambda: any(t.task_id == "gw10" for t, _ in dead_letters(mesh, "env_failed")), "the task to be given up")
    why = next(w for t, w in dead_letters(mesh, "env_failed") if t.task_id == "gw10")
    assert "2 sessions failed by the environment" in why and "not JSON" in why
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(11, g=1, verifier="client"))
    s = open_session(mesh)  # the next task opens: nothing is wedged
    assert s["task"]["task_id"] == "gw11"
    client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
    client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=4)
    end = httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"reward": 1}, headers=MESH, timeout=10)
    assert end.status_code == 200, end.text


def test_an_environment_failing_the_last_step_fails_the_session_and_closes_its_episode(mesh: Mesh) -> None:
    """A step answered with `error` at the session's end: the session is failed (a 502 that says why: the model is
    not to blame, nothing is trained), its key says so, its environment episode is closed at once, and its seat is
    free for another session of the task — until --episode-retries failures give the task up."""
    route = {"Authorization": f"Bearer {ROUTE_TOKEN}"}  # the third-party server behind its own token
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(env_task_of(12, "guesserr", 2, g=1))
    for _ in range(2):  # --episode-retries 1
        s = open_session(mesh)
        assert s["task"]["task_id"] == "gw12"
        assert s["task"]["messages"] == [{"role": "user", "content": "Guess my number from 1 to 5."}]
        assert len(httpx.get(f"{mesh.failing}/debug/episodes", headers=route, timeout=10).json()) == 1
        client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
        client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=4)
        end = f"{mesh.base}/v1/sessions/{s['session_id']}/end"
        r = httpx.post(end, json={"score": True}, headers=MESH, timeout=30)
        assert r.status_code == 502 and "the game's process died" in r.json()["error"]["message"], r.text
        state = httpx.get(f"{mesh.base}/v1/sessions/{s['session_id']}", headers=MESH, timeout=10).json()
        assert state["state"] == "failed" and "scoring its last answer" in state["why"]
        until(lambda: httpx.get(f"{mesh.failing}/debug/episodes", headers=route, timeout=10).json() == [],
              "its episode to be closed")  # fmt: skip
        with pytest.raises(openai.APIStatusError, match="over: failed") as e:
            client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=4)
        assert e.value.status_code == 410
    until(lambda: any(t.task_id == "gw12" for t, _ in dead_letters(mesh, "env_failed")), "the task to be given up")


def test_an_idle_session_closes_its_environment_episode(mesh: Mesh) -> None:
    closed = env_closed(mesh)
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(env_task_of(13, "calculator", 5, g=1))
    s = open_session(mesh)
    assert s["task"]["task_id"] == "gw13"
    until(lambda: env_closed(mesh) == closed + 1, "the abandoned session's episode to be closed", IDLE_S + 15)
    state = httpx.get(f"{mesh.base}/v1/sessions/{s['session_id']}", headers=MESH, timeout=10).json()
    assert state["state"] == "abandoned" and state["why"].startswith("idle for"), state


def test_rewards_come_from_the_tasks_scorer(mesh: Mesh) -> None:
    """A dispatched task with a verifier: the client may not give its reward (403, whoever asks: the session's key
    or the mesh token); `score: true` lets the verifier score it. A client-scored task (its dataset says so): the
    reward is the client's, and there is nothing to score it with."""
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(30, g=1))
    s = open_session(mesh)
    key = {"Authorization": f"Bearer {s['api_key']}"}
    client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
    client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=4)
    end = f"{mesh.base}/v1/sessions/{s['session_id']}/end"
    for who in (key, MESH):
        r = httpx.post(end, json={"reward": 100}, headers=who, timeout=10)
        assert r.status_code == 403 and "scored by dapo_math, not by the client" in r.text, r.text
        assert r.json()["error"]["code"] == "reward_not_allowed"
    r = httpx.post(end, json={"score": True}, headers=key, timeout=30)
    assert r.status_code == 200 and r.json()["reward"] in (-1.0, 1.0), r.text
    assert wait_group(mesh, "gw30").scores[0].reward == r.json()["reward"]
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(31, g=1, verifier="client"))
    s = open_session(mesh)
    assert s["task"]["client_scored"] is True
    client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
    client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=4)
    end = f"{mesh.base}/v1/sessions/{s['session_id']}/end"
    r = httpx.post(end, json={"score": True}, headers=MESH, timeout=10)
    assert r.status_code == 400 and "client-scored" in r.text
    assert httpx.post(end, json={"reward": 0.25}, headers=MESH, timeout=10).status_code == 200
    assert wait_group(mesh, "gw31").scores[0].reward == 0.25


def test_each_credential_opens_only_what_it_should(mesh: Mesh) -> None:
    """The session-opening token opens sessions and lists the model, nothing else; a session's key reaches its own
    session only; neither reads the replica's operations endpoints."""
    opener = {"Authorization": f"Bearer {OPENER}"}
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(40, g=2, verifier="client"))
    mine, other = (httpx.post(f"{mesh.base}/v1/sessions", headers=opener, timeout=30).json() for _ in range(2))
    assert mine["task"]["task_id"] == other["task"]["task_id"] == "gw40"
    assert httpx.get(f"{mesh.base}/v1/models", headers=opener, timeout=10).status_code == 200
    body = {"model": "policy", "messages": mine["task"]["messages"], "max_tokens": 2}
    r = httpx.post(f"{mesh.base}/v1/chat/completions", json=body, headers=opener, timeout=10)
    assert r.status_code == 401 and "cannot call the model" in r.text
    for path in (f"/v1/sessions/{mine['session_id']}", "/openapi.json"):
        assert httpx.get(f"{mesh.base}{path}", headers=opener, timeout=10).status_code == 401
    r = httpx.post(f"{mesh.base}/v1/sessions/{mine['session_id']}/end", json={"reward": 1}, headers=opener, timeout=10)
    assert r.status_code == 401
    key = {"Authorization": f"Bearer {mine['api_key']}"}
    assert httpx.get(f"{mesh.base}/v1/sessions/{other['session_id']}", headers=key, timeout=10).status_code == 404
    r = httpx.post(f"{mesh.base}/v1/sessions/{other['session_id']}/end", json={"reward": 1}, headers=key, timeout=10)
    assert r.status_code == 404
    for who in (opener, key):
        assert httpx.get(f"{mesh.ops}/metrics", headers=who, timeout=10).status_code == 401
    for s in (mine, other):
        c = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key=s["api_key"], max_retries=0)
        c.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=2)
        r = httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"reward": 1},
                       headers={"Authorization": f"Bearer {s['api_key']}"}, timeout=10)  # fmt: skip
        assert r.status_code == 200, r.text


def test_a_client_gone_mid_call_frees_its_session(mesh: Mesh) -> None:
    """A client that stops waiting for an answer (not streamed): its sequences leave the engine, its session takes
    the next call — not a 409 for ever."""
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(50, g=1, verifier="client"))
    s = open_session(mesh)
    key = {"Authorization": f"Bearer {s['api_key']}"}
    body = {"model": "policy", "messages": s["task"]["messages"], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{mesh.base}/v1/chat/completions", json=body, headers=key, timeout=0.2)
    short = body | {"max_tokens": 2, "ignore_eos": False}
    chat = f"{mesh.base}/v1/chat/completions"
    until(lambda: httpx.post(chat, json=short, headers=key, timeout=30).status_code == 200, "its next call to be taken")
    r = httpx.post(f"{mesh.base}/v1/sessions/{s['session_id']}/end", json={"reward": 1}, headers=key, timeout=10)
    assert r.status_code == 200, r.text


def test_the_router_is_one_endpoint_for_the_replicas(mesh: Mesh) -> None:
    """Through the router: a session placed on a replica with room (one that does not answer is passed over), its
    calls (streamed too) and its end sent to its replica, the model list to any; a session whose replica is gone a
    410 that says so; a 429 passed on with its Retry-After."""
    from services.schemas import ReplicaHeartbeat
    from services.session_keys import new_session_id, replica_tag, session_key
    from services.streams import REPLICA_KEY_PREFIX, pack

    # a replica that joined and died: the fullest-looking placement, its heartbeat still there, nothing listening
    ghost = ReplicaHeartbeat(replica_id="ghost", host="127.0.0.1", port=1, weight_version=0, state="ready",
                             incarnation="i", gateway_url=f"http://127.0.0.1:{free_port()}", gateway_free=100,
                             gateway_seats=50)  # fmt: skip
    mesh.client.set(REPLICA_KEY_PREFIX + "ghost", pack(ghost), px=60_000)
    time.sleep(1.5)  # the router reads the heartbeats every second
    via = f"{mesh.router}/v1"
    opener = openai.OpenAI(base_url=via, api_key=OPENER, max_retries=0)
    assert [m.id for m in opener.models.list()] == ["policy"]
    odd = "/v1/models/%3F~%C2%8B%17"  # schemathesis's: decoded, a '?' and a control character no URL may hold
    auth = {"Authorization": f"Bearer {OPENER}"}
    direct, routed = (httpx.get(f"{b}{odd}", headers=auth, timeout=10) for b in (mesh.base, mesh.router))
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())  # sent on as it came, not a 500
    with pytest.raises(openai.RateLimitError, match="no task is handed out"):  # a 429 passes through as it is
        opener.post("/sessions", body={}, cast_to=object)
    StreamProducer(mesh.client, STREAM_PROMPTS).publish(task(60, g=1, verifier="client"))
    s: dict = opener.post("/sessions", body={}, cast_to=object)  # type: ignore[assignment]  # the ghost passed over
    hb = decode_heartbeat(mesh, "gw")
    assert s["session_id"].startswith(replica_tag("gw", hb.incarnation))
    client = openai.OpenAI(base_url=via, api_key=s["api_key"], max_retries=0)
    stream = client.chat.completions.create(model="policy", messages=s["task"]["messages"], max_tokens=8,
                                            stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text
    end = client.post(f"/sessions/{s['session_id']}/end", body={"reward": 1.0}, cast_to=object)
    assert end["state"] == "ended"  # type: ignore[index]
    assert wait_group(mesh, "gw60").samples[0].episode is not None
    for sid in (new_session_id(replica_tag("ghost", "i")), new_session_id(replica_tag("nobody", "x"))):
        gone = openai.OpenAI(base_url=via, api_key=session_key(sid, "s3cret"), max_retries=0)
        with pytest.raises(openai.APIStatusError, match="is lost with its replica") as e:
            gone.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert e.value.status_code == 410 and e.value.code == "session_replica_gone"
    mesh.client.delete(REPLICA_KEY_PREFIX + "ghost")


def decode_heartbeat(m: Mesh, replica_id: str):  # type: ignore[no-untyped-def]
    from services.schemas import ReplicaHeartbeat
    from services.streams import REPLICA_KEY_PREFIX, unpack

    return unpack(m.client.get(REPLICA_KEY_PREFIX + replica_id), ReplicaHeartbeat)


def test_zz_a_replica_that_leaves_ends_its_sessions_and_closes_their_episodes(mesh: Mesh) -> None:
    """Last in this module (it stops the module's replica): SIGTERM with sessions open — a calling client's call is
    answered (a 503 that says the replica is leaving, or its answer if it was done), and every environment episode
    of its sessions is closed on the environment service before it exits, not left to the service's idle TTL."""
    import signal

    StreamProducer(mesh.client, STREAM_PROMPTS).publish(env_task_of(70, "calculator", 11, g=2))
    sessions = [open_session(mesh), open_session(mesh)]
    assert {s["task"]["task_id"] for s in sessions} == {"gw70"}
    held = env_open(mesh)
    assert held >= 2
    mesh.proc.send_signal(signal.SIGTERM)
    mesh.proc.wait(120)
    assert env_open(mesh) == held - 2  # both sessions' episodes closed as it left
    assert httpx.get(f"{mesh.env}/healthz", timeout=5).status_code == 200
