"""Dynamic sampling, staleness and datasets of the buffer, as pure functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buffer.dynamic_sampling import dispatch_budget, filter_group, is_stale, version_lag
from services.datasets import DAPO_TEMPLATE, load_source, parse_tasks
from services.schemas import Score, ScoredGroup
from services.selfcheck import example_group


def with_scores(accs: list[bool], rewards: list[float] | None = None, version: int = 0) -> ScoredGroup:
    g = example_group(0, n_samples=len(accs), n_tokens=2, version=version)
    rewards = rewards or [1.0 if a else -1.0 for a in accs]
    return g.model_copy(update={"scores": [Score(reward=r, acc=a) for a, r in zip(accs, rewards, strict=True)]})


@pytest.mark.parametrize(
    ("accs", "verdict"),
    [([True] * 4, "all_correct"), ([False] * 4, "all_wrong"), ([True, False, False, False], "keep"),
     ([False, False, False, True], "keep"), ([True, True, True, False], "keep"), ([True], "all_correct")],
)  # fmt: skip
def test_filter_binary(accs: list[bool], verdict: str) -> None:
    assert filter_group(with_scores(accs)) == verdict


def test_filter_continuous() -> None:
    flat = with_scores([False] * 4, [0.3] * 4)
    spread = with_scores([False] * 4, [0.1, 0.2, 0.3, 0.4])
    assert filter_group(flat, continuous=True) == "no_variance"
    assert filter_group(spread, continuous=True) == "keep"
    assert filter_group(spread, continuous=True, std_threshold=0.2) == "no_variance"  # std is 0.112


def test_staleness() -> None:
    g = with_scores([True, False], version=3)
    assert version_lag(g, 5) == 2 and version_lag(g, 1) == 0  # a newer-than-learner sample is not "behind"
    assert is_stale(g, 5, max_staleness=1) and not is_stale(g, 4, max_staleness=1)
    assert not is_stale(g, 3, max_staleness=0) and is_stale(g, 4, max_staleness=0)


def test_staleness_counts_from_the_oldest_token() -> None:
    """A sample that spans in-flight weight updates is as stale as its first token."""
    g = with_scores([True, False], version=3)
    spanning = g.samples[0].model_copy(update={"version_runs": [(3, 1), (5, 1)]})
    g = g.model_copy(update={"samples": [spanning, g.samples[1].model_copy(update={"policy_version": 5})]})
    assert (g.min_version, g.max_version) == (3, 5)
    assert version_lag(g, 5) == 2 and is_stale(g, 5, max_staleness=1) and not is_stale(g, 5, max_staleness=2)


def test_dispatch_budget() -> None:
    assert dispatch_budget(1, 8, outstanding=0, waiting=0) == 16
    assert dispatch_budget(1, 8, outstanding=10, waiting=3) == 3
    assert dispatch_budget(0, 8, outstanding=10, waiting=3) == 0  # never negative
    # groups sampled in rounds of 2 toward G = 8: four first rounds make one group's samples
    assert dispatch_budget(1, 4, outstanding=10, waiting=0, per_group=4) == 22
    # a waiting group (in the carry, or in a batch not yet trained) is a whole group: four first rounds' worth
    assert dispatch_budget(1, 4, outstanding=10, waiting=4, per_group=4) == 6
    assert dispatch_budget(1, 4, outstanding=0, waiting=8, per_group=4) == 0  # two batches behind: nothing more


def test_parse_tasks() -> None:
    assert parse_tasks("chain_sum") == {"chain_sum": 1.0}
    assert parse_tasks("chain_sum=0.7, basic_arithmetic=0.3") == {"chain_sum": 0.7, "basic_arithmetic": 0.3}
    with pytest.raises(ValueError):
        parse_tasks("chain_sum=0")


def test_reasoning_gym_split_is_disjoint_and_deterministic() -> None:
    cfg = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    a = load_source("reasoning_gym:chain_sum", size=60, seed=5, eval_size=10, config=cfg)
    b = load_source("reasoning_gym:chain_sum", size=60, seed=5, eval_size=10, config=cfg)
    assert len(a.train) == 60 and len(a.eval) == 10
    assert [a.train[i] for i in range(60)] == [b.train[i] for i in range(60)] and a.eval == b.eval
    train_q = {a.train[i].prompt for i in range(60)}
    assert not train_q & {e.prompt for e in a.eval}  # nothing held out is also a training question
    item = a.train[0]
    assert item.verifier == "reasoning_gym:chain_sum" and "Answer: <number>" in item.prompt
    entry = json.loads(item.ground_truth)
    assert set(entry) == {"answer", "metadata"} and entry["answer"].lstrip("-").isdigit()


def test_mix_of_tasks() -> None:
    src = load_source("reasoning_gym:chain_sum=1,basic_arithmetic=1", size=200, seed=1, eval_size=0)
    verifiers = {src.train[i].verifier for i in range(200)}
    assert verifiers == {"reasoning_gym:chain_sum", "reasoning_gym:basic_arithmetic"}


def verl_rows(n: int) -> list[dict]:
    return [
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
         "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": f"q{i}"}}
        for i in range(n)
    ]  # fmt: skip


def test_verl_parquet_and_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = verl_rows(20)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for name in ("d.parquet", "d.jsonl"):
        src = load_source(f"file:{tmp_path / name}@dapo_math", eval_size=4, seed=0, template="dapo")
        assert len(src.train) == 16 and len(src.eval) == 4
        every = list(src.train) + src.eval
        assert sorted(it.prompt_id for it in every) == sorted(f"file/{name}/q{i}" for i in range(20))
        it = next(x for x in every if x.prompt_id.endswith("/q7"))
        assert it.prompt == DAPO_TEMPLATE.format(problem="What is 7 + 7?")
        assert (it.ground_truth, it.verifier, it.data_source) == ("14", "dapo_math", "math_dapo")


def test_bad_dataset_specs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="use reasoning_gym"):
        load_source("nope")
    with pytest.raises(ValueError, match="unknown reasoning-gym tasks"):
        load_source("reasoning_gym:nope")
    with pytest.raises(FileNotFoundError):
        load_source(f"file:{tmp_path / 'missing.parquet'}")
