"""How `dapo-mesh compare` shows a Comparison (mesh/compare.py): one table — what differs between the arms, then
each arm's numbers, a column per arm — as markdown or as a rich table, a line per run, and one figure of the curves.

    print(markdown(comparison)); console.print(table(comparison)); draw(comparison, Path("compare.png"))
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.compare import DEFAULT_GAIN, Arm, Comparison, Run, comparison
from mesh.curves import _save

if TYPE_CHECKING:
    from rich.table import Table

CLOCKS = {  # Run.clock -> how its minutes were found (mesh/compare.py's docstring)
    "eval_at": "the evaluations' timestamps",
    "scaled": "estimated from the learner's seconds per step, stretched to the run's wall time",
    "learner": "the learner's seconds per step: a lower bound (no wall time known)",
}
UNRECORDED = "not recorded (a run from before cpu.json kept it)"  # a run's machine, without cpu.json's
Section = tuple[str, list[tuple[str, list[str]]]]  # (title, [(row name, a cell per arm)])


def _pm(stat: tuple[float, float], signed: bool = False, digits: int = 3) -> str:
    mean, se = stat
    if not math.isfinite(mean):
        return "—"
    return f"{mean:{'+' if signed else ''}.{digits}f} ± {f'{se:.{digits}f}' if math.isfinite(se) else '—'}"


def _thirds(parts: tuple[tuple[float, float], ...], digits: int = 2) -> str:
    means = [m for m, _ in parts]
    return (
        "—"
        if not any(math.isfinite(m) for m in means)
        else " / ".join(f"{m:.{digits}f}" if math.isfinite(m) else "—" for m in means)
    )


def _minutes(m: float | None) -> str:
    return "unknown" if m is None else f"{m:.1f} min"


def _value(v: Any) -> str:  # as compare.py's labels show it
    return v if isinstance(v, str) else json.dumps(v)


def _span(low: int, high: int) -> str:
    return f"{low}" if low == high else f"{low}–{high}"


def _base(c: Comparison) -> str:
    return "the first eval" if c.base is None else f"{c.base:g}"


def _to_gain(a: Arm) -> str:
    if a.to_gain_min is None:
        return "not reached"
    return f"{a.to_gain_min:.1f} min ({a.reached} of {len(a.runs)})"


def sections(c: Comparison) -> list[Section]:
    """The table's two sections: the config keys that differ between arms, and each arm's numbers."""
    k, heldout, part = f"avg@{c.k}" if c.k else "avg@k", c.heldout, f" of {c.task}" if c.task else ""
    first = c.arms[0].label if c.arms else ""
    numbers = [
        ("seeds", [", ".join("?" if s is None else str(s) for s in a.seeds) for a in c.arms]),
        (f"final {heldout} (mean ± se)", [_pm(a.final) for a in c.arms]),
        (f"best {heldout}", [_pm(a.best) for a in c.arms]),
        (f"final pass@{c.k or 'k'}", [_pm(a.pass_at_k) for a in c.arms]),
        (f"final − {first} (± Welch se)", ["—" if a.diff is None else _pm(a.diff, signed=True) for a in c.arms]),
        ("wall time (mean)", [_minutes(a.wall_min) for a in c.arms]),
        (f"time to +{c.gain:.2f} {k}{part} over {_base(c)}", [_to_gain(a) for a in c.arms]),
        ("versions trained", [_span(*a.versions) for a in c.arms]),
        ("generated per trained sample", [_pm(a.per_trained, digits=2) for a in c.arms]),
        ("… after the first pass", [_pm(a.later_per_trained, digits=2) for a in c.arms]),
        ("… in each third of the steps", [_thirds(a.per_trained_thirds) for a in c.arms]),
        ("generated tokens per trained token", [_pm(a.tokens_per_trained, digits=2) for a in c.arms]),
        ("token entropy in each third of the steps", [_thirds(a.entropy_thirds) for a in c.arms]),
        ("response tokens per trained sample, each third", [_thirds(a.length_thirds, 0) for a in c.arms]),
        ("trained samples cut at the length bound, each third", [_thirds(a.truncated_thirds, 3) for a in c.arms]),
    ]
    differs = [(key, [_value(v) for v in values]) for key, values in c.differs.items()]
    if not differs:  # one arm, or arms made before runs wrote their config
        unknown = any(a.runs[0].config is None for a in c.arms)
        differs = [("(unknown: no config.json)" if unknown else "(nothing)", ["" for _ in c.arms])]
    return [("what differs", differs), ("results", numbers)]


def markdown(c: Comparison) -> str:
    """The table, a line per run, and what the times are."""
    head = ["", *(a.label for a in c.arms)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for title, rows in sections(c):
        out.append(f"| **{title}** |" + " |" * len(c.arms))
        out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    out += ["", "| arm | seed | run | final | best | pass@k | wall | to gain | versions |", "|---" * 9 + "|"]
    out += [_run_line(a, r, c.gain, c.base) for a in c.arms for r in a.runs]
    unknown = [a.label for a in c.arms if a.runs[0].config is None]
    if unknown:
        out.append(f"\nWithout config.json (grouped by directory name, seed from it): {', '.join(unknown)}.")
    machines: dict[str, list[str]] = {}
    for r in (r for a in c.arms for r in a.runs):
        machines.setdefault(r.machine or UNRECORDED, []).append(r.path.name)
    if len(machines) > 1 or UNRECORDED not in machines:
        out.append(
            "\nMachines (compare times only within one): "
            + "; ".join(f"{m}: {', '.join(n)}" for m, n in machines.items())
        )
    clocks = sorted({r.clock for a in c.arms for r in a.runs})
    out.append("\nMinutes since each run's start: " + "; ".join(f"{_clock_runs(c, k)}: {CLOCKS[k]}" for k in clocks))
    return "\n".join(out)


def _run_line(a: Arm, r: Run, gain: float, base: float | None = None) -> str:
    numbers = (r.final, r.best, r.evals[-1].pass_at_k if r.evals else math.nan)
    wall = _minutes(None if r.wall_s is None else r.wall_s / 60)
    to_gain = r.minutes_to(gain, base)
    return (
        f"| {a.label} | {r.seed if r.seed is not None else '?'} | {r.path} | "
        + " | ".join(f"{x:.3f}" if math.isfinite(x) else "—" for x in numbers)
        + f" | {wall} | {'not reached' if to_gain is None else _minutes(to_gain)} | {r.versions} |"
    )


def _clock_runs(c: Comparison, clock: str) -> str:
    runs = [r for a in c.arms for r in a.runs]
    return "every run" if all(r.clock == clock for r in runs) else f"{sum(r.clock == clock for r in runs)} runs"


def table(c: Comparison) -> Table:
    """The same table for a terminal."""
    from rich.table import Table

    t = Table("", *(a.label for a in c.arms), title=f"{sum(len(a.runs) for a in c.arms)} runs in {len(c.arms)} arms")
    for title, rows in sections(c):
        t.add_row(f"[bold]{title}[/]", *("" for _ in c.arms))
        for name, cells in rows:
            t.add_row(name, *cells)
        t.add_section()
    return t


def draw(c: Comparison, out: Path) -> Path:
    """Held-out avg@k by policy version and by minutes since the run's start, batch reward and token entropy by
    step: a thin line per run, a thick one per arm (the mean over its runs at the versions or steps they share), a
    colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(13, 9), constrained_layout=True)
    axes = grid.ravel()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(c.arms):
        style = {"color": colours[i % len(colours)]}
        label = f"{arm.label} ({len(arm.runs)} run{'s' * (len(arm.runs) > 1)})"
        by_version = [{e.version: (e.minutes, e.acc) for e in r.evals} for r in arm.runs]
        _overlay(axes[0], [{v: acc for v, (_, acc) in run.items()} for run in by_version], style, label)
        _overlay(axes[1], by_version, style, label, xy=True)
        _overlay(axes[2], [dict(r.rewards) for r in arm.runs], style, label)
        _overlay(axes[3], [dict(r.entropy) for r in arm.runs], style, label)
    estimated = any(r.clock != "eval_at" for a in c.arms for r in a.runs)  # old runs: no timestamps
    titles = (c.heldout, c.heldout + " (minutes estimated)" * estimated, "batch reward", "token entropy")
    xlabels = ("policy version", "minutes since the run's start", "learner step", "learner step")
    for ax, title, xlabel in zip(axes, titles, xlabels, strict=True):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, out)


