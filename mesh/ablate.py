"""`dapo-mesh ablate`: presets (DAPO vs GRPO by default) over seeds, and the held-out table.

    dapo-mesh ablate [--presets configs/dapo.toml,configs/grpo.toml] [--seeds 1,2,3] [--steps N] [--run-dir DIR]
    make ablate

Each (preset, seed) is the run `dapo-mesh up --config PRESET --seed SEED` would make, in its own run directory,
one after the other (they share the cores). A run whose metrics.jsonl already holds its final evaluation is not run
again: an interrupted ablation resumes where it stopped. From each run's held-out evaluations (rows of kind "eval"):
the final and the best avg@k. Per preset: the mean and the sample standard deviation over the seeds; then the
difference of the first preset's mean final avg@k from each other preset's, with its standard error
sqrt(s1²/n1 + s2²/n2) (Welch). Written to RUN_DIR/ablate.json and RUN_DIR/ablate.md as well as printed, and the
held-out curves of every run with each preset's mean to RUN_DIR/ablate.png; and `dapo-mesh compare` of the runs
(mesh/compare.py: the arms' standard errors, wall time, time to gain) to RUN_DIR/compare.md and compare.png.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mesh.compare import DEFAULT_GAIN, eval_rows, finite, metric_rows, sample_std, welch
from mesh.compare_report import compare
from mesh.config import MeshConfig
from mesh.curves import Curve, plot_ablation
from mesh.layout import RunLayout


@dataclass(frozen=True)
class RunResult:
    preset: str
    seed: int
    final: float  # held-out avg@k of the last evaluation
    best: float  # the best of its evaluations
    final_version: int
    waste: Waste | None = None


@dataclass(frozen=True)
class Waste:
    """What dynamic sampling threw away (metrics.jsonl's cumulative buffer counts): the fraction of received
    groups filtered and the generated groups per trained one (= samples, G being fixed), over the whole run and
    after the first pass over the training prompts (from the first step the dispatch cursor was in epoch 1)."""

    filtered: float
    generated_per_trained: float
    later_filtered: float
    later_generated_per_trained: float


def step_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The learner steps' rows that carry the buffer's cumulative group counts."""
    return [r for r in rows if r.get("kind") != "eval" and finite(r.get("groups_received"), r.get("groups_kept"))]


def dropped_since(steps: list[dict[str, Any]], since: dict[str, Any] | None = None) -> tuple[float, float]:
    """(share of received groups dynamic sampling dropped, groups received per group kept) from the step row
    `since` (the run's start: None) to the last of `steps`; NaN where nothing was received or kept."""
    last = steps[-1]
    got = last["groups_received"] - (since["groups_received"] if since else 0)
    kept = last["groups_kept"] - (since["groups_kept"] if since else 0)
    return (1 - kept / got, got / kept) if got > 0 and kept > 0 else (math.nan, math.nan)


def read_waste(run_dir: Path) -> Waste | None:
    steps = step_rows(metric_rows(RunLayout(run_dir).metrics))
    if not steps:
        return None
    later = next((r for r in steps if r.get("epoch", 0) >= 1), None)
    return Waste(*dropped_since(steps), *(dropped_since(steps, later) if later is not None else (math.nan, math.nan)))


@dataclass(frozen=True)
class PresetSummary:
    preset: str
    seeds: list[int]
    final_mean: float
    final_std: float
    best_mean: float
    best_std: float


@dataclass(frozen=True)
class Difference:
    preset: str  # compared with the first preset
    diff: float  # first preset's mean final avg@k minus this one's
    stderr: float


def read_run(run_dir: Path) -> tuple[float, float, int] | None:
    """(final avg@k, best avg@k, version of the final evaluation) from a run's metrics.jsonl; None before any."""
    evals = [(v, r["eval_acc"]) for v, r in _evals(run_dir)]
    if not evals:
        return None
    return evals[-1][1], max(acc for _, acc in evals), evals[-1][0]


def _evals(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """(policy version, row) of a run's held-out evaluations, in version order; none before any."""
    return [(r["policy_version"], r) for r in eval_rows(metric_rows(RunLayout(run_dir).metrics))]


def summarize(results: list[RunResult]) -> tuple[list[PresetSummary], list[Difference]]:
    order = list(dict.fromkeys(r.preset for r in results))
    by = {p: [r for r in results if r.preset == p] for p in order}
    rows = [
        PresetSummary(
            p,
            [r.seed for r in rs],
            statistics.fmean(r.final for r in rs),
            sample_std([r.final for r in rs]),
            statistics.fmean(r.best for r in rs),
            sample_std([r.best for r in rs]),
        )
        for p, rs in by.items()
    ]
    first = [r.final for r in by[order[0]]]
    diffs = [Difference(p, *welch(first, [r.final for r in by[p]])) for p in order[1:]]
    return rows, diffs


def markdown(results: list[RunResult]) -> str:
    """The table for the docs (docs/results/seeds.md): one line per run, one per preset (mean ± std), the
    differences."""
    rows, diffs = summarize(results)
    out = [
        "| preset | seed | final held-out avg@k | best | filtered (after 1st pass) | generated / trained (after) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        w = r.waste or Waste(math.nan, math.nan, math.nan, math.nan)
        out.append(
            f"| {r.preset} | {r.seed} | {r.final:.3f} (v{r.final_version}) | {r.best:.3f} | {w.filtered:.0%} "
            f"({w.later_filtered:.0%}) | {w.generated_per_trained:.2f} ({w.later_generated_per_trained:.2f}) |"
        )
    out += [
        f"| **{s.preset}** | mean ± std over {len(s.seeds)} | **{s.final_mean:.3f} ± {s.final_std:.3f}** | "
        f"{s.best_mean:.3f} ± {s.best_std:.3f} | | |"
        for s in rows
    ]
    out += [f"\n{rows[0].preset} − {d.preset}: {d.diff:+.3f} ± {d.stderr:.3f} (standard error)" for d in diffs]
    return "\n".join(out)


def run_dir_of(root: Path, preset: Path, seed: int) -> Path:
    return root / f"{preset.stem}-seed{seed}"


Runner = Callable[[MeshConfig], Any]


def ablate(
    presets: list[Path],
    seeds: list[int],
    root: Path,
    *,
    steps: int | None = None,
    say: Callable[[str], None] = print,
    run: Runner | None = None,
) -> list[RunResult]:
    """Every preset with every seed (skipping runs already complete), then their results in that order."""
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for preset in presets:
        for seed in seeds:
            cfg = MeshConfig.from_preset(preset, run_dir=run_dir_of(root, preset, seed), seed=seed)
            cfg = cfg.model_copy(update={"steps": steps or cfg.steps})
            done = read_run(cfg.run_dir)
            if done is None or done[2] < cfg.steps:
                say(f"ablation: {preset.stem} with seed {seed} ({cfg.steps} steps) in {cfg.run_dir}")
                (run or functools.partial(_run_mesh, preset=str(preset)))(cfg)
                done = read_run(cfg.run_dir)
            if done is None:
                raise RuntimeError(f"{cfg.run_dir}: the run made no held-out evaluation (eval_every is 0?)")
            results.append(RunResult(preset.stem, seed, *done, waste=read_waste(cfg.run_dir)))
    (root / "ablate.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    (root / "ablate.md").write_text(markdown(results) + "\n")
    draw(root, presets, seeds)
    compare([run_dir_of(root, p, s) for p in presets for s in seeds], root, DEFAULT_GAIN)
    return results


def eval_curves(run_dir: Path) -> tuple[Curve, Curve]:
    """(held-out avg@k, mean response tokens) by policy version, from a run's evaluations."""
    evals = _evals(run_dir)
    return (
        [(v, r["eval_acc"]) for v, r in evals],
        [(v, r["eval_response_tokens"]) for v, r in evals if "eval_response_tokens" in r],
    )


def draw(root: Path, presets: list[Path], seeds: list[int]) -> Path:
    """RUN_DIR/ablate.png: every run's held-out curve, and each preset's mean."""
    runs = {p.stem: {s: eval_curves(run_dir_of(root, p, s)) for s in seeds} for p in presets}
    return plot_ablation(runs, root / "ablate.png")


def _run_mesh(cfg: MeshConfig, preset: str | None = None) -> Any:
    from mesh.up import Mesh

    mesh = Mesh(cfg, say=lambda _: None, preset=preset)  # config.json names it: compare labels the arms by it
    try:
        mesh.start()
        return mesh.run()
    finally:
        mesh.stop()
