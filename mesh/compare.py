"""`dapo-mesh compare RUN_DIR...`: runs side by side, grouped into arms, with their spread over seeds.

    dapo-mesh compare .dapo/ablate/dapo-seed* .dapo/ablate/grpo-seed* [--out DIR] [--gain 0.2] [--json]
    dapo-mesh compare RUN... --task reasoning_gym/basic_arithmetic   # one part of a mixture's held-out split
    dapo-mesh compare RUN... --base 0 --gain 0.3   # time until held-out avg@k stood at 0.3, whatever each run's first
    comparison([Path("a-seed1"), Path("b-seed1")], gain=0.2)  # -> Comparison; compare_report.compare writes it

A run is a run directory of `dapo-mesh up` (its metrics.jsonl; config.json and cpu.json when it has them) or a copy
of a metrics.jsonl named NAME.metrics.jsonl, as the docs keep them. Runs whose configs are equal but for `seed` and
`run_dir` form an arm; a run without config.json (made before the mesh wrote one) is grouped by its directory's name
less a trailing "-seed<N>", which also gives its seed. Per arm: the final and best held-out avg@k and the final
pass@k, each as mean ± standard error over the seeds (std/√n), the mean wall time, the minutes until held-out avg@k
first stood `gain` above the run's first evaluation (or above `base`, one value for every run: a first evaluation run
beside training, `eval_mode = "shared"`, holds tokens of later versions, more in one run than another), the versions
trained, the difference of the arm's final mean from the first arm's with Welch's standard error √(s1²/n1 + s2²/n2),
generated samples per trained one and the policy's token entropy in each third of the steps (its collapse is what
DAPO's clip-higher is for), the response tokens per trained sample and the share of trained samples cut at the length
bound in each third (what DAPO's overlong filter and soft punishment act on; the latter recorded since 2026-12-07).
The config keys whose values differ between arms head the table. Written, with `out`, to OUT/compare.md,
OUT/compare.json and OUT/compare.png (the held-out curves by version and by wall-clock minutes, the batch reward and
the token entropy by step: a colour per arm). With `task`, every held-out number is that part's of a mixture
(`eval_acc/<task>`, the evaluation's accuracy on that task's held-out prompts; pass@k is not recorded per part: NaN).

Time. A run's wall time is cpu.json's `wall_s` (written when the mesh stops); without it, the span of its
evaluations' `eval_at` stamps; else unknown (train rows carry no timestamp: their `seconds` is the learner's compute
for that step, not the wall time). An evaluation's minutes since the run's start come from `eval_at`, counted from
when the first evaluation began (its `eval_at` less its `eval_seconds`: the mesh is up then). Runs recorded before
eval rows carried `eval_at` are placed by the learner's cumulative `seconds` + `sync_seconds` up to that version,
stretched so the run's last step ends at its wall time (an estimate: the rest of the wall time, rollouts the learner
waited for and evaluations, spread evenly); with no wall time either, unstretched (a lower bound). `Run.clock` says
which.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mesh.layout import RunLayout

# what may differ between the runs of one arm; rollout.replica_id: config.json holds the orchestrator's default
# (hostname-pid), a new one every run (the mesh names its replicas itself)
IGNORED = ("seed", "run_dir", "trackers", "linger_s", "rollout.replica_id")


def ignored(key: str) -> bool:
    """A config key (dotted) that does not make another arm: the seed, where the run went, how it was watched."""
    return key in IGNORED or key.startswith("tracking.")


THIRDS = 3  # generated per trained sample is reported for each of this many equal spans of a run's steps
DEFAULT_GAIN = 0.20  # held-out avg@k points over the first evaluation that "time to gain" waits for
_SEED = re.compile(r"^(?P<name>.+)-seed(?P<seed>\d+)$")


class NotARun(ValueError):
    """A path that holds no metrics.jsonl."""


def metric_rows(path: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl (or a copy of one, as the docs keep), a dict per line; [] without the file."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out evaluations (rows of kind "eval"), in policy-version order."""
    return sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["policy_version"])