def _overlay(ax: Any, runs: list[dict[int, Any]], style: dict[str, Any], label: str, xy: bool = False) -> None:
    """Each run thin, the mean at the keys every run has thick; `xy`: the values are (x, y) points, the mean's x
    their mean too (minutes at a version)."""
    points = [[v if xy else (key, v) for key, v in sorted(run.items())] for run in runs]
    for pts in points:
        if pts:
            ax.plot(*zip(*pts, strict=True), alpha=0.35, linewidth=1, **style)
    shared = sorted(set.intersection(*(set(run) for run in runs))) if runs else []
    if not shared:
        return
    mean = [
        (
            sum(run[key][0] for run in runs) / len(runs) if xy else key,
            sum((run[key][1] if xy else run[key]) for run in runs) / len(runs),
        )
        for key in shared
    ]
    ax.plot(*zip(*mean, strict=True), linewidth=2.5, marker="o" if len(mean) < 30 else None, label=label, **style)


def compare(
    run_dirs: list[Path],
    out: Path | None,
    gain: float = DEFAULT_GAIN,
    task: str | None = None,
    base: float | None = None,
) -> Comparison:
    """The runs compared (mesh/compare.py; `task`: one part's held-out numbers, `base`: the held-out value time to
    gain counts from); with `out`, compare.md, compare.json and compare.png written there."""
    result = comparison(run_dirs, gain, task, base)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(markdown(result) + "\n")
        (out / "compare.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
        draw(result, out / "compare.png")
    return result
