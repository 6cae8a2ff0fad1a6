"""What every benchmark shares: a result row, timing, and the table printer."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Result:
    bench: str
    what: str
    ours: float
    limit: float
    unit: str
    limit_is: str  # what the limit measures
    goal: str = ""  # says which way is good: "≥ 0.5" for rates, "≤ 1.15" for times

    @property
    def ratio(self) -> float:
        return self.ours / self.limit if self.limit else float("nan")

    def row(self) -> dict[str, object]:
        return asdict(self) | {"ratio": round(self.ratio, 3)}


def best_rates(fns: list[Callable[[], int]], repeats: int = 5) -> list[float]:
    """Items per second of each `fn` (which returns how many items it handled): the median over
    `repeats` rounds, the functions interleaved within a round so that drift hits all alike."""
    rates: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, rates, strict=True):
            t0 = time.perf_counter()
            n = fn()
            out.append(n / (time.perf_counter() - t0))
    return [statistics.median(r) for r in rates]


def print_table(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("bench", "what", "ours", "limit", "unit", "ratio", "limit is", "goal")
    for r in results:
        table.add_row(
            r.bench, r.what, f"{r.ours:,.4g}", f"{r.limit:,.4g}", r.unit, f"{r.ratio:.2f}", r.limit_is, r.goal
        )
    Console(width=200).print(table)
    print(json.dumps([r.row() for r in results]))


def engine_script(name: str, script: str, args: list[str], *, timeout_s: float = 1800) -> dict[str, Any]:
    """Run a benchmark's script in its own process (vLLM's engine in that process, its compile cache in a fresh
    folder) and return what it printed on its `RESULT {json}` line."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix=f"dapo-bench-{name}-"))
    (tmp / f"{name}.py").write_text(script)
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {
        "PYTHONPATH": str(root),
        "VLLM_CACHE_ROOT": str(tmp / "v"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    r = subprocess.run(
        [sys.executable, str(tmp / f"{name}.py"), *args],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if r.returncode:
        raise RuntimeError(f"bench {name}: {r.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    return out