def task_evals(evals: list[dict[str, Any]], task: str, path: Path) -> list[dict[str, Any]]:
    """The evaluations with one part's held-out accuracy as theirs (`eval_acc/<task>`; pass@k NaN: not recorded per
    part). NotARun where an evaluation lacks it, naming the parts the run's evaluations have."""
    key = f"eval_acc/{task}"
    missing = [r["policy_version"] for r in evals if not finite(r.get(key))]
    if missing or not evals:
        parts = sorted({k.removeprefix("eval_acc/") for r in evals for k in r if k.startswith("eval_acc/")})
        raise NotARun(
            f"{path}: its evaluations (versions {missing or 'none'}) have no held-out accuracy for task {task!r}; "
            f"the tasks they have: {', '.join(parts) or 'none (a dataset of one part)'}"
        )
    return [r | {"eval_acc": r[key], "eval_pass_at_k": math.nan} for r in evals]


def finite(*xs: Any) -> bool:
    return all(isinstance(x, int | float) and math.isfinite(x) for x in xs)


def sample_std(xs: list[float]) -> float:
    """The sample standard deviation (n − 1); NaN for fewer than two."""
    return statistics.stdev(xs) if len(xs) > 1 else math.nan


def mean_se(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error std/√n) of the finite values; NaN where there are too few."""
    xs = [x for x in xs if finite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), sample_std(xs) / math.sqrt(len(xs))


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean(a) − mean(b), its standard error √(s_a²/n_a + s_b²/n_b)): Welch's, NaN with fewer than two of either."""
    a, b = [x for x in a if finite(x)], [x for x in b if finite(x)]
    if not a or not b:
        return math.nan, math.nan
    se = math.sqrt(sample_std(a) ** 2 / len(a) + sample_std(b) ** 2 / len(b))
    return statistics.fmean(a) - statistics.fmean(b), se


@dataclass(frozen=True)
class Eval:
    version: int
    minutes: float  # since the run's start (Run.clock says how it was found)
    acc: float  # held-out avg@k
    pass_at_k: float


@dataclass(frozen=True)
class Run:
    path: Path
    name: str  # the directory's (or the metrics copy's) name less "-seed<N>"
    seed: int | None
    preset: str | None  # the preset's stem, from config.json
    config: dict[str, Any] | None  # flattened (learner.clip_high); None: no config.json
    evals: list[Eval]
    rewards: list[tuple[int, float]]  # (step, batch reward_mean)
    entropy: list[tuple[int, float]]  # (step, the batch's mean token entropy under the learner's policy)
    versions: int  # the newest policy version trained
    wall_s: float | None
    clock: str  # how the evaluations' minutes were found: "eval_at", "scaled" or "learner" (the docstring above)
    k: int | None  # the evaluations' k
    per_trained: tuple[float, float] = (math.nan, math.nan)  # generated samples per trained: whole run, after pass 1
    tokens_per_trained: float = math.nan  # generated response tokens per trained response token, whole run
    per_trained_thirds: tuple[float, ...] = ()  # generated per trained sample in each third of the run's steps
    machine: str | None = None  # cpu.json's machine ("AMD EPYC, 2 cores, avx512_bf16"); None: not recorded
    lengths: tuple[float, ...] = ()  # per step: response tokens per trained sample (response_lengths)
    truncated: tuple[float, ...] = ()  # per step: the batch's samples cut at the length bound (runs since 2026-12-07)

    @property
    def entropy_thirds(self) -> tuple[float, ...]:
        """The mean token entropy over each third of the run's steps; empty with fewer steps than thirds."""
        return parts_mean([h for _, h in self.entropy], THIRDS)

    @property
    def length_thirds(self) -> tuple[float, ...]:
        """Response tokens per trained sample, the mean over each third of the steps (the paper's length curve)."""
        return parts_mean(list(self.lengths), THIRDS)

    @property
    def truncated_thirds(self) -> tuple[float, ...]:
        """The share of trained samples cut at the length bound (what the overlong filter masks), each third."""
        return parts_mean(list(self.truncated), THIRDS)

    @property
    def final(self) -> float:
        return self.evals[-1].acc if self.evals else math.nan

    @property
    def best(self) -> float:
        return max(e.acc for e in self.evals) if self.evals else math.nan

    def minutes_to(self, gain: float, base: float | None = None) -> float | None:
        """Minutes until held-out avg@k first stood `gain` over `base` (None: the run's first evaluation); None if it
        never did."""
        if not self.evals:
            return None
        start = self.evals[0].acc if base is None else base
        hit = (e.minutes for e in self.evals if e.acc - start >= gain - 1e-9)  # in floats 0.29 - 0.09 < 0.2
        return next(hit, None)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"learner": {"clip_high": 0.28}} -> {"learner.clip_high": 0.28}; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@functools.cache
