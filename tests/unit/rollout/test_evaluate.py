"""avg@k and pass@k: the estimator against brute-force enumeration, and summaries of hand-made samples."""

from __future__ import annotations

import itertools
from fractions import Fraction
from pathlib import Path

import pytest

from rollout.evaluate import EvalSample, load_eval_items, pass_at, summarize
from services.datasets import Item, write_items


@pytest.mark.parametrize("n", [1, 2, 4, 5, 8])
def test_pass_at_is_the_chance_that_a_random_j_subset_holds_a_correct_sample(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for j in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, j))
            exact = Fraction(sum(any(s) for s in subsets), len(subsets))
            assert pass_at(n, c, j) == pytest.approx(float(exact), abs=1e-12), (n, c, j)


def test_pass_at_rejects_impossible_counts() -> None:
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            pass_at(n, c, k)


def item(i: int, source: str = "rg/a") -> Item:
    return Item(f"p{i}", f"q{i}", "1", "reasoning_gym:chain_sum", source)


def sample(i: int, j: int, acc: bool, tokens: int = 10, reason: str = "stop") -> EvalSample:
    return EvalSample(f"p{i}", j, "x", tokens, reason, acc, 1.0 if acc else -1.0, None)


def test_summarize_counts_per_prompt_and_per_source() -> None:
    items = [item(0), item(1), item(2, "rg/b")]
    correct = {0: [True, False, False, False], 1: [False] * 4, 2: [True, True, True, False]}
    samples = [sample(i, j, a, tokens=8 + j, reason="length" if j == 3 else "stop")
               for i, accs in correct.items() for j, a in enumerate(accs)]  # fmt: skip
    r = summarize(items, samples, k=4, version=7)
    assert r.avg_at_k == pytest.approx(4 / 12)
    assert r.pass_at_k == pytest.approx(2 / 3)  # prompts 0 and 2 have a correct sample
    assert r.pass_at[1] == pytest.approx(r.avg_at_k)
    assert r.pass_at[2] == pytest.approx((0.5 + 0 + 1.0) / 3)  # 1 - C(3,2)/C(4,2) = 0.5; 1 - C(1,2)/C(4,2) = 1
    assert sorted(r.pass_at) == [1, 2, 4] and r.version == 7
    assert r.by_source == {"rg/a": pytest.approx(1 / 8), "rg/b": pytest.approx(3 / 4)}
    assert r.mean_response_tokens == pytest.approx(9.5) and r.truncated_frac == pytest.approx(0.25)


def test_summarize_wants_exactly_k_samples_of_every_item() -> None:
    items = [item(0), item(1)]
    with pytest.raises(ValueError, match="exactly 2 samples"):
        summarize(items, [sample(0, 0, True), sample(0, 1, True), sample(1, 0, False)], k=2, version=0)
    with pytest.raises(ValueError, match="exactly 1 samples"):
        summarize(items, [sample(0, 0, True), sample(1, 0, True), sample(2, 0, True)], k=1, version=0)


class CountingEngine:
    """Answers every prompt k times, and counts its calls (the engine is not under test: when `evaluate` stops is)."""

    version = 3

    def __init__(self) -> None:
        from learner.tiny import tiny_tokenizer

        self.tokenizer, self.calls = tiny_tokenizer(), 0

    def generate(self, prompts, k, params):  # type: ignore[no-untyped-def]
        from rollout.engines.base import Completion

        self.calls += 1
        return [[Completion([1, 2], "1", [-0.1, -0.1], "stop") for _ in range(k)] for _ in prompts]


class AllRight:
    def score(self, items):  # type: ignore[no-untyped-def]
        from services.schemas import ScoreResult

        return [ScoreResult(id=it.id, score=1.0, acc=True) for it in items]


def test_a_seeded_evaluation_stops_between_engine_calls_when_told() -> None:
    """A replica told to leave (SIGTERM) in the middle of a long held-out evaluation must not finish it first: it
    used to ignore SIGTERM for over 30 s. `stopped()` is asked before every engine call."""
    from rollout.engines.base import SamplingParams
    from rollout.evaluate import PROMPTS_PER_CALL, EvaluationStopped, evaluate

    items = [item(i) for i in range(3 * PROMPTS_PER_CALL)]  # three engine calls
    params = SamplingParams(1.0, 1.0, 8, 1234)
    engine = CountingEngine()
    with pytest.raises(EvaluationStopped):
        evaluate(engine, items, AllRight(), k=2, params=params, stopped=lambda: engine.calls >= 1)  # type: ignore[arg-type]
    assert engine.calls == 1  # the call in flight ended; the next two never began
    engine = CountingEngine()
    report, _ = evaluate(engine, items, AllRight(), k=2, params=params)  # type: ignore[arg-type]
    assert engine.calls == 3 and report.avg_at_k == 1.0 and report.version == 3


def test_eval_tasks_keep_a_mixtures_named_parts_of_the_first_size_items(tmp_path: Path) -> None:
    spec = "reasoning_gym:basic_arithmetic=1; reasoning_gym:chain_sum=3"
    every = load_eval_items(spec, size=40, dataset_size=200)
    arith = load_eval_items(spec, size=40, dataset_size=200, tasks=["reasoning_gym/basic_arithmetic"])
    assert arith == [it for it in every if it.data_source == "reasoning_gym/basic_arithmetic"]
    assert 0 < len(arith) < len(every)  # a part, in the split's order
    path = tmp_path / "eval.jsonl"
    write_items(path, every)  # the file the buffer writes: the same items, the first `size` of it
    assert load_eval_items(str(path), size=20, tasks=["reasoning_gym/chain_sum"]) == [
        it for it in every[:20] if it.data_source == "reasoning_gym/chain_sum"
    ]
    with pytest.raises(ValueError, match=r"no task \['chain_sum'\].*'reasoning_gym/chain_sum'"):
        load_eval_items(str(path), size=40, tasks=["chain_sum"])  # a task name, not its data source: said, not empty
