"""`dapo-mesh eval` with the shipped model: real vLLM, a real reward server over HTTP. The same seed gives the
same samples and numbers; re-scoring its samples by hand through the reward server gives the same avg@k and
pass@k; another seed gives other samples. A rollout replica's in-training evaluation of the same weights, items
and seed gives the same numbers as `dapo-mesh eval`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollout.evaluate import EvalSample, load_eval_items, summarize
from services.child_process import ROOT, child_env
from services.datasets import DEFAULT_DATASET_CONFIG, write_items
from services.redis_server import EmbeddedRedis, free_port
from services.schemas import EvalResult
from services.streams import STREAM_EVAL, connect, decode

pytestmark = [pytest.mark.slow, pytest.mark.vllm]  # `dapo-mesh eval` runs its default engine, vLLM
SIZE, K = 24, 4


def run_eval(out: Path, seed: int, reward_url: str, model: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DAPO_REWARD_URL",)} | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "mesh", "eval", "--model", str(model), "--size", str(SIZE), "--k", str(K),
           "--seed", str(seed), "--max-tokens", "48", "--reward-url", reward_url, "--out", str(out),
           "--json"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)  # --json: stdout is the report alone
    assert report == json.loads((out / "report.json").read_text())
    return report


def samples(out: Path) -> list[EvalSample]:
    return [EvalSample(**json.loads(line)) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.model_prep import prepare_smollm2

    return prepare_smollm2(tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory, reward_url: str, model: Path) -> tuple[Path, dict]:
    """`dapo-mesh eval` of the shipped model on chain_sum's held-out split, seed 1234: where it wrote, its report."""
    out = tmp_path_factory.mktemp("eval") / "a"
    return out, run_eval(out, 1234, reward_url, model)


def test_eval_is_deterministic_per_seed_and_agrees_with_the_reward_server(
    tmp_path: Path, reward_url: str, model: Path, first: tuple[Path, dict]
) -> None:
    out_a, report = first
    again = run_eval(tmp_path / "b", 1234, reward_url, model)
    run_eval(tmp_path / "c", 99, reward_url, model)
    a, b, c = samples(out_a), samples(tmp_path / "b"), samples(tmp_path / "c")

    assert len(a) == SIZE * K and report["n_prompts"] == SIZE and report["k"] == K
    assert [s.response for s in a] == [s.response for s in b]  # same seed: the same samples ...
    assert {k: report[k] for k in ("avg_at_k", "pass_at")} == {k: again[k] for k in ("avg_at_k", "pass_at")}
    assert [s.response for s in a] != [s.response for s in c]  # ... another seed: others
    assert 0 < report["avg_at_k"] < 1  # some right, some wrong: the agreement below can tell them apart

    # score the same samples by hand through the reward server, recompute the numbers
    items = load_eval_items("reasoning_gym:chain_sum", size=SIZE, config=DEFAULT_DATASET_CONFIG)
    truth = {it.prompt_id: it for it in items}
    payload = {"items": [{"id": f"{s.prompt_id}#{s.sample}", "response": s.response,
                          "ground_truth": truth[s.prompt_id].ground_truth, "verifier": truth[s.prompt_id].verifier}
                         for s in a]}  # fmt: skip
    r = httpx.post(f"{reward_url}/v1/score", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    accs = [res["acc"] for res in r.json()["results"]]
    assert accs == [s.acc for s in a]
    rescored = [EvalSample(s.prompt_id, s.sample, s.response, s.response_tokens, s.finish_reason, acc, 0.0, None)
                for s, acc in zip(a, accs, strict=True)]  # fmt: skip
    by_hand = summarize(items, rescored, K, version=0)
    assert by_hand.avg_at_k == pytest.approx(report["avg_at_k"]) == sum(accs) / len(accs)
    assert by_hand.pass_at_k == pytest.approx(report["pass_at_k"])
    assert {int(j): v for j, v in report["pass_at"].items()} == pytest.approx(by_hand.pass_at)


def test_a_replica_evaluates_as_dapo_mesh_eval_does(
    tmp_path: Path, reward_url: str, server: EmbeddedRedis, model: Path, first: tuple[Path, dict]
) -> None:
    """The held-out numbers a replica publishes during training are the numbers `dapo-mesh eval` gives for the
    same weights (here version 0, the model as shipped), items and seed: one evaluation, two ways to run it."""
    _, cli = first
    data = tmp_path / "eval.jsonl"  # the same held-out split, as the buffer writes it
    items = load_eval_items("reasoning_gym:chain_sum", size=SIZE)
    write_items(data, items)

    client = connect(server.url)
    args = [
        "--engine",
        "vllm",
        "--model-dir",
        str(model),
        "--redis-url",
        server.url,
        "--reward-url",
        reward_url,
        "--port",
        str(free_port()),
        "--replica-id",
        "r0",
        "--max-response-tokens",
        "48",
        "--eval-every",
        "5",
        "--eval-data",
        str(data),
        "--eval-size",
        str(SIZE),
        "--eval-k",
        str(K),
        "--eval-seed",
        "1234",
        "--eval-mode",
        "stop",
    ]  # fmt: skip  (chunked and seeded; shared: tests/integration/test_continuous_loop.py)
    proc = subprocess.Popen([sys.executable, "-m", "rollout", *args], env=child_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not (entries := client.xrange(STREAM_EVAL)):
            assert proc.poll() is None, f"the replica exited ({proc.returncode})"
            assert time.monotonic() < deadline, "no evaluation from the replica in 300 s"
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(60)
    [(_, fields)] = entries
    ev = decode(fields, EvalResult)
    assert (ev.version, ev.replica_id, ev.k, ev.n_prompts) == (0, "r0", K, SIZE)
    assert 0 < ev.avg_at_k < 1  # the comparison can tell samples apart
    assert ev.avg_at_k == pytest.approx(cli["avg_at_k"]) and ev.pass_at_k == pytest.approx(cli["pass_at_k"])
    # the same sampled tokens, not only the same verdicts
    assert ev.mean_response_tokens == pytest.approx(cli["mean_response_tokens"])
    assert ev.truncated_frac == pytest.approx(cli["truncated_frac"])