def setting_defaults() -> dict[str, Any]:
    """Every setting a run's config holds today (a section's field or the mesh's own), with its default; nested
    values (a dataset's config) are left out."""
    from mesh.config import MeshConfig  # here: the config model (and every service's settings) only when comparing

    flat = flatten(MeshConfig().model_dump(mode="json"))
    return {k: v for k, v in flat.items() if k.count(".") <= 1}


def with_new_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config with the settings added since it ran, at their defaults: a new setting's default keeps the
    behaviour from before it, so a run made before `sampling_give_up_by` existed ran as its default ("history") and
    is not another arm than one made after with the default."""
    nested = {".".join(k.split(".")[:2]) for k in config if k.count(".") > 1}
    return {k: v for k, v in setting_defaults().items() if k not in nested} | config


def read(path: Path, task: str | None = None) -> Run:
    """One run: a run directory or a NAME.metrics.jsonl copy; `task`: its held-out numbers those of that part of the
    dataset. NotARun without metrics, or with a task its evaluations do not name."""
    if path.is_file() and path.name.endswith("metrics.jsonl"):
        metrics, stem = path, path.name.removesuffix("metrics.jsonl").rstrip(".") or path.parent.name
        saved: dict[str, Any] = {}
        wall, where = None, None
    else:
        layout = RunLayout(path)
        metrics, stem = layout.metrics, path.resolve().name
        if not metrics.exists():
            raise NotARun(f"{path} is not a run: it has no metrics.jsonl")
        config_file, cpu = layout.config, layout.cpu
        saved = json.loads(config_file.read_text()) if config_file.exists() else {}
        cost = json.loads(cpu.read_text()) if cpu.exists() else {}
        wall, where = cost.get("wall_s"), _machine(cost.get("machine"))
    rows = metric_rows(metrics)
    match = _SEED.match(stem)
    config = with_new_settings(flatten(saved["config"])) if isinstance(saved.get("config"), dict) else None
    seed = config.get("seed") if config else None
    if seed is None and match:
        seed = int(match["seed"])
    evals = eval_rows(rows)
    if task is not None:
        evals = task_evals(evals, task, path)
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])
    minutes, clock, wall = _clock(evals, train, wall if finite(wall) else None)
    return Run(
        path=path,
        name=match["name"] if match else stem,
        seed=seed,
        preset=Path(saved["preset"]).stem if saved.get("preset") else None,
        config=config,
        evals=[
            Eval(r["policy_version"], m, r["eval_acc"], r.get("eval_pass_at_k", math.nan))
            for r, m in zip(evals, minutes, strict=True)
        ],
        rewards=[(r["step"], r["reward_mean"]) for r in train if finite(r.get("reward_mean"))],
        entropy=[(r["step"], r["entropy"]) for r in train if finite(r.get("entropy"))],
        versions=max((r["policy_version"] for r in train), default=0),
        wall_s=wall,
        clock=clock,
        k=evals[-1].get("eval_k") if evals else None,
        per_trained=generated_per_trained(train),
        tokens_per_trained=generated_tokens_per_trained(train),
        per_trained_thirds=generated_per_trained_by_part(train, THIRDS),
        machine=where,
        lengths=response_lengths(train, config),
        truncated=truncated_fractions(train),
    )


def response_lengths(train: list[dict[str, Any]], config: dict[str, Any] | None) -> tuple[float, ...]:
    """Response tokens per trained sample, per step: over the batch's `batch_samples` where the learner recorded it;
    else over the config's batch_size × n_samples when groups were of fixed size (a full batch: one the learner
    trimmed of groups past max_staleness reads shorter than it was); else none."""
    fixed = None
    if config and config.get("buffer.sampling_rule", "fixed") == "fixed":
        size, n = config.get("batch_size"), config.get("n_samples")
        fixed = float(size * n) if isinstance(size, int) and isinstance(n, int) else None
    out = []
    for r in train:
        samples = r.get("batch_samples") if finite(r.get("batch_samples")) else fixed
        if samples and finite(r.get("response_tokens")):
            out.append(r["response_tokens"] / samples)
    return tuple(out)


def truncated_fractions(train: list[dict[str, Any]]) -> tuple[float, ...]:
    """Each step's share of trained samples cut at the length bound; none unless every step recorded it (a run resumed
    across the day the learner began to would split only its later steps into thirds)."""
    if not train or not all(finite(r.get("truncated_frac")) for r in train):
        return ()
    return tuple(r["truncated_frac"] for r in train)


def _machine(m: Any) -> str | None:
    """cpu.json's machine in words: "AMD EPYC, 2 cores, avx512_bf16" (bf16 kernels: none = emulated)."""
    if not isinstance(m, dict):
        return None
    return f"{m.get('cpu', 'unknown')}, {m.get('cores')} cores, {', '.join(m.get('bf16') or []) or 'no bf16 kernels'}"


