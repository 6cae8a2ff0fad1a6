"""`dapo-mesh eval` with the shipped model: real vLLM, a real reward server over HTTP. The same seed gives the
same samples and numbers; re-scoring its samples by hand through the reward server gives the same avg@k and
pass@k; another seed gives other samples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollout.evaluate import EvalSample, load_eval_items, summarize
from services.buffer.settings import DEFAULT_DATASET_CONFIG
from services.common.launch import ROOT

pytestmark = pytest.mark.slow
SIZE, K = 24, 4


def run_eval(out: Path, seed: int, reward_url: str, model: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DAPO_REWARD_URL",)} | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "services.cli", "eval", "--model", str(model), "--size", str(SIZE), "--k", str(K),
           "--seed", str(seed), "--max-tokens", "48", "--reward-url", reward_url, "--out", str(out),
           "--json"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)  # --json: stdout is the report alone
    assert report == json.loads((out / "report.json").read_text())
    return report


def samples(out: Path) -> list[EvalSample]:
    return [EvalSample(**json.loads(line)) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_eval_is_deterministic_per_seed_and_agrees_with_the_reward_server(tmp_path: Path, reward_url: str) -> None:
    from services.common.models import prepare_smollm2

    model = prepare_smollm2(tmp_path / "smollm2-135m-instruct")
    first = run_eval(tmp_path / "a", 1234, reward_url, model)
    again = run_eval(tmp_path / "b", 1234, reward_url, model)
    run_eval(tmp_path / "c", 99, reward_url, model)
    a, b, c = samples(tmp_path / "a"), samples(tmp_path / "b"), samples(tmp_path / "c")

    assert len(a) == SIZE * K and first["n_prompts"] == SIZE and first["k"] == K
    assert [s.response for s in a] == [s.response for s in b]  # same seed: the same samples ...
    assert {k: first[k] for k in ("avg_at_k", "pass_at")} == {k: again[k] for k in ("avg_at_k", "pass_at")}
    assert [s.response for s in a] != [s.response for s in c]  # ... another seed: others
    assert 0 < first["avg_at_k"] < 1  # some right, some wrong: the agreement below can tell them apart

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
    assert by_hand.avg_at_k == pytest.approx(first["avg_at_k"]) == sum(accs) / len(accs)
    assert by_hand.pass_at_k == pytest.approx(first["pass_at_k"])
    assert {int(j): v for j, v in first["pass_at"].items()} == pytest.approx(by_hand.pass_at)
