"""Groups sampled in rounds through the whole mesh, as a user runs it: `dapo-mesh up --tiny --engine vllm` with the
balanced rule on an environment server of the user's (tests/integration/third_party_env.py's `coin`: right with
chance 0.35 whatever the answer, so a random model's groups meet both outcomes). Groups of different sizes are
drawn, given up, down-sampled and trained; the learner's advantages use the pool of every sample drawn; the live
numbers say how many samples were generated per trained one; the audit finds nothing lost or trained twice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mesh.layout import RunLayout
from services.ledger import read_ledger
from tests.e2e.meshrun import audit, left_behind, start_mesh
from tests.integration import third_party_env

MOST = 10


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_groups_sampled_in_rounds_train_through_the_mesh_and_the_audit_balances(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    with third_party_env.serve(bug="coin", name="coin", token="theirs") as url:
        flags = ["--engine", "vllm", "--steps", "3", "--set", 'mesh.dataset="env:coin"',
                 "--set", f'mesh.env_servers=[{{url="{url}", token_env="COIN_TOKEN"}}]',
                 "--set", 'buffer.sampling_rule="balanced"', "--set", "buffer.dynamic_sampling=true",
                 "--set", "buffer.sampling_first=2", "--set", "buffer.sampling_round=2",
                 "--set", f"buffer.sampling_most={MOST}", "--set", "buffer.sampling_give_up=1.0",
                 "--set", "rollout.vllm_kv_cache_gib=1"]  # fmt: skip
        mesh = start_mesh(tmp_path, *flags, env={"COIN_TOKEN": "theirs"})
        try:
            code = mesh.wait(1200)
        finally:
            if mesh.poll() is None:
                mesh.kill()
    out = (tmp_path / "up.out").read_text()
    assert code == 0, out[-4000:]
    assert [e.version for e in read_ledger(RunLayout(run_dir).learner)] == [1, 2, 3]
    learner_dir, buffer_dir = RunLayout(run_dir).episodes
    trained = [r for r in records(learner_dir) if r["outcome"] == "trained"]
    assert len(trained) == 3 * 4  # 3 batches of 4 groups
    for r in trained:  # balanced groups of 4, every advantage against the pool of all the group drew
        s, samples = r["sampling"], r["samples"]
        assert s is not None and s["drawn"] >= len(samples) == 4 and s["drawn"] <= MOST and not s["gave_up"]
        if s["drawn"] < MOST:
            assert sum(x["acc"] for x in samples) == 2
        for x in samples:
            assert x["advantage"] == pytest.approx((x["reward"] - s["pool_mean"]) / (s["pool_std"] + 1e-6), abs=2e-4)
    assert any(r["sampling"]["drawn"] > 4 for r in trained)  # down-sampled from a larger pool
    dropped = [r for r in records(buffer_dir) if r["outcome"] == "dropped"]
    given_up = [r for r in dropped if r["sampling"] and r["sampling"]["gave_up"]]
    assert given_up
    for r in given_up:  # a first round that agreed: dropped as uniform, or as stale (the buffer judges that first)
        right = sum(x["acc"] for x in r["samples"])
        assert len(r["samples"]) == 2 and right in (0, 2), r
        assert r["reason"] in ("stale", "all_correct" if right == 2 else "all_wrong"), r
    assert any(r["reason"] != "stale" for r in given_up)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["kind"] == "train"][-1]
    assert last["samples_trained"] >= 3 * 4 * 4 and math.isfinite(last["generated_per_trained"])
    assert last["generated_per_trained"] >= 1.0 and last["group_rounds_mean"] >= 1.0
    assert "generated per trained" in out
    code, report = audit(run_dir)
    assert code == 0, report
    assert left_behind(run_dir) == []
