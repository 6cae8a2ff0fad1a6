"""Prompt sources, each split into a training part and a held-out evaluation part, and the held-out file.

The buffer draws its training prompts from a source; the rollout's evaluator and `dapo-mesh eval` read the
held-out split, either drawn again from the same spec or from the file the buffer wrote (`eval.jsonl`, one
`Item` per line, see `eval_items_path`): a contract between processes like a stream message, so it lives in
the ground layer.

    source = load_source("reasoning_gym:chain_sum", size=10000, seed=42, config={"chain_sum": {...}})
    source = load_source("reasoning_gym:chain_sum=0.7,basic_arithmetic=0.3", ...)   # a weighted mix
    source = load_source("file:/data/dapo-math-17k.parquet@dapo_math")               # verl schema, its verifier
    source = load_source("reasoning_gym:basic_arithmetic=2,chain_sum=1; file:/data/gsm.jsonl@math_verify=1")
    source = load_source("env:calculator; env:retry=0.5")     # episodes: tasks an environment draws from seeds
    source.train[i] -> Item;  source.eval -> list[Item] (never dispatched for training)

A mixture is sources separated by `;`, each with its weight (a reasoning-gym part weighs the sum of its tasks'
weights; a file part `=w`, default 1): the part of each training position is a seeded weighted draw, and each
part's held-out share is its weight's share of `eval_size` (an empty share is an error). Every item carries its
verifier: reasoning-gym's own per task; a file row's `verifier` field, else the file's `@verifier`, else
`file_verifier` (none of them: an error, not a silent default).

An `env:<name>` part is an environment's tasks (services/episodes.py): item i asks the environment service for
the task it draws from seed `seed * 1_000_000 + i` (ground truth `{"seed": n}`, verifier `env:<name>`; the
replica runs its episodes), the held-out ones from seeds past EVAL_SEED_OFFSET, asked with `"split": "eval"`: an
environment with few distinct tasks (the built-in ones) keeps its held-out tasks apart, so an evaluation never asks
a question training saw (env_server/base.py `split`).

reasoning-gym items are generated from Random(seed + i), so two datasets with close seeds overlap
almost entirely: the evaluation split is drawn from a far-away seed, and any question that also
occurs in training is dropped from it. Files in the verl / DAPO-Math-17k schema (`data_source`,
`prompt` as chat messages, `reward_model.ground_truth`) are read unchanged; their last `eval_size`
rows after a fixed shuffle are held out.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from services.code_tests import parse_tests

Template = Literal["dapo", "short", "none"]
EVAL_SEED_OFFSET = 1_000_003
EVAL_ITEMS_FILE = "eval.jsonl"

# chain_sum with two terms of 1-2 digits: the dataset config of a reasoning-gym spec given without one (the buffer's
# --dataset-config default, and `dapo-mesh eval`'s). SmolLM2-135M-Instruct (from the GGUF) gets only 1.5-4% of it
# right when sampled: configs/dapo.toml trains on 1-digit basic_arithmetic instead (docs: results/learning-runs.md).
DEFAULT_DATASET_CONFIG = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
SHORT_TEMPLATE = "{problem}\nReply with 'Answer: <number>'."


@dataclass(frozen=True)
class Item:
    prompt_id: str
    prompt: str
    ground_truth: str
    verifier: str
    data_source: str


def eval_items_path(buffer_dir: Path) -> Path:
    """Where a buffer whose run directory is `buffer_dir` writes its held-out split."""
    return buffer_dir / EVAL_ITEMS_FILE


def write_items(path: Path, items: Sequence[Item]) -> None:
    """Items as JSON lines (the buffer's held-out split, eval.jsonl), replaced whole: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(it.__dict__) + "\n" for it in items)
    tmp.replace(path)


def read_items(path: Path) -> list[Item]:
    """The items of a file `write_items` wrote; a line that is not one names its line number."""
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(Item(**json.loads(line)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not an item ({', '.join(f.name for f in fields(Item))}): {e}") from None
    return items


def apply_template(problem: str, template: Template) -> str:
    if template == "dapo":
        return DAPO_TEMPLATE.format(problem=problem)
    if template == "short":
        return SHORT_TEMPLATE.format(problem=problem)
    return problem


@dataclass
class Source:
    name: str
    train: Sequence[Item]
    eval: list[Item]


class _RGItems(Sequence[Item]):
    """A lazy view of a weighted mix of reasoning-gym datasets (items made on access)."""

    def __init__(
        self, tasks: dict[str, float], size: int, seed: int, config: dict[str, dict[str, Any]], template: Template
    ):
        import reasoning_gym

        self.size, self.seed, self.template = size, seed, template
        self.names = list(tasks)
        self.weights = [tasks[n] for n in self.names]
        self.datasets = {
            n: reasoning_gym.create_dataset(n, size=size, seed=seed, **config.get(n, {})) for n in self.names
        }

    def __len__(self) -> int:
        return self.size

    def _task(self, i: int) -> str:
        if len(self.names) == 1:
            return self.names[0]
        return random.Random(self.seed * 7919 + i).choices(self.names, self.weights)[0]

    def __getitem__(self, i: int) -> Item:  # type: ignore[override]
        if not 0 <= i < self.size:
            raise IndexError(i)
        task = self._task(i)
        entry = self.datasets[task][i]
        ground_truth = json.dumps({"answer": entry["answer"], "metadata": entry.get("metadata", {})}, default=str)
        return Item(
            f"rg/{task}/{self.seed}/{i}",
            apply_template(entry["question"], self.template),
            ground_truth,
            f"reasoning_gym:{task}",
            f"reasoning_gym/{task}",
        )

    def question(self, i: int) -> str:
        return str(self.datasets[self._task(i)][i]["question"])


def parse_tasks(spec: str) -> dict[str, float]:
    """'chain_sum' or 'chain_sum=0.7,basic_arithmetic=0.3' -> {name: weight}."""
    out: dict[str, float] = {}
    for part in spec.split(","):
        name, _, w = part.strip().partition("=")
        if not name:
            raise ValueError(f"empty task name in {spec!r}")
        out[name] = float(w) if w else 1.0
        if out[name] <= 0:
            raise ValueError(f"task weight must be > 0: {part!r}")
    return out


def reasoning_gym_source(
    tasks: dict[str, float],
    *,
    size: int,
    seed: int,
    eval_size: int,
    config: dict[str, dict[str, Any]],
    template: Template,
) -> Source:
    from reasoning_gym.factory import DATASETS

    unknown = sorted(set(tasks) - set(DATASETS))
    if unknown:
        raise ValueError(f"unknown reasoning-gym tasks {unknown}; e.g. chain_sum, basic_arithmetic, gsm_symbolic")
    train = _RGItems(tasks, size, seed, config, template)
    eval_items: list[Item] = []
    if eval_size:
        seen = {train.question(i) for i in range(size)}
        pool = _RGItems(tasks, eval_size * 2 + 16, seed + EVAL_SEED_OFFSET, config, template)
        for i in range(len(pool)):
            if pool.question(i) not in seen:
                seen.add(pool.question(i))
                eval_items.append(pool[i])
                if len(eval_items) == eval_size:
                    break
        empty = sorted(set(tasks) - {it.data_source.removeprefix("reasoning_gym/") for it in eval_items})
        if empty:
            raise ValueError(
                f"reasoning-gym tasks {empty} would have no held-out items of eval_size {eval_size} (too small a "
                "weight, or every question also in training): raise eval_size or their weight"
            )
    return Source("reasoning_gym:" + ",".join(f"{n}={w:g}" for n, w in tasks.items()), train, eval_items)


def _verl_row(i: int, row: dict[str, Any], path: Path, template: Template, verifier: str | None) -> Item:
    verifier = row.get("verifier") or verifier
    if not verifier:
        raise ValueError(
            f"{path} row {i}: no verifier: give each row a `verifier` field, or the file one (file:{path}@dapo_math "
            "in the dataset spec, or --file-verifier)"
        )
    prompt = row["prompt"]
    if isinstance(prompt, list | tuple):  # chat messages: the last user turn carries the problem
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        if not users:
            raise ValueError(f"{path} row {i}: prompt has no user message")
        text = users[-1]
    else:
        text = str(prompt)
    rm = row.get("reward_model") or {}
    if "ground_truth" not in rm:
        raise ValueError(f"{path} row {i}: no reward_model.ground_truth")
    source = str(row.get("data_source", path.stem))
    ident = (row.get("extra_info") or {}).get("index", i)
    truth = rm["ground_truth"]
    if verifier == "code":  # its tests: checked now, before anything starts (services/code_tests.py)
        truth = truth if isinstance(truth, str) else json.dumps(truth)
        try:
            parse_tests(truth)
        except ValueError as e:
            raise ValueError(f"{path} row {i}: {e}") from None
    return Item(
        f"file/{path.name}/{ident}",
        apply_template(text, template),
        str(truth),
        str(verifier),
        source,
    )


def file_source(path: Path, *, eval_size: int, seed: int, template: Template, verifier: str | None) -> Source:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        raise ValueError(f"{path}: expected .parquet or .jsonl")
    items = [_verl_row(i, r, path, template, verifier) for i, r in enumerate(rows)]
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_eval = min(eval_size, len(items) // 2)
    held = set(order[len(order) - n_eval :])
    return Source(f"file:{path}", [it for i, it in enumerate(items) if i not in held], [items[i] for i in sorted(held)])


def load_source(
    spec: str,
    *,
    size: int = 10_000,
    seed: int = 42,
    eval_size: int = 200,
    config: dict[str, dict[str, Any]] | None = None,
    template: Template = "short",
    file_verifier: str | None = None,
) -> Source:
    parts = [p.strip() for p in spec.split(";") if p.strip()]
    if not parts:
        raise ValueError("empty dataset spec")
    weights = [part_weight(p) for p in parts]
    if len(parts) == 1:
        return _load_part(parts[0], size, seed, eval_size, config or {}, template, file_verifier)
    sources = []
    for part, w, share in zip(parts, weights, apportion(eval_size, weights), strict=True):
        src = _load_part(part, size, seed, share, config or {}, template, file_verifier)
        if not src.train:
            raise ValueError(f"dataset part {part!r} has no training items")
        if eval_size and not src.eval:
            raise ValueError(
                f"dataset part {part!r} (weight {w:g} of {sum(weights):g}) would have no held-out items of "
                f"eval_size {eval_size}: raise eval_size or its weight"
            )
        sources.append(src)
    return Source(
        "; ".join(src.name for src in sources),
        _Mixed([s.train for s in sources], weights, size, seed),
        interleave([src.eval for src in sources]),
    )


def interleave(parts: Sequence[Sequence[Item]]) -> list[Item]:
    """The parts' items merged evenly (each at its fraction of its own part): every prefix holds each part in about
    its share, so an evaluation of the first n held-out items (rollout's --eval-size) sees every task."""
    keyed = [((k + 0.5) / len(p), j, it) for j, p in enumerate(parts) for k, it in enumerate(p)]
    return [it for _, _, it in sorted(keyed, key=lambda x: (x[0], x[1]))]


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split by weight, largest remainders first: the shares add up to `total` exactly."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: shares[i] - exact[i])[: total - sum(shares)]:
        shares[i] += 1
    return shares


def distinct_prompts(items: Sequence[Item]) -> int:
    """How many different prompts a training sequence holds (a mixture may hold a short part's prompts twice)."""
    return items.distinct if isinstance(items, _Mixed) else len(items)


class _EnvItems(Sequence[Item]):
    """The tasks an environment draws from a range of seeds, made on access."""

    def __init__(self, name: str, first_seed: int, size: int, split: str = "train"):
        self.name, self.first, self.size, self.split = name, first_seed, size, split

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Item:  # type: ignore[override]
        if not 0 <= i < self.size:
            raise IndexError(i)
        seed = self.first + i
        truth = {"seed": seed} | ({"split": self.split} if self.split != "train" else {})
        return Item(
            f"env/{self.name}/{seed}",
            f"[{self.name} task of seed {seed}]",
            json.dumps(truth),
            f"env:{self.name}",
            f"env/{self.name}",
        )


def env_source(name: str, *, size: int, seed: int, eval_size: int) -> Source:
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
        raise ValueError(f"dataset part env:{name}: not an environment name ([A-Za-z0-9_.:-], 1-64 characters)")
    train = _EnvItems(name, seed * 1_000_000, size)
    held_out = _EnvItems(name, EVAL_SEED_OFFSET * 1_000 + seed * 1_000_000, eval_size, split="eval")
    return Source(f"env:{name}", train, list(held_out))


def check_spec(spec: str) -> list[str]:
    """What can be checked of a dataset spec without reading it: each part's syntax and weight, reasoning-gym task
    names, that files exist. Returns the verifiers the file parts name (`@verifier`), for the caller to check."""
    parts = [p.strip() for p in spec.split(";") if p.strip()]
    if not parts:
        raise ValueError("empty dataset spec")
    verifiers = []
    for part in parts:
        part_weight(part)
        if part.startswith("env:"):
            env_source(_env_part(part)[0], size=1, seed=0, eval_size=0)  # the name's syntax
        elif part.startswith("reasoning_gym:"):
            from reasoning_gym.factory import DATASETS

            unknown = sorted(set(parse_tasks(part[len("reasoning_gym:") :])) - set(DATASETS))
            if unknown:
                raise ValueError(f"unknown reasoning-gym tasks {unknown}; e.g. chain_sum, basic_arithmetic")
        else:
            path, verifier, _ = _file_part(part)
            if not path.is_file():
                raise FileNotFoundError(f"dataset file {path} not found")
            verifiers += [verifier] if verifier else []
    return verifiers


def file_verifiers(spec: str) -> list[str]:
    """The verifiers a dataset spec's file parts name (`file:PATH@VERIFIER`), in order."""
    parts = (p.strip() for p in spec.split(";"))
    return [v for p in parts if p.startswith("file:") and (v := _file_part(p)[1])]


def env_names(spec: str) -> list[str]:
    """The environments a dataset spec's `env:NAME` parts name, in order."""
    return [_env_part(p)[0] for p in (p.strip() for p in spec.split(";")) if p.startswith("env:")]


def data_sources(spec: str) -> set[str] | None:
    """The data sources a spec's items carry (`reasoning_gym/<task>`, `env/<name>`), known without reading the data;
    None where a file part's rows name their own."""
    out: set[str] = set()
    for part in (p.strip() for p in spec.split(";") if p.strip()):
        if part.startswith("reasoning_gym:"):
            out |= {f"reasoning_gym/{t}" for t in parse_tasks(part[len("reasoning_gym:") :])}
        elif part.startswith("env:"):
            out.add(f"env/{_env_part(part)[0]}")
        else:
            return None
    return out


def part_weight(part: str) -> float:
    """The weight of one part of a mixture: a reasoning-gym part's tasks' sum, a file part's `=w` (default 1)."""
    if part.startswith("reasoning_gym:"):
        return sum(parse_tasks(part[len("reasoning_gym:") :]).values())
    if part.startswith("file:"):
        return _file_part(part)[2]
    if part.startswith("env:"):
        return _env_part(part)[1]
    raise ValueError(
        f"dataset {part!r}: use reasoning_gym:<task>[=w,...], file:<path>[@verifier][=w] or env:<name>[=w], ';' between"
    )


def _env_part(part: str) -> tuple[str, float]:
    """env:NAME[=WEIGHT] -> (name, weight)."""
    name, eq, w = part[len("env:") :].partition("=")
    try:
        weight = float(w) if eq else 1.0
    except ValueError:
        raise ValueError(f"dataset part {part!r}: weight {w!r} is not a number") from None
    if weight <= 0:
        raise ValueError(f"dataset part {part!r}: weight must be > 0")
    return name.strip(), weight


def _file_part(part: str) -> tuple[Path, str | None, float]:
    """file:PATH[@VERIFIER][=WEIGHT] -> (path, verifier, weight); a path may hold '=' and '@' (the last of each is
    the separator, and only a number after the last '=' is a weight)."""
    rest = part[len("file:") :]
    weight = 1.0
    head, eq, tail = rest.rpartition("=")
    if eq and "/" not in tail:
        try:
            weight = float(tail)
        except ValueError:
            raise ValueError(f"dataset part {part!r}: weight {tail!r} is not a number") from None
        rest = head
        if weight <= 0:
            raise ValueError(f"dataset part {part!r}: weight must be > 0")
    path, at, verifier = rest.rpartition("@")
    if not at or "/" in verifier:  # no '@', or one inside the path
        return Path(rest), None, weight
    return Path(path), verifier, weight


def _load_part(
    part: str,
    size: int,
    seed: int,
    eval_size: int,
    config: dict[str, dict[str, Any]],
    template: Template,
    file_verifier: str | None,
) -> Source:
    if part.startswith("reasoning_gym:"):
        tasks = parse_tasks(part[len("reasoning_gym:") :])
        return reasoning_gym_source(tasks, size=size, seed=seed, eval_size=eval_size, config=config, template=template)
    if part.startswith("env:"):
        return env_source(_env_part(part)[0], size=size, seed=seed, eval_size=eval_size)
    path, verifier, _ = _file_part(part)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} not found")
    return file_source(path, eval_size=eval_size, seed=seed, template=template, verifier=verifier or file_verifier)


class _Mixed(Sequence[Item]):
    """Parts drawn by weight: position i's part is a seeded weighted draw, and a part's k-th position takes its
    k-th item in a seeded order of the part (cycling through a part shorter than its share)."""

    def __init__(self, parts: list[Sequence[Item]], weights: list[float], size: int, seed: int):
        rng = random.Random(seed * 7919 + 17)
        self.parts = parts
        self.orders = [rng.sample(range(len(p)), len(p)) for p in parts]
        self.slots: list[tuple[int, int]] = []
        seen = [0] * len(parts)
        for j in rng.choices(range(len(parts)), weights, k=size):
            self.slots.append((j, self.orders[j][seen[j] % len(parts[j])]))
            seen[j] += 1
        self.distinct = sum(min(n, len(p)) for n, p in zip(seen, parts, strict=True))

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Item:  # type: ignore[override]
        j, k = self.slots[i]
        return self.parts[j][k]
