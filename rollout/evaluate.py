"""Held-out evaluation with the rollout engine and the reward server: avg@k and pass@k.

    items = load_eval_items("reasoning_gym:chain_sum", size=200)      # the buffer's held-out split
    items = load_eval_items(".dapo/buffer/eval.jsonl")                  # ... or the file the buffer wrote
    items = load_eval_items(path, tasks=["reasoning_gym/basic_arithmetic"])   # ... one task of a mixture
    report, samples = evaluate(engine, items, reward_client, k=4, params=SamplingParams(seed=1234))

avg@k is the mean accuracy over the k samples of every prompt (the DAPO paper reports avg@32);
pass@j (j = 1, 2, 4, ..., k) is the unbiased estimator of Chen et al. 2021 from the same k samples:
1 - C(k-c, j) / C(k, j) per prompt with c correct, averaged over prompts (pass@k: any of k correct).
Sampling is seeded per engine call, and the calls always hold PROMPTS_PER_CALL prompts (whoever evaluates:
`dapo-mesh eval` or a replica's seeded evaluation during training, rollout/evaluator.py), so the same seed, weights
and items give the same samples and the same numbers. Every sample is scored by the reward server (`acc`: what
training rewards, without the overlong shaping).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout.engines.base import Completion, Engine, SamplingParams, encode_prompt
from rollout.episode_runner import ENV_PREFIX, EpisodeRunner, run_items
from rollout.episodes import Episode
from rollout.reward_client import RewardClient, score_items
from services.datasets import DEFAULT_DATASET_CONFIG, Item, Template, load_source, read_items
from services.schemas import PromptTask

PROMPTS_PER_CALL = 32  # prompts (x k samples) per engine call; fixed, because the seeds go by call


@dataclass
class EvalReport:
    version: int
    k: int
    n_prompts: int
    avg_at_k: float
    pass_at: dict[int, float]
    by_source: dict[str, float]  # avg@k per data source
    mean_response_tokens: float
    truncated_frac: float
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def pass_at_k(self) -> float:
        return self.pass_at[self.k]

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"pass_at_k": self.pass_at_k}, indent=1)


@dataclass(frozen=True)
class EvalSample:
    prompt_id: str
    sample: int
    response: str
    response_tokens: int
    finish_reason: str
    acc: bool
    score: float
    pred: str | None


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def load_eval_items(
    data: str,
    *,
    size: int = 200,
    seed: int = 42,
    dataset_size: int = 10_000,
    config: dict[str, dict[str, Any]] | None = None,
    template: Template = "short",
    tasks: Sequence[str] = (),
) -> list[Item]:
    """A dataset spec: its held-out split, exactly as the buffer draws it given the same seed, training size
    (questions that occur in training are dropped), config and template. Or a .jsonl file of items (the
    buffer's run_dir/eval.jsonl). The first `size` items; with `tasks`, those of them whose data source is one of
    these (`reasoning_gym/basic_arithmetic`: a mixture's learnable part alone). No config: the buffer's default."""
    if data.startswith(("reasoning_gym:", "file:", "env:")):
        config = DEFAULT_DATASET_CONFIG if config is None else config
        source = load_source(data, size=dataset_size, seed=seed, eval_size=size, config=config, template=template)
        return of_tasks(source.eval, tasks)
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(
            f"evaluation data {data!r}: neither a dataset spec (reasoning_gym:..., file:..., env:...) nor a file"
        )
    return of_tasks(read_items(path)[:size], tasks)


def of_tasks(items: list[Item], tasks: Sequence[str]) -> list[Item]:
    """The items whose data source is one of `tasks` (none named: all); a task none of them has is an error that
    names the ones there are, not an evaluation of nothing."""
    if not tasks:
        return items
    there = {it.data_source for it in items}
    missing = sorted(set(tasks) - there)
    if missing:
        raise ValueError(f"held-out items have no task {missing}: they have {sorted(there)}")
    return [it for it in items if it.data_source in tasks]


class EvaluationStopped(Exception):
    """The evaluation was given up between two engine calls: the process is leaving (SIGTERM)."""


def evaluate(
    engine: Engine,
    items: Sequence[Item],
    reward: RewardClient,
    *,
    k: int,
    params: SamplingParams,
    chat_template: bool = True,
    stopped: Callable[[], bool] = lambda: False,
    episodes: EpisodeRunner | None = None,
) -> tuple[EvalReport, list[EvalSample]]:
    """k samples per item from the engine's current weights, each scored by the reward server. `stopped()` is asked
    before each engine call: true raises EvaluationStopped (a replica told to leave does not finish a long
    evaluation first). Environment tasks (verifier env:<name>) are k episodes each, run turn by turn by `episodes`
    against the environment service; an episode's success is a positive reward."""
    if not items:
        raise ValueError("no evaluation items")
    t0 = time.perf_counter()
    version = engine.version
    samples: list[EvalSample] = []
    for start in range(0, len(items), PROMPTS_PER_CALL):
        if stopped():
            raise EvaluationStopped(f"stopped after {start} of {len(items)} items")
        chunk = [it for it in items[start : start + PROMPTS_PER_CALL] if not it.verifier.startswith(ENV_PREFIX)]
        envs = [it for it in items[start : start + PROMPTS_PER_CALL] if it.verifier.startswith(ENV_PREFIX)]
        # each engine call gets its own seed, from the position of its first item in the whole list
        chunk_params = (
            params
            if params.seed is None
            else SamplingParams(params.temperature, params.top_p, params.max_tokens, params.seed + 7919 * start)
        )
        if envs:
            if episodes is None:
                raise ValueError("held-out environment tasks need the environment service (a replica's --env-url)")
            samples += episode_samples(episodes, engine, envs, k, chunk_params, version)
        if chunk:
            prompts = [encode_prompt(engine.tokenizer, it.prompt, chat_template) for it in chunk]
            samples += score_samples(chunk, engine.generate(prompts, k, chunk_params), reward, params.max_tokens)
    if engine.version != version:
        raise RuntimeError(f"the engine's weights changed during the evaluation ({version} -> {engine.version})")
    return summarize(items, samples, k, version, time.perf_counter() - t0), samples


def episode_samples(
    runner: EpisodeRunner, engine: Engine, items: Sequence[Item], k: int, params: SamplingParams, version: int
) -> list[EvalSample]:
    """k episodes of each environment task, turn by turn; acc: the environment's reward is positive."""
    tasks = eval_tasks(items, k, version)
    return episode_eval_samples(tasks, run_items(runner, engine, tasks, params), engine.tokenizer)


def eval_tasks(items: Sequence[Item], k: int, version: int) -> list[PromptTask]:
    """Held-out environment tasks as the prompts of k episodes each."""
    return [
        PromptTask(
            task_id=f"eval.{version}.{i}",
            prompt_id=it.prompt_id,
            prompt=it.prompt,
            n_samples=k,
            ground_truth=it.ground_truth,
            verifier=it.verifier,
            data_source=it.data_source,
        )
        for i, it in enumerate(items)
    ]


def episode_eval_samples(
    tasks: Sequence[PromptTask], done: dict[str, list[Episode]], tokenizer: Any
) -> list[EvalSample]:
    """Each task's finished episodes (task_id -> episodes) as scored samples: acc, the reward is positive."""
    samples = []
    for task in tasks:
        for j, ep in enumerate(done[task.task_id]):
            text = tokenizer.decode(ep.ids)
            model_tokens = sum(t.tokens for t in ep.turns if t.role == "model")
            reward = float(ep.reward or 0.0)
            finish = "length" if ep.ended == "max_tokens" else "stop"
            samples.append(EvalSample(task.prompt_id, j, text, model_tokens, finish, reward > 0, reward, None))
    return samples


def score_samples(
    items: Sequence[Item], outs: Sequence[Sequence[Completion]], reward: RewardClient, max_tokens: int
) -> list[EvalSample]:
    """Every completion of every item scored by the reward server, in one request."""
    results = iter(reward.score(score_items(items, outs, max_tokens)))
    samples = []
    for it, o in zip(items, outs, strict=True):
        for j, c in enumerate(o):
            r = next(results)
            samples.append(
                EvalSample(it.prompt_id, j, c.text, len(c.token_ids), c.finish_reason, r.acc, r.score, r.pred)
            )
    return samples


def summarize(
    items: Sequence[Item], samples: Sequence[EvalSample], k: int, version: int, seconds: float = 0.0
) -> EvalReport:
    """avg@k and pass@j from scored samples (also what a test recomputes from re-scored samples)."""
    correct: dict[str, int] = defaultdict(int)
    seen: dict[str, int] = defaultdict(int)
    for s in samples:
        seen[s.prompt_id] += 1
        correct[s.prompt_id] += s.acc
    ids = [it.prompt_id for it in items]
    if len(set(ids)) != len(ids) or any(seen[i] != k for i in ids) or len(seen) != len(ids):
        raise ValueError(f"expected exactly {k} samples for each of {len(ids)} distinct items")
    per_source: dict[str, list[float]] = defaultdict(list)
    for it in items:
        per_source[it.data_source].append(correct[it.prompt_id] / k)
    js = sorted({2**e for e in range(k.bit_length()) if 2**e <= k} | {k})
    return EvalReport(
        version=version,
        k=k,
        n_prompts=len(items),
        avg_at_k=sum(correct[i] for i in ids) / (k * len(ids)),
        pass_at={j: sum(pass_at(k, correct[i], j) for i in ids) / len(ids) for j in js},
        by_source={src: sum(v) / len(v) for src, v in sorted(per_source.items())},
        mean_response_tokens=sum(s.response_tokens for s in samples) / len(samples),
        truncated_frac=sum(s.finish_reason == "length" for s in samples) / len(samples),
        seconds=seconds,
    )