def parts_mean(xs: list[float], parts: int) -> tuple[float, ...]:
    """The mean of each of `parts` equal spans of `xs` (as the steps are cut for the thirds); () if too few."""
    if len(xs) < parts:
        return ()
    return tuple(statistics.fmean(xs[a:b]) for a, b in _spans(len(xs), parts))


def _spans(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` equal spans [start, end) of n items, as every "in each third of the steps" cuts them."""
    cuts = [round(n * i / parts) for i in range(parts + 1)]
    return list(zip(cuts, cuts[1:], strict=False))


def generated_per_trained(train: list[dict[str, Any]]) -> tuple[float, float]:
    """Samples generated per sample trained over the whole run and after the first pass over the training prompts
    (from the first step the dispatch cursor was in epoch 1): from the buffer's sample counts, or — a run from before
    them, its groups all of G — its groups received per group kept. NaN where unknown."""
    counted = _counts(train, least=1)
    if counted is None:
        return math.nan, math.nan
    rows, num, den = counted
    later = next((r for r in rows if (r.get("epoch") or 0) >= 1), None)
    whole = _ratio(rows[-1], None, num, den)
    return whole, _ratio(rows[-1], later, num, den) if later is not None else math.nan


def _counts(train: list[dict[str, Any]], least: int) -> tuple[list[dict[str, Any]], str, str] | None:
    """(the steps that count, what was generated, what was trained): the buffer's sample counts, else its group
    counts (a run from before them); None where fewer than `least` steps count either."""
    for num, den in (("samples_generated", "samples_trained"), ("groups_received", "groups_kept")):
        rows = [r for r in train if finite(r.get(num), r.get(den))]
        if len(rows) >= least:
            return rows, num, den
    return None


def generated_per_trained_by_part(train: list[dict[str, Any]], parts: int) -> tuple[float, ...]:
    """Samples generated per sample trained in each of `parts` equal spans of the run's steps (the same steps of two
    runs: a fair comparison where one run passes over its prompts faster than the other, and later steps draw from
    prompts the policy has learned). Empty where fewer steps than `parts` count."""
    counted = _counts(train, least=parts)
    if counted is None:
        return ()
    rows, num, den = counted
    ends = [rows[end - 1] for _, end in _spans(len(rows), parts)]
    return tuple(_ratio(last, since, num, den) for since, last in zip([None, *ends], ends, strict=False))


def generated_tokens_per_trained(train: list[dict[str, Any]]) -> float:
    """Response tokens the replicas generated per response token trained, up to the last step that knows the
    replicas' count (`tokens_generated`, from their `dapo_rollout_generated_tokens_total`); NaN for a run from before
    it. A replica restarted mid-run starts its count again: the ratio is then too low, never too high."""
    last = next((i for i in range(len(train) - 1, -1, -1) if finite(train[i].get("tokens_generated"))), None)
    if last is None:
        return math.nan
    trained = sum(r.get("response_tokens") or 0.0 for r in train[: last + 1])
    return train[last]["tokens_generated"] / trained if trained > 0 else math.nan


def _ratio(last: dict[str, Any], since: dict[str, Any] | None, num: str, den: str) -> float:
    """How much `num` grew per `den` from the row `since` (the start: None) to the row `last`."""
    used = last[den] - (since[den] if since else 0)
    return (last[num] - (since[num] if since else 0)) / used if used > 0 else math.nan


def _clock(
    evals: list[dict[str, Any]], train: list[dict[str, Any]], wall: float | None
) -> tuple[list[float], str, float | None]:
    """(minutes since the start of each evaluation, the clock's key, the wall time): see the module's docstring."""
    if evals and all(finite(r.get("eval_at")) for r in evals):
        first = min(evals, key=lambda r: r["eval_at"])
        start = first["eval_at"] - first.get("eval_seconds", 0.0)
        wall = wall if wall is not None else max(r["eval_at"] for r in evals) - start
        return [(r["eval_at"] - start) / 60 for r in evals], "eval_at", wall
    spent = [(r["policy_version"], r.get("seconds", 0.0) + r.get("sync_seconds", 0.0)) for r in train]
    total = sum(s for _, s in spent)
    stretch = wall / total if wall is not None and total > 0 else 1.0
    minutes = [sum(s for v, s in spent if v <= r["policy_version"]) * stretch / 60 for r in evals]
    return minutes, "scaled" if wall is not None and total > 0 else "learner", wall


@dataclass(frozen=True)
class Arm:
    label: str
    runs: list[Run]
    final: tuple[float, float]  # (mean, standard error) over the seeds
    best: tuple[float, float]
    pass_at_k: tuple[float, float]
    wall_min: float | None  # the mean over the runs whose wall time is known
    to_gain_min: float | None  # the mean over the runs that got there
    reached: int  # runs that got there
    versions: tuple[int, int]  # (fewest, most) versions trained
    diff: tuple[float, float] | None  # final mean − the first arm's, Welch's standard error; None: the first arm
    per_trained: tuple[float, float] = (math.nan, math.nan)  # generated per trained sample, whole run: mean, se
    later_per_trained: tuple[float, float] = (math.nan, math.nan)  # ... after the first pass over the prompts
    tokens_per_trained: tuple[float, float] = (math.nan, math.nan)  # generated tokens per trained token, whole run
    per_trained_thirds: tuple[tuple[float, float], ...] = ()  # generated per trained sample, each third of the steps
    entropy_thirds: tuple[tuple[float, float], ...] = ()  # token entropy, each third of the steps: mean, se
    length_thirds: tuple[tuple[float, float], ...] = ()  # response tokens per trained sample, each third
    truncated_thirds: tuple[tuple[float, float], ...] = ()  # trained samples cut at the length bound, each third

    @property
    def seeds(self) -> list[int | None]:
        return [r.seed for r in self.runs]


@dataclass(frozen=True)
class Comparison:
    gain: float
    k: int | None  # the avg@k's k, when every run shares it
    arms: list[Arm]
    differs: dict[str, list[Any]] = field(default_factory=dict)  # key -> each arm's value (UNKNOWN, ABSENT)
    task: str | None = None  # the held-out numbers are this part's of a mixture; None: the whole held-out split
    base: float | None = None  # time to gain counts from this held-out value; None: each run's first evaluation

    @property
    def heldout(self) -> str:
        """What the held-out numbers are: "held-out avg@4", "held-out avg@4 of reasoning_gym/chain_sum"."""
        k = f"avg@{self.k}" if self.k else "avg@k"
        return f"held-out {k}" + (f" of {self.task}" if self.task else "")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (NaN as null), the runs without their curves."""
        data = {
            "gain": self.gain,
            "base": self.base,
            "k": self.k,
            "task": self.task,
            "differs": self.differs,
            "arms": [
                {f: getattr(a, f) for f in Arm.__dataclass_fields__ if f not in ("runs", *STATS)}
                | {f: _stat(getattr(a, f)) for f in STATS}
                | {"seeds": a.seeds, "runs": [_run_json(r, self.gain, self.base) for r in a.runs]}
                for a in self.arms
            ],
        }
        return _plain(data)


UNKNOWN, ABSENT = "?", "(absent)"  # "what differs" for an arm without config.json / without that key
STATS = (
    "final",
    "best",
    "pass_at_k",
    "diff",
    "per_trained",
    "later_per_trained",
    "tokens_per_trained",
)  # Arm's (mean or difference, standard error) pairs


def _stat(pair: tuple[float, float] | None) -> dict[str, float] | None:
    return None if pair is None else {"mean": pair[0], "se": pair[1]}


def _run_json(r: Run, gain: float, base: float | None = None) -> dict[str, Any]:
    keep = (
        "path",
        "seed",
        "preset",
        "versions",
        "wall_s",
        "clock",
        "k",
        "per_trained",
        "tokens_per_trained",
        "per_trained_thirds",
        "entropy_thirds",
        "length_thirds",
        "truncated_thirds",
        "machine",
    )
    return {f: getattr(r, f) for f in keep} | {
        "final": r.final,
        "best": r.best,
        "final_pass_at_k": r.evals[-1].pass_at_k if r.evals else math.nan,
        "minutes_to_gain": r.minutes_to(gain, base),
        "evals": [asdict(e) for e in r.evals],
    }


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x) if isinstance(x, Path) else x


def group(runs: list[Run]) -> tuple[list[tuple[str, list[Run]]], dict[str, list[Any]]]:
    """Runs -> labelled arms (in the order their first run was given) and the config keys that differ between
    arms with each arm's value."""
    arms: dict[str, list[Run]] = {}
    for r in runs:
        same = {k: v for k, v in r.config.items() if not ignored(k)} if r.config is not None else None
        key = json.dumps(same, sort_keys=True, default=str) if same is not None else f"name:{r.name}"
        arms.setdefault(key, []).append(r)
    groups = list(arms.values())
    configs = [g[0].config for g in groups]
    known = [c for c in configs if c is not None]
    keys = sorted(k for k in {k for c in known for k in c} if not ignored(k))
    differs = {
        k: [UNKNOWN if c is None else c.get(k, ABSENT) for c in configs]
        for k in keys
        if len({json.dumps(c.get(k, ABSENT), sort_keys=True, default=str) for c in known}) > 1
    }
    described = [", ".join(f"{k}={_show(v[i])}" for k, v in list(differs.items())[:2]) for i in range(len(groups))]
    more = f", +{len(differs) - 2} more" if len(differs) > 2 else ""
    labels = []
    for g, desc in zip(groups, described, strict=True):
        presets = {r.preset for r in g}
        preset = presets.pop() if len(presets) == 1 else None
        labels.append(preset or (desc + more if desc and g[0].config is not None else g[0].name))
    twice = {label for label in labels if labels.count(label) > 1}  # one preset, arms a --set apart: say which
    labels = [
        (f"{label} ({described[i]}{more})" if described[i] else f"{label} #{i + 1}") if label in twice else label
        for i, label in enumerate(labels)
    ]
    return list(zip(labels, groups, strict=True)), differs


def _show(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def summarize(label: str, runs: list[Run], gain: float, first: list[Run] | None, base: float | None = None) -> Arm:
    reached = [m for r in runs if (m := r.minutes_to(gain, base)) is not None]
    walls = [r.wall_s / 60 for r in runs if r.wall_s is not None]
    return Arm(
        label=label,
        runs=runs,
        final=mean_se([r.final for r in runs]),
        best=mean_se([r.best for r in runs]),
        pass_at_k=mean_se([r.evals[-1].pass_at_k if r.evals else math.nan for r in runs]),
        wall_min=statistics.fmean(walls) if walls else None,
        to_gain_min=statistics.fmean(reached) if reached else None,
        reached=len(reached),
        versions=(min(r.versions for r in runs), max(r.versions for r in runs)),
        diff=welch([r.final for r in runs], [r.final for r in first]) if first is not None else None,
        per_trained=mean_se([r.per_trained[0] for r in runs]),
        later_per_trained=mean_se([r.per_trained[1] for r in runs]),
        tokens_per_trained=mean_se([r.tokens_per_trained for r in runs]),
        per_trained_thirds=_thirds_mean_se([r.per_trained_thirds for r in runs]),
        entropy_thirds=_thirds_mean_se([r.entropy_thirds for r in runs]),
        length_thirds=_thirds_mean_se([r.length_thirds for r in runs]),
        truncated_thirds=_thirds_mean_se([r.truncated_thirds for r in runs]),
    )


def _thirds_mean_se(runs: list[tuple[float, ...]]) -> tuple[tuple[float, float], ...]:
    """Each third's mean ± standard error over the runs that have thirds."""
    return tuple(mean_se([t[i] for t in runs if t]) for i in range(THIRDS))


def comparison(
    run_dirs: list[Path], gain: float = DEFAULT_GAIN, task: str | None = None, base: float | None = None
) -> Comparison:
    """Read, group and summarize the runs (mesh/compare_report.py's `compare` writes them out); `task`: the held-out
    numbers of that part of a mixture; `base`: time to gain counts from this held-out value, not each run's first."""
    runs = [read(p, task) for p in run_dirs]
    groups, differs = group(runs)
    first = groups[0][1] if groups else None
    arms = [summarize(label, rs, gain, None if rs is first else first, base) for label, rs in groups]
    ks = {r.k for r in runs}
    return Comparison(gain, ks.pop() if len(ks) == 1 else None, arms, differs, task, base)
